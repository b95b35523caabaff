"""Self-hosted servers end to end over 127.0.0.1, the ``openai`` SDK as the client, against
fakes that serve vLLM's, SGLang's and llama.cpp's own pages (``fake_engine``): the proxy
learns what each can start, keeps calls in its own queue (in tier order) rather than the
server's, sends each call's tier as ``priority`` where the server schedules by it (and
stops where it is refused), sends load to the emptier server, and falls back, saying so,
where a server cannot be read."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.core.call.tokens import TokenCounter
from proxy.core.health import fleet
from proxy.http.call.service import SERVICE, Service
from proxy.http.server.app import build_app

from .conftest import config_from
from .fake_engine import FakeEngine

Factory = Callable[..., Awaitable[Any]]
TIERS = ("critical", "high", "normal", "low")


async def start(aiohttp_server: Factory, counter: TokenCounter,
                engines: dict[str, FakeEngine], models: dict[str, Any] | None = None,
                **settings: Any) -> tuple[openai.AsyncOpenAI, Service]:
    providers = []
    for name, fake in engines.items():
        server = await aiohttp_server(fake.app())
        providers.append({"name": name, "base_url": str(server.make_url("/v1")),
                          "engine": fake.engine, "read_every_s": 0.2,
                          **settings.get(name, {})})
    config = config_from(providers, models or {
        "m": [{"provider": name, "model": "served"} for name in engines]})
    app = build_app(config, counter=counter)
    proxy: TestServer = await aiohttp_server(app)
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="k",
                                max_retries=0)
    return client, app[SERVICE]


async def call(client: openai.AsyncOpenAI, text: str, tier: str = "normal",
               stream: bool = False) -> float:
    """One call; the seconds it took."""
    began = time.monotonic()
    if stream:
        chunks = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], stream=True,
            extra_headers={"X-Priority": tier})
        async for _ in chunks:
            pass
    else:
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}],
            extra_headers={"X-Priority": tier})
        assert answer.choices[0].message.content
    return time.monotonic() - began


def provider_status(service: Service, name: str) -> dict[str, Any]:
    providers = service.status()["providers"]
    assert isinstance(providers, dict)
    found: dict[str, Any] = providers[name]
    return found


async def until(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "never came true"
        await asyncio.sleep(0.02)


async def test_llama_slots_are_learned_and_nothing_waits_inside_the_server(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeEngine("llama.cpp", slots=3, service_s=0.15)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    await until(lambda: provider_status(service, "gpu")["limit"] == 3)
    assert provider_status(service, "gpu")["limit_source"] == "engine"
    low = [asyncio.create_task(call(client, f"low {i}", "low", stream=i % 2 == 0))
           for i in range(12)]
    await asyncio.sleep(0.05)  # the low calls fill the slots and the proxy's queue
    critical = [asyncio.create_task(call(client, f"critical {i}", "critical"))
                for i in range(3)]
    low_s, critical_s = await asyncio.gather(asyncio.gather(*low), asyncio.gather(*critical))
    assert fake.peak_waiting == 0 and fake.peak_running <= 3
    # The critical calls, though they came last, started before every low call queued then.
    order = [text for _, text in fake.received]
    assert max(order.index(f"critical {i}") for i in range(3)) < order.index("low 11")
    assert sum(critical_s) / len(critical_s) < sum(low_s) / len(low_s)


async def test_others_calls_on_a_server_are_not_the_proxys_to_use(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeEngine("llama.cpp", slots=4, others=3, service_s=0.1)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    await until(lambda: provider_status(service, "gpu")["limit"] == 1)
    await asyncio.gather(*(call(client, f"c {i}") for i in range(6)))
    assert fake.peak_waiting == 0 and fake.peak_running == 1
    engine = provider_status(service, "gpu")["engine"]
    assert (engine["capacity"], engine["others"]) == (4, 3)


async def test_llama_without_metrics_is_read_from_its_slots(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeEngine("llama.cpp", slots=2, metrics=False)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    await until(lambda: provider_status(service, "gpu")["limit"] == 2)
    await asyncio.gather(*(call(client, f"c {i}") for i in range(5)))
    assert fake.peak_waiting == 0


@pytest.mark.parametrize(("engine", "numbers"), [
    ("vllm", {"critical": 0, "high": 1, "normal": 2, "low": 3}),
    ("sglang", {"critical": 3, "high": 2, "normal": 1, "low": 0}),
])
async def test_each_tier_reaches_the_server_as_its_priority(
        aiohttp_server: Factory, counter: TokenCounter, engine: str,
        numbers: dict[str, int]) -> None:
    fake = FakeEngine(engine, slots=8)
    client, _ = await start(aiohttp_server, counter, {"gpu": fake})
    for tier in TIERS:
        await call(client, tier, tier, stream=tier == "high")
    assert {text: priority for priority, text in fake.received} == numbers


async def test_a_candidates_own_priority_numbers_win(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeEngine("vllm", slots=8)
    client, _ = await start(aiohttp_server, counter, {"gpu": fake}, models={"m": [
        {"provider": "gpu", "model": "served", "priority": {"critical": -10, "low": 50}}]})
    for tier in ("critical", "normal", "low"):
        await call(client, tier, tier)
    assert {text: priority for priority, text in fake.received} == {
        "critical": -10, "normal": 2, "low": 50}


async def test_a_server_that_reorders_by_priority_starts_urgent_calls_first(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    """With a cap above its real slots (a learned capacity before it is learned), calls
    wait inside a priority-scheduling server: the numbers the proxy sent put them in tier
    order there too."""
    fake = FakeEngine("vllm", slots=1, service_s=0.2)
    client, _ = await start(aiohttp_server, counter, {"gpu": fake}, gpu={"max_concurrency": 4})
    await until(lambda: fake.reads > 0)
    first = asyncio.create_task(call(client, "first", "normal"))
    await until(lambda: fake.running == 1)
    rest = [asyncio.create_task(call(client, tier, tier)) for tier in ("low", "high", "critical")]
    await asyncio.gather(first, *rest)
    assert fake.peak_waiting == 3  # sent before the server was seen to hold one at a time
    assert fake.started == [2, 0, 1, 3]  # the rest by priority, most urgent first


async def test_a_server_without_priority_scheduling_is_sent_none_after_its_400(
        aiohttp_server: Factory, counter: TokenCounter, caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeEngine("vllm", slots=4, priority_scheduling=False)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    for i in range(3):
        await call(client, f"c {i}", "high", stream=i == 1)
    assert [priority for priority, _ in fake.received] == [1, None, None, None]
    assert provider_status(service, "gpu")["priority"].startswith("refused")
    assert sum("refused the priority field" in r.message for r in caplog.records) == 1


async def test_a_clients_bad_request_quoting_the_words_turns_nothing_off(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    """A 400 that quotes the call (its message says "priority scheduling") is tried once
    more without the field; refused the same way, it is the client's, passed through, and
    the server keeps getting priority."""
    fake = FakeEngine("vllm", slots=4)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    with pytest.raises(openai.BadRequestError) as refused:
        await call(client, "bad request: tell me about priority scheduling", "high")
    assert "validation error" in str(refused.value)
    await call(client, "fine", "high")
    assert [priority for priority, _ in fake.received] == [1, None, 1]
    assert provider_status(service, "gpu")["priority"].startswith("sent")


async def test_priority_off_sends_none(aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeEngine("sglang", slots=4)
    client, _ = await start(aiohttp_server, counter, {"gpu": fake}, gpu={"priority": False})
    await call(client, "c", "critical")
    await client.chat.completions.create(  # the client's own is not passed on either
        model="m", messages=[{"role": "user", "content": "own"}], extra_body={"priority": -5})
    assert fake.received == [(None, "c"), (None, "own")]


async def test_calls_go_to_the_server_with_the_most_free_slots(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    busy = FakeEngine("llama.cpp", slots=4, others=3)
    idle = FakeEngine("llama.cpp", slots=4)
    client, service = await start(aiohttp_server, counter, {"busy": busy, "idle": idle})
    await until(lambda: provider_status(service, "busy")["limit"] == 1
                and provider_status(service, "idle")["limit"] == 4)
    for i in range(4):
        await call(client, f"c {i}")
    assert (len(busy.received), len(idle.received)) == (0, 4)
    busy.others, idle.others = 0, 4  # the other clients moved
    await until(lambda: provider_status(service, "idle")["limit"] == 0
                and provider_status(service, "busy")["limit"] == 4)
    for i in range(3):
        await call(client, f"d {i}")
    assert (len(busy.received), len(idle.received)) == (3, 4)


async def test_sglangs_ranks_are_counted_once(aiohttp_server: Factory,
                                              counter: TokenCounter) -> None:
    fake = FakeEngine("sglang", slots=8, others=2)
    _, service = await start(aiohttp_server, counter, {"gpu": fake})
    await until(lambda: provider_status(service, "gpu")["engine"]["running"] is not None)
    engine = provider_status(service, "gpu")["engine"]
    assert (engine["running"], engine["waiting"], engine["others"]) == (2, 0, 2)


async def test_an_unreadable_server_falls_back_and_says_so(
        aiohttp_server: Factory, counter: TokenCounter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "GRACE_MIN_S", 0.3)
    monkeypatch.setattr(fleet, "UNREADABLE_S", 1.0)
    fake = FakeEngine("vllm", slots=4, broken=True)
    client, service = await start(aiohttp_server, counter, {"gpu": fake})
    took = await call(client, "held until the fall-back")  # full until then, never empty
    assert took >= 0.8
    shown = provider_status(service, "gpu")
    assert (shown["limit_source"], shown["limit"]) == ("latency", 8)
    assert shown["engine"]["readable"] is False and "500" in shown["engine"]["error"]
    metrics = service.metrics.render().decode()
    assert 'proxy_engine_readable{provider="gpu"} 0.0' in metrics
    assert 'proxy_upstream_limit_source{provider="gpu",source="latency"} 1.0' in metrics
    fake.broken = False
    await until(lambda: provider_status(service, "gpu")["limit_source"] == "engine")
    assert provider_status(service, "gpu")["engine"]["readable"] is True


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_page_past_its_bound_is_not_read_and_the_server_counts_as_unreadable(
        aiohttp_server: Factory, counter: TokenCounter,
        monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    """A /metrics of 17 MiB (a wrong base_url, a server gone mad): not held in memory,
    whether it says its length or streams it; the server falls back as if unreadable."""
    monkeypatch.setattr(fleet, "GRACE_MIN_S", 0.3)
    monkeypatch.setattr(fleet, "UNREADABLE_S", 1.0)
    fake = FakeEngine("vllm", slots=4, padding=17 * 1024 * 1024, chunked=chunked)
    _, service = await start(aiohttp_server, counter, {"gpu": fake})
    await until(lambda: provider_status(service, "gpu")["limit_source"] == "latency")
    assert "longer than 16 MiB" in provider_status(service, "gpu")["engine"]["error"]
    fake.padding = 0
    await until(lambda: provider_status(service, "gpu")["limit_source"] == "engine")
