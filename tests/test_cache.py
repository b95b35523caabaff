"""The response cache: deterministic calls only, a canonical fingerprint per proxy key,
streamed replay as valid SSE, no slot and no upstream tokens for a hit, bounded by TTL and size."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import ConfigError
from proxy.core.call.tokens import TokenCounter
from proxy.core.clock import FakeClock
from proxy.core.formats.request import BodyLimits, parse_call
from proxy.http.call.cache import (
    Entry,
    ResponseCache,
    assemble,
    deterministic,
    fingerprint_of,
    pack,
    replay,
    unpack,
)
from proxy.http.call.service import SERVICE
from proxy.http.call.tally import event_data
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream, completion

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize(("body", "expected"), [
    ({"temperature": 0}, True), ({"temperature": 0.0}, True), ({"seed": 7}, True),
    ({"temperature": 0.7, "seed": 1}, True), ({"temperature": 0.2}, False), ({}, False),
    ({"temperature": False}, False), ({"seed": None}, False), ({"temperature": "0"}, False),
])
def test_only_deterministic_calls_are_cached(body: dict[str, Any], expected: bool) -> None:
    assert deterministic(body) is expected


def key(counter: TokenCounter, body: dict[str, Any], key_name: str = "app",
        kind: Any = "chat") -> bytes:
    raw = orjson.dumps({"model": "m", "messages": MESSAGES, **body})
    return fingerprint_of(key_name, parse_call(raw, kind, BodyLimits(), counter))


def test_the_fingerprint_is_the_canonical_request_per_key(counter: TokenCounter) -> None:
    base = key(counter, {"temperature": 0, "max_tokens": 5})
    assert key(counter, {"max_tokens": 5, "temperature": 0.0}) == base
    assert key(counter, {"temperature": 0, "max_tokens": 5, "stream": True,
                         "stream_options": {"include_usage": True}, "user": "u1"}) == base
    assert key(counter, {"temperature": 0, "max_tokens": 6}) != base
    assert key(counter, {"temperature": 0, "max_tokens": 5}, key_name="other") != base
    assert key(counter, {"temperature": 0, "max_tokens": 5, "seed": 1}) != base


def test_a_replayed_stream_assembles_back_to_the_answer() -> None:
    answer = orjson.dumps({**completion("up", "Four."), "system_fingerprint": "fp"})
    stream = replay("chat", answer, include_usage=True)
    events = [e for e in stream.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    payloads = [event_data(e) or b"" for e in events[:-1]]
    whole = orjson.loads(assemble("chat", payloads) or b"{}")
    original = orjson.loads(answer)
    assert whole["choices"][0]["message"]["content"] == "Four."
    assert whole["usage"] == original["usage"] and whole["id"] == original["id"]
    assert b'"usage"' not in replay("chat", answer, include_usage=False)
    tools = orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": []}}]})
    assert assemble("chat", [tools]) is None
    assert assemble("chat", [b"not json"]) is None
    text = orjson.dumps({"id": "c", "choices": [{"index": 0, "text": "ab",
                                                 "finish_reason": "stop"}]})
    assert orjson.loads(assemble("completions", [text]) or b"{}")["choices"][0]["text"] == "ab"


@pytest.mark.parametrize(("cache", "message"), [
    ({"ttl_s": 0}, "cache.ttl_s: must be a positive number"),
    ({"max_entries": 0}, "cache.max_entries: must be a positive integer"),
    ({"ttl_s": 300, "size": 5}, "cache.size: unknown key"),
])
def test_bad_cache_settings_are_config_errors(cache: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from([{"name": "p", "kind": "simulated"}],
                    {"m": {"candidates": [{"provider": "p", "model": "x"}], "cache": cache}})
    assert message in str(info.value)


async def start(aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
                fake: FakeUpstream, cache: dict[str, Any] | None = None,
                access: io.StringIO | None = None, slots: int = 1) -> Client:
    server = await aiohttp_server(fake.app())
    candidates = [{"provider": "p", "model": "up", "input_cost": 1, "output_cost": 1}]
    config = config_from(
        [{"name": "p", "base_url": str(server.make_url("/v1")), "api_key": "sk",
          "max_concurrency": slots}],
        {"m": {"candidates": candidates, "cache": cache or {"ttl_s": 60}},
         "plain": candidates},
        classify={"keys": [{"name": "app", "key": "app-key"},
                           {"name": "other", "key": "other-key"}]},
        access_log={"format": "json"})
    client: Client = await aiohttp_client(build_app(config, counter=counter,
                                                    access_stream=access))
    return client


def sdk(client: Client, key: str = "app-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key,
                              max_retries=0)


def totals(client: Client) -> dict[str, float]:
    """Every token and every dollar the proxy has billed, summed."""
    text = client.app[SERVICE].metrics.render().decode()
    sums = {"proxy_tokens_total": 0.0, "proxy_cost_usd_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums


def metric(client: Client, text: str) -> bool:
    return text in client.app[SERVICE].metrics.render().decode()


async def test_a_hit_is_served_without_the_upstream_json_and_streamed(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    access = io.StringIO()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, access=access)
    api = sdk(client)
    first = await api.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0)
    assert first.headers["x-proxy-cache"] == "miss"
    billed = totals(client)
    assert billed["proxy_tokens_total"] > 0 and billed["proxy_cost_usd_total"] > 0
    second = await api.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, temperature=0.0, user="someone")
    assert second.headers["x-proxy-cache"] == "hit" and len(fake.seen) == 1
    assert second.headers["x-proxy-upstream"] == "p/up"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content
    # Streamed, the same answer comes back as a valid stream the SDK reads.
    stream = await api.chat.completions.create(model="m", messages=MESSAGES, temperature=0,
                                               stream=True,
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello there!")
    assert chunks[-1].usage is not None and len(fake.seen) == 1
    # Not billed: no upstream tokens, no cost; counted as hits and misses.
    assert totals(client) == billed
    assert metric(client, 'proxy_cache_lookups_total{model="m",result="hit"} 2.0')
    assert metric(client, 'proxy_cache_lookups_total{model="m",result="miss"} 1.0')
    assert metric(client, 'proxy_cache_entries{model="m"} 1.0')
    lines = [orjson.loads(line) for line in access.getvalue().splitlines()]
    assert [line["cache"] for line in lines] == ["miss", "hit", "hit"]
    assert lines[1]["cost_usd"] == 0.0 and lines[1]["upstream"] is None


async def test_what_is_not_cached(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    api = sdk(client)
    # Sampling calls, models without a cache, and errors.
    for _ in range(2):
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, temperature=0.7)
        assert "x-proxy-cache" not in raw.headers
        await api.chat.completions.create(model="plain", messages=MESSAGES, temperature=0)
    assert len(fake.seen) == 4
    fake.script.extend(["400"])
    with pytest.raises(openai.BadRequestError):
        await api.chat.completions.create(model="m", messages=MESSAGES, seed=3)
    await api.chat.completions.create(model="m", messages=MESSAGES, seed=3)
    assert len(fake.seen) == 6
    # Another key never sees this key's answers.
    raw = await sdk(client, "other-key").chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, seed=3)
    assert raw.headers["x-proxy-cache"] == "miss" and len(fake.seen) == 7


async def test_a_streamed_miss_fills_the_cache(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    api = sdk(client)
    stream = await api.chat.completions.create(model="m", messages=MESSAGES, seed=1,
                                               stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == (
        "Hello there!")
    raw = await api.chat.completions.with_raw_response.create(model="m", messages=MESSAGES,
                                                              seed=1)
    assert raw.headers["x-proxy-cache"] == "hit" and len(fake.seen) == 1
    assert raw.parse().choices[0].message.content == "Hello there!"


async def test_a_hit_takes_no_slot(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    api = sdk(client)
    await api.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    fake.hold_s = 2.0
    busy = asyncio.ensure_future(api.chat.completions.create(model="plain", messages=MESSAGES))
    await asyncio.sleep(0.2)
    assert client.app[SERVICE].scheduler.inflight("p") == 1  # the only slot is taken
    await api.chat.completions.create(model="m", messages=MESSAGES, temperature=0)
    # Answered while the slot's 2 s call still runs and holds it: no wait for the slot.
    assert client.app[SERVICE].scheduler.inflight("p") == 1 and not busy.done()
    await busy


async def test_entries_expire_and_the_cache_is_bounded(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake,
                         cache={"ttl_s": 0.3, "max_entries": 2})
    api = sdk(client)

    async def ask(seed: int) -> str:
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=MESSAGES, seed=seed)
        return raw.headers["x-proxy-cache"]

    assert [await ask(s) for s in (1, 2, 3, 3, 1)] == ["miss", "miss", "miss", "hit", "miss"]
    assert metric(client, 'proxy_cache_entries{model="m"} 2.0')
    await asyncio.sleep(0.4)
    assert await ask(3) == "miss"


async def test_identical_calls_wait_for_the_one_in_flight(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    """A burst of identical calls makes one upstream call; the rest wait for its answer
    without holding a slot, even where slots are free."""
    fake = FakeUpstream(hold_s=0.3)
    client = await start(aiohttp_server, aiohttp_client, counter, fake, slots=8)
    api = sdk(client)
    answers = await asyncio.gather(*(
        api.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, seed=9)
        for _ in range(5)))
    assert sorted(a.headers["x-proxy-cache"] for a in answers) == ["hit"] * 4 + ["miss"]
    assert len(fake.seen) == 1
    assert all(int(a.headers["x-proxy-queue-ms"]) >= 250 for a in answers
               if a.headers["x-proxy-cache"] == "hit")
    # The one in flight fails: the others go upstream themselves. Nothing is lost.
    fake.script.extend(["400"])
    fake.hold_s = 0.0
    statuses = await asyncio.gather(*(
        api.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, seed=10)
        for _ in range(3)), return_exceptions=True)
    assert sum(isinstance(s, openai.BadRequestError) for s in statuses) == 1
    assert 3 <= len(fake.seen) <= 4 and client.app[SERVICE].cache._flights == {}


async def test_a_waiting_duplicate_is_answered_from_the_cache_when_its_slot_comes(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.3)
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    api = sdk(client)
    calls = [api.chat.completions.with_raw_response.create(model="m", messages=MESSAGES,
                                                           temperature=0) for _ in range(3)]
    answers = await asyncio.gather(*calls)
    assert sorted(a.headers["x-proxy-cache"] for a in answers) == ["hit", "hit", "miss"]
    assert len(fake.seen) == 1 and client.app[SERVICE].scheduler.inflight("p") == 0
    waited = [int(a.headers["x-proxy-queue-ms"]) for a in answers
              if a.headers["x-proxy-cache"] == "hit"]
    assert all(w >= 250 for w in waited)  # they queued behind the first


def test_a_replayed_stream_keeps_logprobs() -> None:
    logprobs = {"content": [{"token": "4", "logprob": -0.01, "bytes": [52],
                             "top_logprobs": []}]}
    answer = completion("up", "4")
    answer["choices"][0]["logprobs"] = logprobs
    events = [event_data(e) for e in replay("chat", orjson.dumps(answer), False).split(b"\n\n")]
    assert orjson.loads(events[0] or b"{}")["choices"][0]["logprobs"] == logprobs


def test_an_entry_packs_for_redis_and_back() -> None:
    answer = orjson.dumps(completion("up", "line one\nline two"))
    entry = Entry(answer, "p0/up0", 5, None)
    packed = pack(entry)
    assert packed.endswith(b"\n" + answer) and unpack(packed) == entry
    assert unpack(pack(Entry(answer, "p/\n", True, 3))) == Entry(
        answer, "p/\n", None, 3)
    for garbage in (b"", b"no head", b"[1, \"d\", 1, 2]", b"[2, \"d\", 1, 2]\n{}",
                    b"[1, 5, 1, 2]\n{}", b"{}\n{}", b"[1, \"d\"]\n{}", b"\xff\n{}"):
        assert unpack(garbage) is None, garbage


class FleetCache:
    """``Answers`` in memory: what a replica would find in Redis."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[bytes, float]] = {}
        self.kept: list[tuple[str, float, int]] = []
        self.on_error: Callable[[str], None] = lambda operation: None
        self.asked = 0

    async def recall(self, fingerprint: bytes) -> tuple[bytes, float] | None:
        self.asked += 1
        return self.entries.get(fingerprint)

    def keep(self, model: str, fingerprint: bytes, packed: bytes, ttl_s: float,
             max_entries: int) -> None:
        self.entries[fingerprint] = (packed, ttl_s)
        self.kept.append((model, ttl_s, max_entries))

    async def home(self, response_id: str) -> str | None:
        return None

    def remember(self, response_id: str, deployment: str) -> None:
        return None


def caching(make_config: Callable[..., Any], shared: FleetCache | None,
            clock: FakeClock) -> ResponseCache:
    config = make_config([{"name": "p", "base_url": "http://127.0.0.1:9/v1"}],
                         {"m": {"candidates": [{"provider": "p", "model": "x"}],
                                "cache": {"ttl_s": 60, "max_entries": 2}}})
    cache = ResponseCache(clock, shared)
    cache.configure(config.models)
    return cache


async def test_the_fleets_entry_is_kept_here_no_longer_than_it_is_there(
        make_config: Callable[..., Any]) -> None:
    clock, fleet = FakeClock(), FleetCache()
    cache = caching(make_config, fleet, clock)
    entry = Entry(b'{"id": "a"}', "p/x", 1, 2)
    cache.put("m", b"k1", entry)
    assert fleet.kept == [("m", 60, 2)] and unpack(fleet.entries[b"k1"][0]) == entry
    assert cache.get("m", b"k1") == entry
    # Another replica's entry, with 10 s left in Redis: here for 10 s, not the TTL's 60.
    fleet.entries[b"k2"] = (pack(entry), 10.0)
    assert cache.get("m", b"k2") is None
    assert await cache.recall("m", b"k2") == entry and cache.get("m", b"k2") == entry
    clock.advance(9.9)
    assert cache.get("m", b"k2") == entry
    clock.advance(0.2)
    assert cache.get("m", b"k2") is None and cache.get("m", b"k1") == entry
    clock.advance(50)
    assert cache.get("m", b"k1") is None and cache.size("m") == 0
    fleet.entries[b"k3"] = (b"not an entry", 30.0)
    assert await cache.recall("m", b"k3") is None and cache.get("m", b"k3") is None
    assert await cache.recall("m", b"absent") is None


async def test_without_the_fleet_nothing_is_asked(make_config: Callable[..., Any]) -> None:
    cache = caching(make_config, None, FakeClock())
    assert not cache.across_replicas
    cache.put("m", b"k", Entry(b"{}", "p/x", None, None))
    assert await cache.recall("m", b"other") is None and cache.get("m", b"k") is not None
