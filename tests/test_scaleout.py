"""Several real ``serve`` processes sharing one Redis, against one fake upstream that
counts the calls it holds at once: one provider limit across replicas, one priority order
across replicas, a SIGKILLed replica's slots back within the lease TTL, Redis killed and
restarted under load, and ``serve --workers``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis
from aiohttp import web
from redis.asyncio import Redis

from .fakes import completion
from .redis_server import URL, PrivateRedis, prefixed
from .serving import serving

LIMIT = 3
TTL_S = 2.0


class Counting:
    """An upstream that holds each call ``hold_s`` (or until ``gate`` opens) and keeps the
    most it ever held at once, and the order calls reached it (by their message)."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.order: list[str] = []
        self.hold_s = 0.2
        self.gate: asyncio.Event | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.now += 1
        self.most = max(self.most, self.now)
        self.order.append(body["messages"][0]["content"])
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.hold_s)
        finally:
            self.now -= 1
        return web.json_response(completion(body["model"]))

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def config_text(upstream: str, url: str, prefix: str, on_error: str = "local") -> str:
    return f"""
tiers:
  - {{name: high, max_wait_s: 60}}
  - {{name: low, max_wait_s: 60}}
classify: {{default_tier: low}}
state: {{backend: redis, url: "{url}", prefix: {prefix}, lease_ttl_s: {TTL_S},
         on_error: {on_error}}}
providers:
  - name: up
    base_url: {upstream}
    max_concurrency: {LIMIT}
    breaker: {{consecutive_failures: 1000}}
models:
  m: [{{provider: up, model: x}}]
"""


def write_config(folder: Path, upstream: str, url: str, prefix: str,
                 on_error: str = "local") -> Path:
    config = folder / "routing.yaml"
    config.write_text(config_text(upstream, url, prefix, on_error))
    return config


@pytest.fixture
async def upstream() -> AsyncIterator[Counting]:
    counting = Counting()
    await counting.start()
    yield counting
    if counting.gate is not None:
        counting.gate.set()
    await counting.stop()


@contextlib.asynccontextmanager
async def replicas(config: Path, n: int) -> AsyncIterator[list[tuple[str, subprocess.Popen[str]]]]:
    async with contextlib.AsyncExitStack() as stack:
        running = [await stack.enter_async_context(serving(config)) for _ in range(n)]
        async with aiohttp.ClientSession() as session:
            await until_alive(session, running[0][0], n)
        yield running


async def status(session: aiohttp.ClientSession, base: str) -> dict[str, object]:
    async with session.get(f"{base}/admin/status") as resp:
        data: dict[str, object] = await resp.json()
        return data


async def state_of(session: aiohttp.ClientSession, base: str) -> dict[str, object]:
    state = (await status(session, base))["state"]
    assert isinstance(state, dict)
    return state


async def until_alive(session: aiohttp.ClientSession, base: str, n: int) -> None:
    async with asyncio.timeout(10):
        while (await state_of(session, base))["replicas_alive"] != n:
            await asyncio.sleep(0.1)


async def call(session: aiohttp.ClientSession, base: str, text: str,
               tier: str = "low") -> int:
    async with session.post(f"{base}/v1/chat/completions", headers={"X-Priority": tier},
                            json={"model": "m", "messages": [{"role": "user",
                                                              "content": text}]}) as resp:
        await resp.read()
        return resp.status


async def test_three_replicas_never_exceed_the_provider_limit_and_use_all_of_it(
        tmp_path: Path, upstream: Counting) -> None:
    with prefixed() as (_, prefix):
        config = write_config(tmp_path, upstream.url, URL, prefix)
        async with replicas(config, 3) as running, aiohttp.ClientSession() as session:
            bases = [base for base, _ in running]
            statuses = await asyncio.gather(*(
                call(session, bases[i % 3], f"c{i}") for i in range(36)))
            assert statuses == [200] * 36
            assert upstream.most == LIMIT  # never above, and every slot used
            for base in bases:
                state = await state_of(session, base)
                assert state["mode"] == "shared" and state["leases_held"] == 0


async def test_mixed_tiers_across_replicas_go_in_one_global_tier_order(
        tmp_path: Path, upstream: Counting) -> None:
    with prefixed() as (_, prefix):
        config = write_config(tmp_path, upstream.url, URL, prefix)
        async with replicas(config, 3) as running, aiohttp.ClientSession() as session:
            (a, _), (b, _), (c, _) = running
            upstream.gate = asyncio.Event()
            first = [asyncio.ensure_future(call(session, a, f"first{i}")) for i in range(3)]
            async with asyncio.timeout(10):
                while upstream.now < LIMIT:
                    await asyncio.sleep(0.02)
            lows = [asyncio.ensure_future(call(session, b, f"low{i}")) for i in range(6)]
            await asyncio.sleep(0.5)  # the lows wait first (in Redis, and in b's queue)
            # Two on the replica whose slots the lows hold while they wait, one elsewhere.
            highs = [asyncio.ensure_future(call(session, where, f"high{i}", "high"))
                     for i, where in enumerate((b, b, c))]
            await asyncio.sleep(0.5)
            upstream.gate.set()
            assert await asyncio.gather(*first, *lows, *highs) == [200] * 12
            after = upstream.order[3:]
            assert sorted(after[:3]) == ["high0", "high1", "high2"], upstream.order
            assert upstream.most == LIMIT


async def test_a_replica_killed_while_holding_slots_gives_them_back_within_the_ttl(
        tmp_path: Path, upstream: Counting) -> None:
    with prefixed() as (client, prefix):
        config = write_config(tmp_path, upstream.url, URL, prefix)
        async with replicas(config, 2) as running, aiohttp.ClientSession() as session:
            (a, victim), (b, _) = running
            upstream.gate = asyncio.Event()
            held = [asyncio.ensure_future(call(session, a, f"held{i}")) for i in range(3)]
            async with asyncio.timeout(10):
                while upstream.now < LIMIT:
                    await asyncio.sleep(0.02)
            assert client.zcard(f"{prefix}:leases:up") == LIMIT
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            upstream.gate.set()  # the upstream is free; only the dead leases are held
            upstream.gate = None
            started = time.monotonic()
            assert await call(session, b, "after") == 200
            assert time.monotonic() - started < TTL_S + 1.5
            await asyncio.gather(*held, return_exceptions=True)
            async with asyncio.timeout(5):
                while client.zcard(f"{prefix}:leases:up"):
                    await asyncio.sleep(0.05)


async def test_redis_killed_and_restarted_under_load(tmp_path: Path,
                                                    upstream: Counting) -> None:
    server = PrivateRedis()
    server.start()
    try:
        config = write_config(tmp_path, upstream.url, server.url, "t")
        async with replicas(config, 2) as running, aiohttp.ClientSession() as session:
            bases = [base for base, _ in running]
            upstream.hold_s = 0.05
            stop = asyncio.Event()
            results: list[int] = []

            async def load(i: int) -> None:
                while not stop.is_set():
                    results.append(await call(session, bases[i % 2], f"l{i}"))

            loaders = [asyncio.ensure_future(load(i)) for i in range(8)]
            await asyncio.sleep(0.5)
            server.stop()
            await asyncio.sleep(1.5)
            modes = [(await state_of(session, base))["mode"] for base in bases]
            assert modes == ["local", "local"]
            during = len(results)
            await asyncio.sleep(1.0)
            assert len(results) > during  # still serving, each replica with its share
            server.start()
            async with asyncio.timeout(10):
                while [(await state_of(session, b))["mode"] for b in bases] != ["shared"] * 2:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*loaders)
            assert set(results) == {200}
            # Calls running when Redis went away finish; meanwhile a replica under its
            # share (LIMIT // 2 = 1) may start one while the other is still above its own.
            assert upstream.most <= LIMIT + 1
            for base in bases:  # the outage is counted where operators look
                state = await state_of(session, base)
                entered, away = state["entered"], state["fallback_s"]
                assert isinstance(entered, dict) and isinstance(away, float)
                assert entered["local"] == 1 and entered["shared"] == 1 and away > 1.0
            client = redis.Redis(port=server.port, decode_responses=True)
            async with asyncio.timeout(5):  # nothing leaked: every lease came back
                while client.zcard("t:leases:up"):
                    await asyncio.sleep(0.05)
            assert client.zcard("t:waiters:up") == 0
            client.close()
    finally:
        server.stop()


async def test_redis_flushed_under_load_stays_shared_and_never_exceeds_the_limit(
        tmp_path: Path, upstream: Counting) -> None:
    """FLUSHALL (and a failover to a copy with older data looks the same to a replica) while
    every slot is busy: the replicas write back what they hold and no slot is handed out
    before they have, so the limit holds throughout and nobody falls back to a share."""
    server = PrivateRedis()
    server.start()
    try:
        config = write_config(tmp_path, upstream.url, server.url, "t")
        async with replicas(config, 2) as running, aiohttp.ClientSession() as session, \
                Redis.from_url(server.url) as admin:
            bases = [base for base, _ in running]
            upstream.hold_s = 0.05
            stop = asyncio.Event()
            results: list[int] = []

            async def load(i: int) -> None:
                while not stop.is_set():
                    results.append(await call(session, bases[i % 2], f"l{i}"))

            loaders = [asyncio.ensure_future(load(i)) for i in range(8)]
            for _ in range(4):
                await asyncio.sleep(0.7)
                await admin.flushall()
            await asyncio.sleep(2.0)
            before = len(results)
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*loaders)
            states = [await state_of(session, base) for base in bases]
            assert set(results) == {200} and len(results) > before
            assert upstream.most <= LIMIT
            assert [s["mode"] for s in states] == ["shared", "shared"]
            rebuilt = [s["rebuilt"] for s in states]
            assert all(isinstance(r, dict) and r["times"] >= 3 for r in rebuilt), rebuilt
            assert {s["entered"]["local"] for s in states} == {0}  # type: ignore[index]
            async with session.get(f"{bases[0]}/metrics") as resp:
                text = await resp.text()
            assert 'proxy_shared_state_entered{mode="local"} 0.0' in text
            assert "proxy_shared_state_fallback_seconds 0.0" in text
            rebuilds = [line for line in text.splitlines()
                        if line.startswith("proxy_shared_state_rebuilds ")]
            assert rebuilds and float(rebuilds[0].split()[1]) >= 3
    finally:
        server.stop()


async def test_reject_mode_answers_503_while_redis_is_away(tmp_path: Path,
                                                          upstream: Counting) -> None:
    server = PrivateRedis()
    server.start()
    try:
        config = write_config(tmp_path, upstream.url, server.url, "t", on_error="reject")
        async with serving(config) as (base, _), aiohttp.ClientSession() as session:
            assert await call(session, base, "before") == 200
            server.stop()
            statuses = [await call(session, base, f"x{i}") for i in range(3)]
            assert 503 in statuses
            async with session.post(f"{base}/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "y"}]}) as resp:
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "state_unavailable"
                assert resp.headers["retry-after"]
            server.start()
            async with asyncio.timeout(10):
                while (await state_of(session, base))["mode"] != "shared":
                    await asyncio.sleep(0.1)
            assert await call(session, base, "after") == 200
    finally:
        server.stop()


async def test_workers_share_one_port_and_one_limit(tmp_path: Path,
                                                    upstream: Counting) -> None:
    with prefixed() as (_, prefix):
        config = write_config(tmp_path, upstream.url, URL, prefix)
        async with serving(config, "--workers", "2") as (base, supervisor), \
                aiohttp.ClientSession() as session:
            await until_alive(session, base, 2)
            replicas_seen = set()
            for _ in range(20):  # new connections land on both workers
                async with aiohttp.ClientSession() as fresh:
                    replicas_seen.add((await state_of(fresh, base))["replica"])
            assert len(replicas_seen) == 2
            statuses = await asyncio.gather(*(call(session, base, f"w{i}")
                                              for i in range(24)))
            assert statuses == [200] * 24 and upstream.most == LIMIT
            supervisor.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(supervisor.wait, 30) == 0


def test_workers_need_the_redis_backend(tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(config_text("http://127.0.0.1:9/v1", URL, "x").replace(
        "backend: redis", "backend: memory"))
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--workers", "2"],
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "needs state.backend: redis" in result.stderr
