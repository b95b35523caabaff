"""The promises under lies and throttling, over real sockets against fake upstreams: a
429 is absorbed, not passed on; a provider that allows fewer calls than configured is
used to its real capacity; one absurd max_tokens poisons nobody; a provider that rejects
the proxy's key is failed over, never quoted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def proxy_for(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
    fakes: dict[str, FakeUpstream], concurrency: int = 8,
    provider_extra: dict[str, Any] | None = None, models: dict[str, Any] | None = None,
    **sections: Any,
) -> TestClient[Any, Any]:
    providers = []
    for name, fake in fakes.items():
        server = await aiohttp_server(fake.app())
        providers.append({"name": name, "base_url": str(server.make_url("/v1")),
                          "api_key": "sk-provider-secret", "max_concurrency": concurrency,
                          **(provider_extra or {})})
    models = models or {"m": [{"provider": name, "model": "x"} for name in fakes]}
    config = config_from(providers, models, **sections)
    client: TestClient[Any, Any] = await aiohttp_client(build_app(config, counter=counter))
    return client


async def test_one_429_does_not_turn_the_queue_into_503s(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """The only provider throttles once while calls queue behind it: every call waits for
    the pause and is served; none gets a 429 or a 503."""
    fake = FakeUpstream(hold_s=0.05, retry_after_ms="300")
    fake.script.extend(["429"])
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"p": fake},
                             concurrency=2)
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT)
                                       for _ in range(8)))
    assert [r.status for r in responses] == [200] * 8
    assert fake.throttled == 1 and fake.completed == 8


async def test_a_provider_that_allows_fewer_calls_than_configured_makes_clients_wait(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """max_concurrency says 8, the upstream really allows 2: concurrent clients are all
    served (they wait, they do not fail), and the limit adapts down to what is real."""
    fake = FakeUpstream(hold_s=0.1, capacity=2, retry_after_ms="100")
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"p": fake},
                             concurrency=8)
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT)
                                       for _ in range(16)))
    assert [r.status for r in responses] == [200] * 16
    assert fake.completed == 16 and fake.peak <= 8
    assert fake.throttled <= 8  # the limit came down to 2: no storm of re-sent 429s
    assert client.app[SERVICE].scheduler.capacity("p") <= 3


async def test_a_paused_provider_is_not_forgotten(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """A throttles at 2 of its configured 4; B is slower. Calls queued while A is paused
    keep A as a candidate, so A keeps serving instead of sitting idle."""
    a = FakeUpstream(hold_s=0.05, capacity=2, retry_after_ms="100")
    b = FakeUpstream(hold_s=0.3)
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"a": a, "b": b},
                             concurrency=4)
    responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT)
                                       for _ in range(40)))
    assert [r.status for r in responses] == [200] * 40
    upstreams = [r.headers["x-proxy-upstream"] for r in responses]
    assert upstreams.count("a/x") > upstreams.count("b/x")
    assert a.throttled >= 1


async def test_an_absurd_max_tokens_moves_only_its_own_call(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """max_tokens 2**62 once must not leave the provider's (or the key's) tpm bucket in a
    debt that stops everyone after it."""
    fake = FakeUpstream()
    client = await proxy_for(
        aiohttp_server, aiohttp_client, counter, {"p": fake},
        provider_extra={"tpm": 200_000},
        classify={"keys": [{"name": "k", "key": "key-1", "tpm": 200_000}]},
    )
    auth = {"Authorization": "Bearer key-1"}
    big = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2**62},
                            headers=auth)
    assert big.status == 200
    started = time.perf_counter()
    normal = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50},
                               headers=auth)
    # A debt would hold it until the bucket refilled (never, at 2**62) or its max_wait. The
    # queue time is the proxy's own (0 ms measured); the round trip's bound is generous.
    assert normal.status == 200 and time.perf_counter() - started < 5.0
    assert int(normal.headers["x-proxy-queue-ms"]) < 500


async def test_implausible_upstream_usage_is_not_believed(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream(usage={"prompt_tokens": 5, "completion_tokens": 10**15,
                               "total_tokens": 10**15})
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"p": fake})
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 20})
    assert resp.status == 200
    metrics = client.app[SERVICE].metrics.render().decode()
    line = next(x for x in metrics.splitlines()
                if x.startswith('proxy_tokens_total{kind="completion"'))
    assert float(line.split()[-1]) <= 20


async def test_a_provider_rejecting_the_proxys_key_is_failed_over_and_never_quoted(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    wrong, right = FakeUpstream(default="401"), FakeUpstream()
    client = await proxy_for(aiohttp_server, aiohttp_client, counter,
                             {"wrong": wrong, "right": right})
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200 and resp.headers["x-proxy-upstream"] == "right/x"
    alone = await proxy_for(aiohttp_server, aiohttp_client, counter,
                            {"wrong": FakeUpstream(default="401")})
    resp = await alone.post("/v1/chat/completions", json=CHAT)
    body = await resp.text()
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "upstream_auth_error"
    assert "sk-prov" not in body and "Incorrect API key" not in body
    status = await (await alone.get("/admin/status")).json()
    assert status["breakers"]["wrong/x"]["consecutive_failures"] >= 1


async def test_the_sdk_sees_a_throttled_call_succeed_and_a_hopeless_one_time_out(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """With the official SDK as the client: a short throttle is invisible; a provider that
    throttles past the tier's deadline gives the proxy's own 503 queue_timeout with
    retry-after, never the upstream's 429."""
    fake = FakeUpstream(retry_after_ms="200")
    fake.script.extend(["429", "429"])
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"p": fake},
                             tiers=[{"name": "only", "max_wait_s": 1.5}])
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="any",
                             max_retries=0)
    reply = await sdk.chat.completions.create(model="m", messages=CHAT["messages"])  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    fake.default = "429"
    with pytest.raises(openai.InternalServerError) as info:
        await sdk.chat.completions.create(model="m", messages=CHAT["messages"])  # type: ignore[arg-type]
    assert info.value.status_code == 503
    assert info.value.response.json()["error"]["code"] == "queue_timeout"
    assert int(info.value.response.headers["retry-after"]) >= 1
    await sdk.close()


async def test_a_429_is_never_what_the_client_gets_even_when_the_call_gives_up(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """A 500, a re-try that draws a 429, then the retry allowance is spent: the client gets
    the upstream's 500, never its 429."""
    fake = FakeUpstream(retry_after_ms="10")
    fake.script.extend(["500", "429"])
    client = await proxy_for(aiohttp_server, aiohttp_client, counter, {"p": fake},
                             retry={"backoff_base_s": 0.01})
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 500
    assert (await resp.json())["error"]["code"] == "fake_500"
    assert len(fake.seen) == 2
