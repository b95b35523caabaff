"""The store never blocks the event loop: a Redis paused with SIGSTOP while a batch runs
and urgent calls flow costs the loop no stall (reliability case 26), and the work runs on
once Redis is back, every line answered once. A caller cancelled mid-call leaves the call
to run whole in its thread, or not at all."""

from __future__ import annotations

import asyncio
import signal
import threading

import aiohttp
import pytest

from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.store import AsyncStore, StoreClosed

from .conftest import config_from
from .fakes import FakeUpstream
from .redis_server import PrivateRedis
from .test_batches import KEYS, Factory, by_custom_id, chat_line, finished, jsonl, serve, submit

PAUSE_S = 3.0  # longer than the store's 2 s socket timeout: its calls fail while it lasts
PROBE_S = 0.005
# A loop that never waits on Redis overshoots a 5 ms sleep by a millisecond or two; a few
# tens on a loaded machine or a garbage collection. One synchronous call on a paused Redis
# costs its whole socket timeout (2 s).
MOST_STALL_S = 0.1


class LagProbe:
    """Sleeps ``PROBE_S`` again and again and keeps the worst overshoot: the longest the
    event loop was busy elsewhere."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.ticks = 0
        self._stop = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop:
            before = loop.time()
            await asyncio.sleep(PROBE_S)
            self.worst = max(self.worst, loop.time() - before - PROBE_S)
            self.ticks += 1

    def stop(self) -> None:
        self._stop = True


async def test_a_paused_redis_does_not_stall_the_event_loop(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    redis = PrivateRedis()
    redis.start()
    try:
        upstream = FakeUpstream(hold_s=0.1)
        up = await aiohttp_server(upstream.app())
        config = config_from(
            [{"name": "up", "base_url": str(up.make_url("/v1")), "api_key": "k",
              "max_concurrency": 8}], {"m": [{"provider": "up", "model": "x"}]},
            classify=KEYS, batch={"max_in_flight": 2},
            state={"backend": "redis", "url": redis.url})
        proxy = await serve(aiohttp_server, config, counter, upstream)
        client = proxy.sdk()
        names = {f"p{i}" for i in range(60)}
        batch = await submit(client, jsonl([chat_line(name) for name in sorted(names)]))
        background = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "later"}],
            extra_body={"background": True})
        assert background.http_response.status_code == 200
        async with asyncio.timeout(10):  # the runner is taking and answering lines
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 4:
                await asyncio.sleep(0.02)

        probe = LagProbe()
        probing = asyncio.ensure_future(probe.run())
        answered: list[int] = []
        loop = asyncio.get_running_loop()
        assert redis.process is not None
        redis.process.send_signal(signal.SIGSTOP)
        try:
            until = loop.time() + PAUSE_S
            # Urgent calls while the runner meets a paused store: ten at least (a loaded
            # machine may need a few more seconds than the pause for them).
            while loop.time() < until or (len(answered) < 10 and loop.time() < until + 5):
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "now"}],
                    extra_headers={"X-Priority": "high"})
                answered.append(raw.http_response.status_code)
                await asyncio.sleep(0.05)
            asked = loop.time()  # the status page answers, the store's figures left out
            async with aiohttp.ClientSession() as session, session.get(
                    proxy.server.make_url("/admin/status")) as resp:
                work = (await resp.json())["work"]
            assert loop.time() - asked < 1.0 and "did not answer" in work["error"], work
        finally:
            redis.process.send_signal(signal.SIGCONT)
        probe.stop()
        await probing
        assert probe.ticks > 100 and probe.worst < MOST_STALL_S, probe.worst
        assert len(answered) >= 10 and set(answered) == {200}
        state = proxy.server.app[SERVICE].shared
        assert state.mode == "local"  # the calls went on under the replica's share
        async with asyncio.timeout(5):  # and shared mode is back two heartbeats later
            while state.mode != "shared":
                await asyncio.sleep(0.05)

        done = await finished(client, batch.id, timeout=60)  # the runner comes back
        rows = by_custom_id((await client.files.content(done.output_file_id)).content)
        if done.error_file_id:
            rows.update(by_custom_id((await client.files.content(done.error_file_id)).content))
        assert set(rows) == names
    finally:
        redis.stop()



class Held:
    """A store whose ``take_lines`` waits until ``go`` is set (a Redis that hangs, as a
    worker thread sees it) and records what it took."""

    path = "held"

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.taken: list[str] = []
        self.closed = False

    def take_lines(self, batch_id: str, limit: int) -> list[tuple[int, str, bytes]]:
        self.started.set()
        self.go.wait(10)
        self.taken.append(batch_id)
        return [(0, "c", b"{}")]

    def close(self) -> None:
        self.closed = True


async def test_a_cancelled_caller_leaves_its_call_to_run_whole_or_not_at_all() -> None:
    held = Held()
    store = AsyncStore(lambda: held, held.path, threads=1, bulk_threads=0)
    running = asyncio.ensure_future(store.take_lines("a", 1))
    assert await asyncio.to_thread(held.started.wait, 5)
    queued = asyncio.ensure_future(store.take_lines("b", 1))  # waits for the one thread
    await asyncio.sleep(0.01)
    running.cancel()
    queued.cancel()
    for task in (running, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert held.taken == []  # the loop did not wait for the thread
    held.go.set()
    await store.close()  # after the call still running
    assert held.taken == ["a"] and held.closed  # "a" ran to its end, "b" never ran
    with pytest.raises(StoreClosed):
        await store.take_lines("c", 1)
