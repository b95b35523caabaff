"""A lease given back and not sent yet, handed straight to the replica's next call for the
provider (``Batcher.hand_over``), on a real Redis: the lease stays in Redis under the new
call, only that call gives it back, and nothing is handed on once a call waits elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.state import StateSettings
from proxy.state import batcher
from proxy.state.base import Lease
from proxy.state.shared import RedisState

from .redis_server import URL, prefixed
from .test_state_shared import replica


@contextlib.asynccontextmanager
async def two(limit: int) -> AsyncIterator[tuple[RedisState, RedisState, str]]:
    with prefixed() as (_, prefix):
        settings = StateSettings(backend="redis", url=URL, prefix=prefix, lease_ttl_s=3.0)
        a, b = await replica(settings, "a", limit), await replica(settings, "b", limit)
        try:
            yield a, b, prefix + ":leases:p"
        finally:
            await a.close()
            await b.close()


async def test_a_lease_given_back_goes_to_the_next_call_and_only_that_call_gives_it_back(
        ) -> None:
    async with two(2) as (a, _, leases):
        first = await a.lease("p", 2, 0, 0, 5)  # its answer: nobody waits for p
        assert first is not None
        asking = asyncio.ensure_future(a.lease("p", 2, 0, 0, 5))  # asks in the same moment
        a.release(first)
        second = await asking
        assert second is not None and second.member == first.member and a.handed == 1
        a.release(first)  # the first call's second release: not its lease any more
        await asyncio.sleep(0.05)
        assert await a.client.zrange(leases, 0, -1) == [first.member]
        assert a.status()["leases_held"] == 1
        a.release(second)
        await asyncio.sleep(0.05)
        assert await a.client.zcard(leases) == 0 and not a._held


async def test_nothing_is_handed_on_while_a_call_waits_on_another_replica() -> None:
    """b's call waits for the only slot: a's release goes to Redis, which hands it to b,
    once a's last answer is older than ``HANDOFF_S`` or said someone waits."""
    async with two(1) as (a, b, _):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(b.lease("p", 1, 0, 0, 5))
        await asyncio.sleep(batcher.HANDOFF_S + 0.03)  # b waits; a's answer is stale
        asking = asyncio.ensure_future(a.lease("p", 1, 0, 0, 5))
        a.release(held)
        got = await asyncio.wait_for(waiting, 2)
        assert got is not None and a.handed == 0
        mine = asyncio.ensure_future(a.lease("p", 1, 0, 0, 5))  # a's next answer: b waits
        await asyncio.sleep(0.05)
        b.release(got)
        again = await asyncio.wait_for(asking, 2)
        assert again is not None
        a.release(again)  # the last answer said a call of a's waits: sent, not handed on
        assert (await asyncio.wait_for(mine, 2)) is not None and a.handed == 0


AGAIN = st.tuples(st.just("again"), st.integers(0, 20), st.integers(0, 2))  # end n-th, ask
OLD = st.tuples(st.just("old"), st.integers(0, 20), st.just(0))  # one of the last ended, again
OP = st.one_of(
    st.tuples(st.just("ask"), st.integers(0, 1), st.integers(0, 2)),  # replica, rank
    AGAIN, AGAIN, AGAIN, OLD, OLD,
    st.tuples(st.just("end"), st.integers(0, 20), st.just(0)),  # the n-th lease given back
    st.tuples(st.just("leave"), st.integers(0, 20), st.just(0)),  # a waiting call cancelled
    st.tuples(st.just("run"), st.sampled_from([1, 3, 25]), st.just(0)))  # the loop runs (ms)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(OP, min_size=1, max_size=30), limit=st.integers(1, 6))
def test_handed_leases_never_pass_the_limit_are_held_in_redis_and_none_leaks(
        ops: list[tuple[str, int, int]], limit: int) -> None:
    """Two replicas, calls asking, ending (a new call asking in the same moment: the lease
    may be handed to it), ending twice, leaving while they wait: every lease a call holds is
    in Redis and held by that call alone, never more than the limit, and once all ended
    Redis holds no lease and no waiter."""
    asyncio.run(_handed(ops, limit))


async def _handed(ops: list[tuple[str, int, int]], limit: int) -> None:
    async with two(limit) as (a, b, leases):
        states = (a, b)
        pending: list[tuple[asyncio.Future[Lease | None], RedisState]] = []
        live: list[tuple[Lease, RedisState]] = []
        ended: list[tuple[Lease, RedisState]] = []

        def ask(state: RedisState, rank: int) -> None:
            pending.append((asyncio.ensure_future(state.lease("p", limit, rank, 0, 10)), state))

        def end(n: int) -> RedisState:
            lease, state = live.pop(n % len(live))
            state.release(lease)
            ended.append((lease, state))
            return state

        for op, n, value in ops:
            if op == "ask":
                ask(states[n], value)
            elif op == "again" and live:
                state = live[n % len(live)][1]
                ask(state, value)  # before the release: it may find the lease not sent yet
                end(n)
            elif op == "end" and live:
                end(n)
            elif op == "old" and ended:
                lease, state = ended[-1 - n % 3 % len(ended)]
                state.release(lease)
            elif op == "leave" and pending:
                pending[n % len(pending)][0].cancel()
            await asyncio.sleep(n / 1000 if op == "run" else 0)
            for future, state in [p for p in pending if p[0].done()]:
                pending.remove((future, state))
                if not future.cancelled() and (got := future.result()) is not None:
                    live.append((got, state))
            members = [lease.member for lease, _ in live]
            assert len(members) == len(set(members)) <= limit
            in_redis = set(await a.client.zrange(leases, 0, -1))
            assert set(members) <= in_redis and len(in_redis) <= limit
        for future, _ in pending:
            future.cancel()
        results = await asyncio.gather(*(future for future, _ in pending),
                                       return_exceptions=True)
        for (_, state), got in zip(pending, results, strict=True):
            if isinstance(got, Lease):  # granted before the cancel reached it
                state.release(got)
        while live:
            end(0)
        for _ in range(40):
            await asyncio.sleep(0.05)
            if not await a.client.exists(leases, leases.replace("leases", "waiters")):
                break
        assert await a.client.zcard(leases) == 0
        assert await a.client.zcard(leases.replace("leases", "waiters")) == 0
        assert not a._held and not b._held


async def test_no_lease_is_handed_over_across_a_heartbeat() -> None:
    """A heartbeat that finds Redis forgot this replica removes its leases not held, given
    back ones too: once one is sent, no answer from before it may hand such a lease on."""
    loop = asyncio.get_running_loop()
    answers: list[asyncio.Future[list[object]]] = [loop.create_future() for _ in range(3)]
    waiting = list(answers)

    async def script(args: list[object]) -> list[object]:
        return await waiting.pop(0)

    sender = batcher.Batcher(script, "t:", 3000, lambda: {"p": 2}, lambda *_: None,
                             (ConnectionError,))
    answers[0].set_result(["1", ["p"]])  # the first batch: nobody waits for p
    assert await sender.ask("p", "a|1|p", 2, 0, 0) == 1
    second = sender.ask("p", "a|2|p", 2, 0, 0)  # a second batch goes out, and waits
    await asyncio.sleep(0)
    sender.give_back("a|1|p", "p", held=True)  # given back while it is out
    assert sender.hand_over("p", 2) == "a|1|p"  # what the first batch said still holds
    sender.give_back("a|1|p", "p", held=True)
    sender.distrust()  # a heartbeat is sent
    assert sender.hand_over("p", 2) is None
    answers[1].set_result(["1", ["p"]])  # the second batch, run before the heartbeat
    assert await second == 1
    assert sender.hand_over("p", 2) is None  # its release went in the next batch at once
    answers[2].set_result(["", ["p"]])
    await asyncio.sleep(0)
