"""The response cache and the Responses API's response homes shared through Redis: two
real ``serve`` replicas under one prefix (an answer fetched through one is a hit on the
other, streamed or not; a key never gets another key's answer; entries expire with their
TTL and the fleet holds at most ``max_entries``; Redis killed or hung makes lookups misses,
never errors nor stalls; a response continued through the other replica goes where it
lives), and ``SharedAnswers`` itself on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis
from aiohttp import web
from multidict import CIMultiDict

from proxy.config.state import StateSettings
from proxy.state.shared_answers import HOME_TTL_S, MAX_SHARED_BYTES, PAUSE_S, SharedAnswers

from .fakes import FakeUpstream
from .redis_server import URL, PrivateRedis, free_port, prefixed
from .serving import serving

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@contextlib.asynccontextmanager
async def upstreams(*fakes: FakeUpstream) -> AsyncIterator[list[str]]:
    """The fakes on ports of their own: their base URLs."""
    runners = []
    try:
        for fake in fakes:
            runner = web.AppRunner(fake.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
        yield [f"http://127.0.0.1:{r.addresses[0][1]}/v1" for r in runners]
    finally:
        for runner in runners:
            await runner.cleanup()


def write_config(folder: Path, urls: list[str], url: str, prefix: str, ttl_s: float = 60,
                 max_entries: int = 100) -> Path:
    config = folder / "routing.yaml"
    config.write_text(f"""
state: {{backend: redis, url: "{url}", prefix: {prefix}, lease_ttl_s: 2}}
classify:
  keys: [{{name: x, key: kx}}, {{name: y, key: ky}}]
providers:
  - {{name: p0, base_url: "{urls[0]}", api_key: sk, max_concurrency: 4,
      breaker: {{consecutive_failures: 1000}}}}
  - {{name: p1, base_url: "{urls[-1]}", api_key: sk, max_concurrency: 4,
      breaker: {{consecutive_failures: 1000}}}}
models:
  m:
    cache: {{ttl_s: {ttl_s}, max_entries: {max_entries}}}
    candidates: [{{provider: p0, model: up0}}]
  r: [{{provider: p0, model: up0}}, {{provider: p1, model: up1}}]
""")
    return config


@contextlib.asynccontextmanager
async def two(config: Path) -> AsyncIterator[tuple[str, str]]:
    async with serving(config) as (a, _), serving(config) as (b, _):
        yield a, b


async def ask(session: aiohttp.ClientSession, base: str, key: str = "kx",
              **body: Any) -> tuple[int, CIMultiDict[str], bytes]:
    """A deterministic chat call: (status, headers, body)."""
    async with session.post(f"{base}/v1/chat/completions",
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": "m", "messages": MESSAGES, "temperature": 0,
                                  **body}) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.read()


async def until(check: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    async with asyncio.timeout(within_s):
        while not check():
            await asyncio.sleep(0.02)
    assert check(), what


def entries(client: redis.Redis, prefix: str) -> list[str]:
    return list(client.zrange(f"{prefix}:answers:m", 0, -1))


def stored(client: redis.Redis, prefix: str) -> int:
    return len(list(client.scan_iter(f"{prefix}:answer:*")))


async def added(client: redis.Redis, prefix: str, before: list[str]) -> list[str]:
    """The model's entries once one more than ``before`` was stored (writes are in the
    background: the answer may reach the client first)."""
    await until(lambda: entries(client, prefix) != before, "the entry reached Redis")
    return entries(client, prefix)


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


async def test_an_answer_fetched_through_one_replica_is_a_hit_on_the_other(
        tmp_path: Path) -> None:
    fake = FakeUpstream()
    with prefixed() as (client, prefix):
        async with upstreams(fake) as urls, two(write_config(tmp_path, urls, URL, prefix)) \
                as (a, b), aiohttp.ClientSession() as session:
            status, headers, first = await ask(session, a)
            assert status == 200 and headers["x-proxy-cache"] == "miss"
            await added(client, prefix, [])
            status, headers, again = await ask(session, b)
            assert status == 200 and headers["x-proxy-cache"] == "hit"
            assert headers["x-proxy-upstream"] == "p0/up0" and again == first
            status, headers, streamed = await ask(session, b, stream=True,
                                                  stream_options={"include_usage": True})
            assert headers["x-proxy-cache"] == "hit"
            assert headers["content-type"].startswith("text/event-stream")
            events = [e for e in streamed.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            text = "".join(orjson.loads(e[6:])["choices"][0]["delta"].get("content", "")
                           for e in events[:-1] if orjson.loads(e[6:])["choices"])
            assert text == orjson.loads(first)["choices"][0]["message"]["content"]
            assert len(fake.seen) == 1  # the upstream answered once for the three
            # A streamed miss on one replica fills the fleet's cache too.
            before = entries(client, prefix)
            status, headers, _ = await ask(session, b, seed=2, stream=True)
            assert headers["x-proxy-cache"] == "miss"
            await added(client, prefix, before)
            status, headers, whole = await ask(session, a, seed=2)
            assert headers["x-proxy-cache"] == "hit" and len(fake.seen) == 2
            assert orjson.loads(whole)["choices"][0]["message"]["content"] == "Hello there!"
            assert await metric(session, b, 'proxy_cache_lookups_total{model="m",'
                                'result="hit"}') == 2
            assert await metric(session, a, "proxy_cache_shared_errors_total") == 0


async def test_one_key_never_gets_another_keys_answer(tmp_path: Path) -> None:
    fake = FakeUpstream()
    with prefixed() as (client, prefix):
        async with upstreams(fake) as urls, two(write_config(tmp_path, urls, URL, prefix)) \
                as (a, b), aiohttp.ClientSession() as session:
            assert (await ask(session, a, key="kx"))[1]["x-proxy-cache"] == "miss"
            first = await added(client, prefix, [])
            assert (await ask(session, b, key="ky"))[1]["x-proxy-cache"] == "miss"
            await added(client, prefix, first)
            assert len(fake.seen) == 2 and stored(client, prefix) == 2
            assert (await ask(session, b, key="kx"))[1]["x-proxy-cache"] == "hit"
            assert (await ask(session, a, key="ky"))[1]["x-proxy-cache"] == "hit"
            assert len(fake.seen) == 2


async def test_entries_expire_with_their_ttl_on_every_replica(tmp_path: Path) -> None:
    fake = FakeUpstream()
    with prefixed() as (client, prefix):
        async with upstreams(fake) as urls, two(write_config(tmp_path, urls, URL, prefix,
                                                             ttl_s=1.5)) as (a, b), \
                aiohttp.ClientSession() as session:
            await ask(session, a)
            (fingerprint,) = await added(client, prefix, [])
            assert 0 < client.pttl(f"{prefix}:answer:{fingerprint}") <= 1500
            assert (await ask(session, b))[1]["x-proxy-cache"] == "hit"  # now in b's own too
            await until(lambda: not client.exists(f"{prefix}:answer:{fingerprint}"),
                        "Redis expired the entry")
            await asyncio.sleep(0.1)
            # Neither replica's own copy outlives the entry in Redis.
            assert (await ask(session, b))[1]["x-proxy-cache"] == "miss"
            assert len(fake.seen) == 2
            await until(lambda: stored(client, prefix) == 1, "b stored its answer")
            await asyncio.sleep(1.6)
            assert (await ask(session, a))[1]["x-proxy-cache"] == "miss"
            assert len(fake.seen) == 3


async def test_max_entries_bounds_the_fleets_entries(tmp_path: Path) -> None:
    fake = FakeUpstream()
    with prefixed() as (client, prefix):
        async with upstreams(fake) as urls, two(write_config(
                tmp_path, urls, URL, prefix, max_entries=2)) as (a, b), \
                aiohttp.ClientSession() as session:
            seen: list[str] = []
            for seed, where in enumerate((a, b, a, b)):
                assert (await ask(session, where, seed=seed))[1]["x-proxy-cache"] == "miss"
                seen = await added(client, prefix, seen)
                assert len(seen) == min(seed + 1, 2)
            assert stored(client, prefix) == 2  # the oldest entries are gone from Redis too
            # b holds 1 and 3 itself; 2 is the fleet's, 0 is no longer anywhere b can see.
            assert (await ask(session, b, seed=2))[1]["x-proxy-cache"] == "hit"
            assert len(fake.seen) == 4
            assert (await ask(session, b, seed=0))[1]["x-proxy-cache"] == "miss"
            assert len(fake.seen) == 5


@pytest.mark.parametrize("trouble", ["killed", "hung"])
async def test_without_redis_lookups_are_misses_never_errors_nor_stalls(
        tmp_path: Path, trouble: str) -> None:
    fake = FakeUpstream()
    server = PrivateRedis()
    server.start()
    try:
        async with upstreams(fake) as urls, two(write_config(
                tmp_path, urls, server.url, "t")) as (a, b), \
                aiohttp.ClientSession() as session:
            client = redis.Redis(port=server.port, decode_responses=True)
            await ask(session, a)
            await added(client, "t", [])
            client.close()
            assert server.process is not None
            if trouble == "killed":
                server.stop()
            else:
                server.process.send_signal(signal.SIGSTOP)  # accepts, never answers
            try:
                # The answer a stored, then two more: misses, through the upstream.
                for seed in (None, 1, 2):
                    started = time.monotonic()
                    status, headers, body = await ask(
                        session, b, **({} if seed is None else {"seed": seed}))
                    # The lookup's 0.2 s, plus (hung) the slot lease's own failover to the
                    # local share: 0.5 s and one retry; far under the tiers' 60 s wait.
                    assert time.monotonic() - started < 3.0
                    assert status == 200 and headers["x-proxy-cache"] == "miss", body
                assert len(fake.seen) == 4
                assert (await ask(session, b))[1]["x-proxy-cache"] == "hit"  # b's own now
                async with session.get(f"{b}/admin/status") as resp:
                    state = (await resp.json())["state"]
                # Its lookup failed (counted), or the state had already seen Redis gone
                # (then nothing is asked).
                assert state["answers_errors"] >= 1 or state["mode"] != "shared"
            finally:
                if trouble == "hung":
                    server.process.send_signal(signal.SIGCONT)
    finally:
        server.stop()


async def test_a_response_continued_through_another_replica_goes_where_it_lives(
        tmp_path: Path) -> None:
    # p0 fails the first call, so p1 holds the response; p0 is first in the route for
    # any other call, and the other replica never saw the response.
    first, second = FakeUpstream(script=deque(["500"])), FakeUpstream()
    with prefixed() as (client, prefix):
        async with upstreams(first, second) as urls, \
                two(write_config(tmp_path, urls, URL, prefix)) as (a, b), \
                aiohttp.ClientSession(headers={"Authorization": "Bearer kx"}) as session:
            async with session.post(f"{a}/v1/responses",
                                    json={"model": "r", "input": "Remember 7"}) as resp:
                assert resp.status == 200 and resp.headers["x-proxy-upstream"] == "p1/up1"
                opened = (await resp.json())["id"]
            home = f"{prefix}:home:{opened}"
            await until(lambda: client.get(home) == "p1/up1", "the home reached Redis")
            assert HOME_TTL_S * 1000 - 60_000 < client.pttl(home) <= HOME_TTL_S * 1000
            async with session.post(f"{b}/v1/responses",
                                    json={"model": "r", "input": "x"}) as resp:
                assert resp.headers["x-proxy-upstream"] == "p0/up0"  # b's route by itself
            for stream in (False, True):
                async with session.post(f"{b}/v1/responses", json={
                        "model": "r", "input": "What number?", "previous_response_id": opened,
                        "stream": stream}) as resp:
                    await resp.read()
                    assert resp.status == 200
                    assert resp.headers["x-proxy-upstream"] == "p1/up1"
            assert [s.body.get("previous_response_id") for s in second.seen] == [
                None, opened, opened]


# --- SharedAnswers on its own ---------------------------------------------------------


@pytest.fixture
async def answers() -> AsyncIterator[tuple[SharedAnswers, redis.Redis, str]]:
    with prefixed() as (client, prefix):
        shared = SharedAnswers(StateSettings(backend="redis", url=URL, prefix=prefix),
                               lambda: True)
        try:
            yield shared, client, prefix
        finally:
            await shared.close()


async def writes_done(shared: SharedAnswers) -> None:
    await until(lambda: not shared._writes, "the writes went")


async def test_the_store_script_trims_to_max_entries_oldest_first(
        answers: tuple[SharedAnswers, redis.Redis, str]) -> None:
    shared, client, prefix = answers
    for n in range(5):
        shared.keep("m", bytes([n]) * 32, b"entry %d" % n, 60, 3)
        await writes_done(shared)
        await asyncio.sleep(0.002)  # distinct store times (Redis ms)
    assert entries(client, prefix) == [(bytes([n]) * 32).hex() for n in (2, 3, 4)]
    assert stored(client, prefix) == 3
    found = await shared.recall(bytes([4]) * 32)
    assert found is not None and found[0] == b"entry 4" and 59 < found[1] <= 60
    assert await shared.recall(bytes([0]) * 32) is None
    shared.keep("m", b"\x09" * 32, b"x" * (MAX_SHARED_BYTES + 1), 60, 3)  # too large: kept
    await writes_done(shared)                                             # locally only
    assert stored(client, prefix) == 3 and shared.errors == 0
    # Another model's entries are bounded on their own; a lowered bound applies at once.
    shared.keep("n", b"\x07" * 32, b"other", 60, 1)
    shared.keep("m", b"\x08" * 32, b"newest", 60, 1)
    await writes_done(shared)
    assert entries(client, prefix) == [(b"\x08" * 32).hex()]
    assert stored(client, prefix) == 2


async def test_expired_entries_leave_the_models_set(
        answers: tuple[SharedAnswers, redis.Redis, str]) -> None:
    shared, client, prefix = answers
    shared.keep("m", b"\x01" * 32, b"short", 0.05, 10)
    await writes_done(shared)
    await asyncio.sleep(0.1)
    assert await shared.recall(b"\x01" * 32) is None
    shared.keep("m", b"\x02" * 32, b"next", 0.05, 10)
    await writes_done(shared)
    assert entries(client, prefix) == [(b"\x02" * 32).hex()]


async def test_homes_are_kept_for_a_week(
        answers: tuple[SharedAnswers, redis.Redis, str]) -> None:
    shared, client, prefix = answers
    assert await shared.home("resp_1") is None
    shared.remember("resp_1", "p1/up1")
    await writes_done(shared)
    assert await shared.home("resp_1") == "p1/up1"
    assert client.pttl(f"{prefix}:home:resp_1") > (HOME_TTL_S - 60) * 1000


async def test_a_failure_is_counted_and_pauses_the_replicas_asking() -> None:
    failed: list[str] = []
    shared = SharedAnswers(StateSettings(backend="redis", url=f"redis://127.0.0.1:"
                                         f"{free_port()}/0", prefix="t"), lambda: True)
    shared.on_error = failed.append
    try:
        started = time.monotonic()
        assert await shared.recall(b"\x01" * 32) is None
        assert time.monotonic() - started < 1.0  # refused at once, no retries with backoff
        assert failed == ["lookup"] and shared.errors == 1 and not shared.usable()
        assert await shared.home("resp_1") is None  # paused: not even asked
        shared.remember("resp_1", "p0/up0")
        assert failed == ["lookup"] and not shared._writes
        await asyncio.sleep(PAUSE_S)
        assert shared.usable()
        assert await shared.home("resp_1") is None
        assert failed == ["lookup", "home_lookup"]
    finally:
        await shared.close()


async def test_nothing_is_asked_while_the_state_is_out_of_shared_mode() -> None:
    mode = ["local"]
    shared = SharedAnswers(StateSettings(backend="redis", url=f"redis://127.0.0.1:"
                                         f"{free_port()}/0", prefix="t"),
                           lambda: mode[0] == "shared")
    try:
        assert await shared.recall(b"\x01" * 32) is None and shared.errors == 0
        shared.keep("m", b"\x01" * 32, b"x", 60, 10)
        assert not shared._writes
        mode[0] = "shared"
        assert shared.usable()
    finally:
        await shared.close()
