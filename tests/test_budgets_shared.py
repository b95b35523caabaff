"""Spend budgets held for the fleet (``proxy.state.budgets``) on a real Redis: replicas
reserving at once never pass the amount, a dead replica's reservations expire while a live
one's do not, a replica cut off from Redis spends its share and adds it when Redis is back
(nothing lost, nothing counted twice); and three real ``serve`` replicas hammered with one
key's calls spend its budget and at most one call more."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

from proxy.config.state import StateSettings
from proxy.core.call.budgets import GO, HELD, SPENT, Budget, Refusal, Reservation, decide, period_of
from proxy.core.errors import StateUnavailable
from proxy.state.budgets import RESERVE, SharedBudgets
from proxy.state.shared import RedisState

from .redis_server import URL, PrivateRedis, free_port, prefixed
from .test_scaleout import replicas as serve_replicas
from .test_scaleout import status
from .test_state_shared import Recorder

AMOUNT = 10.0


@contextlib.asynccontextmanager
async def fleet(settings: StateSettings, n: int, amount: float = AMOUNT
                ) -> AsyncIterator[list[tuple[RedisState, SharedBudgets]]]:
    """``n`` replicas on one Redis, each with key ``k``'s budget of ``amount`` a day."""
    made = []
    try:
        for i in range(n):
            state = RedisState(settings, replica=f"r{i}")
            state.configure({}, [])
            book = state.budgets({"k": Budget(amount, "day")}, "UTC", time.time)
            await state.start(Recorder())
            made.append((state, book))
        yield made
    finally:
        for state, _ in made:
            await state.close()


@pytest.fixture
async def settings() -> AsyncIterator[StateSettings]:
    with prefixed() as (_, prefix):
        yield StateSettings(backend="redis", url=URL, prefix=prefix, lease_ttl_s=1.0)


def spent_in_redis(client: redis.Redis, prefix: str) -> float:
    start = int(period_of("day", time.time(), UTC)[0])  # type: ignore[arg-type]
    return sum(float(v) for v in client.hvals(f"{prefix}:bspent:k:{start}"))


async def until(predicate: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.05)


EIGHTHS = st.integers(0, 96).map(lambda n: n / 8)  # exact in binary: sums in any order agree


@examples(max_examples=100, deadline=None)
@given(amount=st.integers(1, 80).map(lambda n: n / 8), others=EIGHTHS, mine=EIGHTHS,
       held=st.lists(EIGHTHS, max_size=4), estimate=EIGHTHS, maximum=EIGHTHS)
def test_the_script_decides_as_the_core_does(
        amount: float, others: float, mine: float, held: list[float], estimate: float,
        maximum: float) -> None:
    with prefixed() as (client, prefix):
        start, expire = 1_800_000_000, 4_000_000_000_000
        client.zadd(f"{prefix}:replicas", {"me": expire})  # not a Redis that lost its state
        client.hset(f"{prefix}:bspent:k:{start}", mapping={"other": repr(others)})
        for i, amount_held in enumerate(held):
            client.zadd(f"{prefix}:bheld:k:{start}", {f"other|{i}|{amount_held!r}": expire})
        verdict, seen, reserved = client.register_script(RESERVE)(args=[
            f"{prefix}:", "k", start, expire, "me", repr(mine), "me|1|" + repr(maximum),
            repr(amount), repr(estimate), repr(maximum), 60_000])
        assert verdict == decide(amount, others + mine, sum(held), estimate)
        assert float(seen) == others
        assert float(reserved) == sum(held) + (maximum if verdict == GO else 0.0)


async def test_replicas_reserving_at_once_never_pass_the_amount(
        settings: StateSettings) -> None:
    with prefixed() as (client, _):
        async with fleet(settings, 3) as replicas:
            books = [book for _, book in replicas]
            wall = time.time()
            got = await asyncio.gather(*(books[i % 3].reserve("k", 1.0, 1.0, wall)
                                         for i in range(30)))
            made = [(books[i % 3], g) for i, g in enumerate(got) if isinstance(g, Reservation)]
            assert len(made) == AMOUNT  # exactly: the rest is held, none refused as spent
            assert all(isinstance(g, Refusal) and g.reason == HELD
                       for g in got if not isinstance(g, Reservation))
            for book, reservation in made[:4]:
                book.settle(reservation, 0.5)  # cheaper than reserved: room for more
            await until(lambda: spent_in_redis(client, settings.prefix) == 2.0)
            again = await asyncio.gather(*(books[i % 3].reserve("k", 1.0, 1.0, wall)
                                           for i in range(6)))
            more = [g for g in again if isinstance(g, Reservation)]
            assert len(more) == 2  # 2 spent + 6 reserved + 2 more = the amount
            for i, reservation in enumerate(more):
                made.append((books[i % 3], reservation))
            for book, reservation in made[4:]:
                book.settle(reservation, 1.0)
            await until(lambda: spent_in_redis(client, settings.prefix) == AMOUNT)
            refused = await books[2].reserve("k", 0.01, 0.01, wall)
            assert isinstance(refused, Refusal) and refused.reason == SPENT
            assert 0 < refused.retry_after_s <= 86400
            # Every replica shows the fleet's spend once a heartbeat has read it.
            await until(lambda: all(b.spent("k", time.time()) == AMOUNT for b in books))
            assert books[0].snapshot(time.time())["k"]["spent_usd"] == AMOUNT


async def test_a_dead_replicas_reservations_expire_a_live_ones_do_not(
        settings: StateSettings) -> None:
    async with fleet(settings, 2) as [(a, alive), (_, other)]:
        wall = time.time()
        long_call = await alive.reserve("k", 1.0, AMOUNT, wall)  # may cost the whole budget
        assert isinstance(long_call, Reservation)
        await asyncio.sleep(settings.lease_ttl_s * 2.5)  # refreshed by a's heartbeat
        held = await other.reserve("k", 1.0, 1.0, wall)
        assert isinstance(held, Refusal) and held.reason == HELD
        vanish(a)  # mid-call
        died = time.monotonic()
        while not isinstance(await other.reserve("k", 1.0, 1.0, time.time()), Reservation):
            await asyncio.sleep(0.05)
        assert time.monotonic() - died < settings.lease_ttl_s + a.beat_s + 0.5


def vanish(state: RedisState) -> None:
    """The replica dies: no heartbeat from now on, nothing released."""
    state._closed = True
    for task in state._loops:
        task.cancel()


async def test_redis_that_lost_the_spend_holds_calls_until_the_replicas_wrote_it_back(
        settings: StateSettings) -> None:
    """Flushed, Redis would leave a replica's own total alone: room for more calls. Calls
    are held while the replicas write back theirs, and that of one that died since."""
    with prefixed() as (client, _):
        async with fleet(settings, 2, 3.0) as [(_, a), (dead, b)]:
            await spend(a, 1.0, 1)
            await spend(b, 2.0, 1)
            await until(lambda: a.spent("k", time.time()) == 3.0)  # a read b's total
            vanish(dead)
            for key in client.scan_iter(f"{settings.prefix}:*"):
                client.delete(key)  # a flush
            first = await a.reserve("k", 1.5, 1.5, time.time())
            assert isinstance(first, Refusal) and first.reason == HELD
            async with asyncio.timeout(5):
                while isinstance(got := await a.reserve("k", 1.5, 1.5, time.time()), Refusal) \
                        and got.reason == HELD:
                    await asyncio.sleep(0.05)
            assert isinstance(got, Refusal) and got.reason == SPENT, got
            assert spent_in_redis(client, settings.prefix) == 3.0


async def test_reject_mode_refuses_a_budgeted_call_while_redis_is_away() -> None:
    settings = StateSettings(backend="redis", url=f"redis://127.0.0.1:{free_port()}/0",
                             on_error="reject")
    async with fleet(settings, 1) as [(state, book)]:
        assert state.mode == "reject"
        with pytest.raises(StateUnavailable):
            await book.reserve("k", 1.0, 1.0, time.time())


@contextlib.asynccontextmanager
async def private(n: int, amount: float) -> AsyncIterator[
        tuple[PrivateRedis, StateSettings, list[tuple[RedisState, SharedBudgets]]]]:
    server = PrivateRedis()
    server.start()
    settings = StateSettings(backend="redis", url=server.url, prefix="t", lease_ttl_s=3.0)
    try:
        async with fleet(settings, n, amount) as replicas:
            yield server, settings, replicas
    finally:
        server.stop()


async def spend(book: SharedBudgets, cost: float, times: int) -> None:
    for _ in range(times):
        reservation = await book.reserve("k", cost, cost, time.time())
        assert isinstance(reservation, Reservation), reservation
        book.settle(reservation, cost)


async def outage_spending(replicas: list[tuple[RedisState, SharedBudgets]]) -> None:
    """With 3 of 12 spent when Redis went away: each replica's share is (12 - 3) / 3."""
    for _, book in replicas:
        got = [await book.reserve("k", 1.0, 1.0, time.time()) for _ in range(4)]
        assert [isinstance(g, Reservation) for g in got] == [True, True, True, False]
        assert isinstance(got[3], Refusal) and got[3].reason == HELD  # its own in flight
        for reservation in got[:3]:
            assert isinstance(reservation, Reservation)
            book.settle(reservation, 1.0)
        refused = await book.reserve("k", 1.0, 1.0, time.time())
        assert isinstance(refused, Refusal) and refused.reason == SPENT


@pytest.mark.parametrize("outage", ["restart", "pause"])
async def test_without_redis_each_replica_spends_its_share_and_adds_it_when_back(
        outage: str) -> None:
    """``restart``: Redis comes back empty, and the replicas write their whole totals
    again; ``pause``: it comes back with what it had, and nothing is counted twice."""
    async with private(3, 12.0) as (server, _, replicas):
        client = redis.Redis(port=server.port, decode_responses=True)
        for _, book in replicas:
            await spend(book, 1.0, 1)
        beat = replicas[0][0].beat_s
        await until(lambda: all(b.spent("k", time.time()) == 3 for _, b in replicas))
        await asyncio.sleep(beat * 1.5)  # a heartbeat has seen what each replica spent
        if outage == "restart":
            server.stop()
        else:
            client.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        await until(lambda: all(s.mode == "local" for s, _ in replicas))
        await outage_spending(replicas)
        if outage == "restart":
            server.start()
        await until(lambda: all(s.mode == "shared" for s, _ in replicas), 10)
        await until(lambda: spent_in_redis(client, "t") == 12.0)
        await asyncio.sleep(beat * 2)
        assert spent_in_redis(client, "t") == 12.0  # and not more
        await until(lambda: all(b.spent("k", time.time()) == 12 for _, b in replicas))
        refused = await replicas[0][1].reserve("k", 0.01, 0.01, time.time())
        assert isinstance(refused, Refusal) and refused.reason == SPENT
        client.close()


class Billing:
    """An upstream that bills: each answer reports 100 to 2000 completion tokens (the
    cost at $1000/M out: $0.10 to $2), after ``hold_s``; it keeps every call's cost."""

    def __init__(self) -> None:
        self.costs: list[float] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        completion = 100 + (len(self.costs) * 617) % 1901
        self.costs.append(completion / 1000)
        await asyncio.sleep(0.05)
        return web.json_response({
            "id": "chatcmpl-b", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion,
                      "total_tokens": 5 + completion}})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def test_three_serve_replicas_hammered_spend_the_budget_and_at_most_one_call_more(
        tmp_path: Path) -> None:
    billing = Billing()
    await billing.start()
    try:
        with prefixed() as (_, prefix):
            config = tmp_path / "routing.yaml"
            config.write_text(f"""
tiers: [{{name: normal, max_wait_s: 60}}]
state: {{backend: redis, url: "{URL}", prefix: {prefix}, lease_ttl_s: 2}}
classify:
  keys: [{{name: app, key: app-key, budget_usd: {{amount: {AMOUNT}, period: day}}}}]
providers:
  - {{name: up, base_url: {billing.url}, max_concurrency: 20}}
models:
  m: [{{provider: up, model: x, output_cost: 1000}}]
""")
            async with serve_replicas(config, 3) as running, aiohttp.ClientSession() as session:
                bases = [base for base, _ in running]

                async def call(i: int) -> tuple[int, dict[str, Any], Any]:
                    async with session.post(
                            f"{bases[i % 3]}/v1/chat/completions",
                            headers={"Authorization": "Bearer app-key"},
                            json={"model": "m", "messages": [{"role": "user",
                                                              "content": f"c{i}"}]}) as resp:
                        return resp.status, dict(resp.headers), await resp.json()

                answers = await asyncio.gather(*(call(i) for i in range(60)))
                spent = sum(billing.costs)
                assert spent <= AMOUNT + max(billing.costs) + 1e-9
                assert spent >= AMOUNT - max(billing.costs)  # held calls waited for room
                assert sum(status == 200 for status, _, _ in answers) == len(billing.costs)
                for status_code, headers, body in answers:  # refused as spent, not held
                    assert status_code == 200 or (
                        body["error"]["code"] == "budget_exceeded"
                        and headers["x-should-retry"] == "false"), body
                # Later calls, on any replica: refused until midnight, and told so.
                now = datetime.now(UTC)
                midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(),
                                            UTC)
                for i in range(3):
                    status_code, headers, body = await call(i)
                    assert status_code == 429 and body["error"]["code"] == "budget_exceeded"
                    assert headers["x-should-retry"] == "false"
                    assert math.isclose(int(headers["Retry-After"]),
                                        (midnight - now).total_seconds(), abs_tol=5)
                # Every replica shows the fleet's spend (once a heartbeat read it).
                async with asyncio.timeout(5):
                    while True:
                        shown = [(await status(session, b))["budgets"]["app"]  # type: ignore[index]
                                 for b in bases]
                        if all(math.isclose(s["spent_usd"], spent, abs_tol=1e-6) for s in shown):
                            break
                        await asyncio.sleep(0.1)
                assert all(s["reserved_usd"] == 0 for s in shown)
                async with session.get(f"{bases[1]}/metrics") as resp:
                    metrics = await resp.text()
                line = next(x for x in metrics.splitlines()
                            if x.startswith('proxy_budget_spent_usd{key="app"}'))
                assert math.isclose(float(line.split()[-1]), spent, abs_tol=1e-6)
    finally:
        await billing.stop()
