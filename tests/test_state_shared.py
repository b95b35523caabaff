"""``RedisState`` on a real Redis: replicas share slots, the best waiter across them is
woken without polling, cancelled and timed-out waits leave nothing behind, breakers and
modes reach the proxy, and an unreachable Redis is handled as ``on_error`` says."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping

import pytest
from redis.asyncio import Redis

from proxy.config.state import StateSettings
from proxy.core.errors import StateUnavailable
from proxy.state.base import Lease
from proxy.state.shared import RedisState

from .redis_server import URL, PrivateRedis, SlowRelay, free_port, prefixed


class Recorder:
    def __init__(self) -> None:
        self.modes: list[tuple[str, int]] = []
        self.breakers: list[dict[str, float]] = []

    def on_mode(self, mode: str, alive: int) -> None:
        self.modes.append((mode, alive))

    def on_breakers(self, open_for_s: Mapping[str, float]) -> None:
        self.breakers.append(dict(open_for_s))


async def replica(settings: StateSettings, name: str, limit: int = 1) -> RedisState:
    state = RedisState(settings, replica=name)
    state.configure({"p": limit}, ["p/m"])
    await state.start(Recorder())
    return state


@contextlib.asynccontextmanager
async def replicas(settings: StateSettings, *names: str) -> AsyncIterator[list[RedisState]]:
    """Replicas ``names`` on one Redis, closed on the way out."""
    states = [await replica(settings, name) for name in names]
    try:
        yield states
    finally:
        for state in states:
            await state.close()


@contextlib.asynccontextmanager
async def private_redis() -> AsyncIterator[tuple[PrivateRedis, StateSettings]]:
    """A Redis of the test's own (to stop and start again), and settings on it."""
    server = PrivateRedis()
    server.start()
    try:
        yield server, StateSettings(backend="redis", url=server.url, lease_ttl_s=3.0)
    finally:
        server.stop()


@pytest.fixture
async def settings() -> AsyncIterator[StateSettings]:
    with prefixed() as (_, prefix):
        yield StateSettings(backend="redis", url=URL, prefix=prefix, lease_ttl_s=3.0)


async def test_replicas_share_one_limit_and_the_best_waiter_is_woken_at_once(
        settings: StateSettings) -> None:
    async with replicas(settings, "a", "b", "c") as (a, b, c):
        first = await a.lease("p", 1, rank=0, waited_s=0, timeout_s=5)
        assert isinstance(first, Lease)
        low = asyncio.ensure_future(b.lease("p", 1, rank=32, waited_s=30, timeout_s=5))
        await asyncio.sleep(0.05)
        high = asyncio.ensure_future(c.lease("p", 1, rank=0, waited_s=0, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not low.done() and not high.done()
        started = time.monotonic()
        a.release(first)
        second = await asyncio.wait_for(high, 2)
        assert time.monotonic() - started < 0.5  # woken by its wake list, not a sweep
        assert isinstance(second, Lease) and not low.done()
        c.release(second)
        assert isinstance(await asyncio.wait_for(low, 2), Lease)
        assert c.status()["leases_held"] == 0 and b.status()["leases_held"] == 1
        await asyncio.sleep(a.beat_s + 0.2)
        assert a.status()["replicas_alive"] == 3


async def test_keys_share_a_rank_across_replicas_by_their_virtual_clocks(
        settings: StateSettings) -> None:
    """A key's burst of 6 calls waits on replica a; a light key's call arrives later on
    replica b and is granted a slot right after the burst's first call, not after the
    burst; a key of weight 3 beside one of weight 1 is granted three calls for each of the
    other's."""
    async with replicas(settings, "a", "b") as (a, b):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        burst = [asyncio.ensure_future(a.lease("p", 1, 0, 0, 10, key="heavy", claim_s=1.0))
                 for _ in range(6)]
        await asyncio.sleep(0.1)
        light = asyncio.ensure_future(b.lease("p", 1, 0, 0, 10, key="light", claim_s=1.0))
        await asyncio.sleep(0.1)
        a.release(held)
        oldest = await asyncio.wait_for(burst[0], 2)
        assert oldest is not None and not light.done()
        a.release(oldest)
        second = await asyncio.wait_for(light, 2)
        assert isinstance(second, Lease) and not any(t.done() for t in burst[1:])
        b.release(second)
        for task in burst[1:]:
            a.release(await asyncio.wait_for(task, 5))  # type: ignore[arg-type]

        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        order: list[str] = []

        async def one(state: RedisState, key: str, weight: float) -> None:
            lease = await state.lease("p", 1, 0, 0, 20, key=key, weight=weight, claim_s=1.0)
            assert lease is not None
            order.append(key)
            await asyncio.sleep(0.01)
            state.release(lease)

        waiting = [asyncio.ensure_future(one(a, "gold", 3.0)) for _ in range(9)]
        waiting += [asyncio.ensure_future(one(b, "bronze", 1.0)) for _ in range(9)]
        await asyncio.sleep(0.2)
        a.release(held)
        await asyncio.wait_for(asyncio.gather(*waiting), 10)
    assert order[:8].count("gold") == 6


async def test_a_cancelled_or_timed_out_wait_leaves_no_waiter_and_no_slot(
        settings: StateSettings) -> None:
    async with replicas(settings, "a", "b") as (a, b):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(b.lease("p", 1, 0, 0, 5))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(TimeoutError):
            await b.lease("p", 1, 0, 0, 0.1)
        await asyncio.sleep(0.1)
        client = a._redis
        assert await client.zcard(settings.prefix + ":waiters:p") == 0
        a.release(held)
        a.release(held)  # twice: nothing more
        await asyncio.sleep(0.1)
        assert await client.zcard(settings.prefix + ":leases:p") == 0
        again = await b.lease("p", 1, 0, 0, 1)
        assert again is not None
        b.release(again)


async def test_a_lease_granted_to_a_call_that_left_goes_straight_back(
        settings: StateSettings) -> None:
    async with replicas(settings, "a", "b") as (a, b):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        # A grant nobody waits for (as if the waiter left just as it was granted).
        await b._redis.rpush(settings.prefix + ":wake:b", "b|77|p")
        await b._redis.zadd(settings.prefix + ":leases:p", {"b|77|p": 1e15})
        a.release(held)
        await asyncio.sleep(0.3)
        assert await b._redis.zcard(settings.prefix + ":leases:p") == 0


async def test_a_breaker_opened_on_one_replica_reaches_the_others(
        settings: StateSettings) -> None:
    async with replicas(settings, "a", "b") as (a, b):
        a.breaker_opened("p/m", 5.0)
        await asyncio.sleep(b.beat_s + 0.3)
        hooks = b._link.hooks
        assert isinstance(hooks, Recorder)
        assert hooks.breakers and 3.0 < hooks.breakers[-1]["p/m"] <= 5.0


async def test_shared_rate_buckets_hold_across_replicas(settings: StateSettings) -> None:
    async with replicas(settings, "a", "b") as (a, b):
        assert await a.take_rate("key:k", 2, None, 10) == 0
        assert await b.take_rate("key:k", 2, None, 10) == 0
        assert await a.take_rate("key:k", 2, None, 10) > 20
        b.reconcile_rate("key:k", 2, None, 1, 0)  # one never went: its request comes back
        await asyncio.sleep(0.1)
        assert await a.take_rate("key:k", 2, None, 10) == 0


async def test_unreachable_redis_local_mode_and_reject_mode() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    local = RedisState(StateSettings(backend="redis", url=url, lease_ttl_s=3.0), "x")
    local.configure({"p": 4}, [])
    hooks = Recorder()
    await local.start(hooks)
    try:
        assert local.mode == "local" and hooks.modes == [("local", 1)]
        noted = await local.lease("p", 4, 0, 0, 1)  # goes on with its share, noted
        assert isinstance(noted, Lease) and local.status()["leases_held"] == 1
        local.release(noted)
        assert await local.take_rate("key:k", 1, None, 1) == 0
        assert await local.take_rate("key:k", 1, None, 1) > 0  # a local share of the rpm
        assert local.status()["errors"] >= 1 and local.status()["last_error"]
    finally:
        await local.close()
    reject = RedisState(StateSettings(backend="redis", url=url, on_error="reject"), "y")
    await reject.start(Recorder())
    try:
        with pytest.raises(StateUnavailable):
            await reject.lease("p", 4, 0, 0, 1)
    finally:
        await reject.close()


async def test_redis_restarted_waiters_fall_back_then_shared_mode_returns() -> None:
    async with private_redis() as (server, settings), \
            replicas(settings, "a", "b") as (a, b):
        held = await a.lease("p", 1, 0, 0, 5)
        waiting = asyncio.ensure_future(b.lease("p", 1, 0, 0, 10))
        await asyncio.sleep(0.1)
        server.stop()
        assert await asyncio.wait_for(waiting, 3) is None  # to queue again, under its share
        assert b.mode == "local"
        assert held is not None
        noted = await b.lease("p", 1, 0, 0, 1)  # started without Redis, under b's share
        assert noted is not None
        server.start()
        await asyncio.sleep(a.beat_s * 2 + 0.5)
        assert a.mode == "shared" and b.mode == "shared"
        # Both are written back: the calls started before and during the outage count.
        assert await a._redis.zcard(settings.prefix + ":leases:p") == 2
        b.release(noted)
        # The lease held across the outage was written back: the limit holds again.
        with pytest.raises(TimeoutError):
            await b.lease("p", 1, 0, 0, 0.3)
        a.release(held)
        await asyncio.sleep(0.1)
        got = await b.lease("p", 1, 0, 0, 1)
        assert got is not None
        b.release(got)


async def test_a_call_whose_ask_fails_queues_again_under_the_share_not_at_once() -> None:
    """The local scheduler let the call through under the whole limit (shared mode): if
    its ask is what finds Redis gone, it must not start on a noted lease (two replicas
    would each start a whole limit's worth), but queue again, under the share."""
    async with private_redis() as (server, settings), replicas(settings, "a") as (a,):
        server.stop()
        assert a.mode == "shared"  # no heartbeat has failed yet: the ask finds out
        assert await a.lease("p", 1, 0, 0, 5) is None
        assert a.mode == "local" and not a._held
        noted = await a.lease("p", 1, 0, 0, 5)  # queued again: under its share, noted
        assert isinstance(noted, Lease)
        a.release(noted)


BUSY_300_MS = """
local t0 = redis.call('TIME')
local s0 = tonumber(t0[1]) * 1e6 + tonumber(t0[2])
while true do
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1e6 + tonumber(t[2]) - s0 > 300000 then break end
end
return 0
"""


async def test_a_call_that_leaves_while_its_request_for_a_slot_is_in_flight_leaves_nothing(
        settings: StateSettings) -> None:
    a, b = await replica(settings, "a"), await replica(settings, "b")
    slow = Redis.from_url(settings.url)
    try:
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        busy = asyncio.ensure_future(slow.eval(BUSY_300_MS, 0))
        await asyncio.sleep(0.05)  # Redis is busy: b's batch goes out, its answer waits
        leaving = asyncio.ensure_future(b.lease("p", 1, 0, 0, 5))
        await asyncio.sleep(0.1)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await busy
        a.release(held)
        again = await a.lease("p", 1, 0, 0, 2)  # the slot is not stuck with b
        assert again is not None and not b._waiting and not b._held
        a.release(again)
    finally:
        await slow.aclose()
        await a.close()
        await b.close()


async def test_a_replica_that_closes_takes_its_waiters_out_of_redis(
        settings: StateSettings) -> None:
    a, b = await replica(settings, "a"), await replica(settings, "b")
    try:
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(b.lease("p", 1, 0, 0, 5))
        await asyncio.sleep(0.1)
        await b.close()
        assert await waiting is None
        assert await a._redis.zcard(settings.prefix + ":waiters:p") == 0
        a.release(held)
    finally:
        await a.close()


async def test_a_restart_between_two_heartbeats_is_noticed_and_leases_written_back() -> None:
    async with private_redis() as (server, settings), \
            replicas(settings, "a", "b") as (a, b):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        server.stop()
        server.start()  # quicker than a heartbeat: no command of a failed meanwhile
        await asyncio.sleep(a.beat_s + 0.3)
        with pytest.raises(TimeoutError):  # a's lease is back: b waits
            await b.lease("p", 1, 0, 0, 0.5)
        a.release(held)


async def test_a_flushed_redis_is_rebuilt_from_what_the_replica_holds(
        settings: StateSettings) -> None:
    """Leases, open breakers, 429 cuts and what was taken from the rate buckets all come
    back from the replica after a flush, and it never left shared mode."""
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        a.breaker_opened("p/m", 30.0)
        a.limit_cut("p", 1, 30.0)
        assert await a.take_rate("provider:p", 2, None, 0) == 0
        assert await a.take_rate("provider:p", 2, None, 0) == 0
        await asyncio.sleep(0.1)
        client, p = a.client, settings.prefix + ":"
        await client.delete(*[k async for k in client.scan_iter(p + "*")])
        await asyncio.sleep(a.beat_s + 0.4)
        assert a.mode == "shared" and a.status()["rebuilt"] == {
            "times": 1, "leases": 1, "waiters": 0, "breakers": 1, "cuts": 1, "buckets": 1}
        assert await client.zrange(p + "leases:p", 0, -1) == [held.member]
        assert 25_000 < await client.pttl(p + "breaker:p/m") <= 30_000
        assert await client.get(p + "limit:p") == "1"
        assert await a.take_rate("provider:p", 2, None, 0) > 20  # still spent
        a.release(held)


async def test_a_slow_redis_is_waited_for_in_shared_mode_and_never_stalls_the_loop(
        settings: StateSettings) -> None:
    """200 ms per answer (under the 0.5 s command timeout): slots are still leased across
    replicas in the one order, the replicas stay in shared mode, and the event loop is
    never held up by it."""
    relay = SlowRelay(6379, 0.2)
    await relay.start()
    slow = StateSettings(backend="redis", url=relay.url, prefix=settings.prefix,
                         lease_ttl_s=3.0)
    loop = asyncio.get_running_loop()
    worst, stop = 0.0, False

    async def probe() -> None:
        nonlocal worst
        while not stop:
            before = loop.time()
            await asyncio.sleep(0.005)
            worst = max(worst, loop.time() - before - 0.005)

    probing = asyncio.ensure_future(probe())
    try:
        async with replicas(slow, "a", "b") as (a, b):
            started = loop.time()
            held = await a.lease("p", 1, 0, 0, 5)
            assert held is not None and loop.time() - started >= 0.2
            waiting = asyncio.ensure_future(b.lease("p", 1, 0, 0, 5))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            a.release(held)
            got = await asyncio.wait_for(waiting, 3)
            assert got is not None
            await asyncio.sleep(a.beat_s * 2)  # heartbeats take their 200 ms too
            assert (a.mode, b.mode) == ("shared", "shared") and a.errors == b.errors == 0
            b.release(got)
    finally:
        stop = True
        await probing
        await relay.stop()
    assert worst < 0.1, worst


async def test_a_waiter_withdrawn_before_its_ask_goes_out_queues_again_not_cancelled(
        settings: StateSettings) -> None:
    """``withdraw_below`` picks a call whose ask still waits in the batcher: its ``lease``
    answers None (queue again here), it does not raise CancelledError into a call whose
    client is still there (the soak saw those as 499s and closed connections)."""
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        other = asyncio.ensure_future(a.lease("p", 1, 2, 0, 5))
        low = asyncio.ensure_future(a.lease("p", 1, 3, 0, 5))
        await asyncio.sleep(0)  # both asked; the first batch is out, the second waits
        assert a.withdraw_below("p", 0)
        assert await asyncio.wait_for(low, 2) is None
        a.release(held)
        got = await asyncio.wait_for(other, 2)
        assert got is not None
        a.release(got)


async def test_a_waiter_withdrawn_while_its_ask_is_granted_does_not_run_without_a_lease(
        settings: StateSettings) -> None:
    """The ask is in Redis (busy for 300 ms) when the call is withdrawn; Redis then grants
    it the free slot. The call must not start: the withdrawal's release frees that slot,
    and a call running on it would hold no lease (the soak saw a provider one call over its
    limit with Redis holding no more leases than the limit)."""
    async with replicas(settings, "a") as (a,):
        slow = Redis.from_url(settings.url)
        try:
            busy = asyncio.ensure_future(slow.eval(BUSY_300_MS, 0))
            await asyncio.sleep(0.05)
            asking = asyncio.ensure_future(a.lease("p", 1, 3, 0, 5))
            await asyncio.sleep(0.05)  # its batch is out, waiting behind the busy script
            assert a.withdraw_below("p", 0)
            await busy
            assert await asyncio.wait_for(asking, 2) is None
            await asyncio.sleep(0.1)
            assert await a.client.zcard(settings.prefix + ":leases:p") == 0
            assert not a._held
        finally:
            await slow.aclose()


@contextlib.contextmanager
def script_held(owner: object, name: str, after: bool = False) -> Iterator[asyncio.Event]:
    """Every call of ``owner``'s script ``name`` waits for the event: before it reaches
    Redis, or (``after``) once Redis ran it, before its answer is read."""
    gate = asyncio.Event()
    script = getattr(owner, name)

    async def held(**kwargs: object) -> object:
        if not after:
            await gate.wait()
        answer = await script(**kwargs)
        if after:
            await gate.wait()
        return answer

    setattr(owner, name, held)
    try:
        yield gate
    finally:
        setattr(owner, name, script)


def batches_held(state: RedisState) -> contextlib.AbstractContextManager[asyncio.Event]:
    """The batches ``state`` sends wait on the way (a slow link on the batch's connection
    only): the heartbeat still gets through."""
    return script_held(state._batcher, "_script")


def heartbeats_held(state: RedisState,
                    after: bool = False) -> contextlib.AbstractContextManager[asyncio.Event]:
    return script_held(state, "_heartbeat", after)


async def test_a_heartbeat_before_an_ask_reaches_redis_does_not_lose_the_call(
        settings: StateSettings) -> None:
    """A heartbeat that reaches Redis before a waiter's ask finds the waiter in neither
    leases nor waiters. That is not a waiter Redis lost: asking again for it replaced the
    ask still waiting in the batcher, whose call then waited forever (the soak saw two
    calls time out at the client after 90 s with no answer, never sent upstream)."""
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        with batches_held(a) as gate:
            first = asyncio.ensure_future(a.lease("p", 1, 1, 0, 5))
            await asyncio.sleep(0)  # its batch is out, held on the way
            second = asyncio.ensure_future(a.lease("p", 1, 2, 0, 5))
            await asyncio.sleep(0)  # its ask waits in the batcher for the next batch
            await a._beat()
            gate.set()
            await asyncio.sleep(0.1)
            a.release(held)
            got = await asyncio.wait_for(first, 2)
            assert got is not None
            a.release(got)
            got = await asyncio.wait_for(second, 2)
            assert got is not None
            a.release(got)
        await asyncio.sleep(0.1)
        assert await a.client.zcard(settings.prefix + ":leases:p") == 0
        assert await a.client.zcard(settings.prefix + ":waiters:p") == 0


async def test_a_waiter_redis_lost_is_asked_for_once_while_its_ask_is_out(
        settings: StateSettings) -> None:
    """Redis forgot a waiter (its waiters set emptied): the heartbeat asks again for it,
    and a second heartbeat while that ask is out does not ask a third time."""
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(a.lease("p", 1, 1, 0, 5))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await a.client.delete(settings.prefix + ":waiters:p")
        asked: list[object] = []
        ask = a._batcher.ask

        def counted(*args: object, **kwargs: object) -> asyncio.Future[int]:
            asked.append(args[1])
            return ask(*args, **kwargs)  # type: ignore[arg-type]

        a._ask = counted
        with batches_held(a) as gate:
            await a._beat()
            await asyncio.sleep(0)
            await a._beat()
            await asyncio.sleep(0)
            gate.set()
            await asyncio.sleep(0.1)
        assert len(asked) == 1, asked
        assert await a.client.zcard(settings.prefix + ":waiters:p") == 1
        a.release(held)
        got = await asyncio.wait_for(waiting, 2)
        assert got is not None
        a.release(got)


async def test_an_ask_repeated_before_it_is_sent_shares_its_answer(
        settings: StateSettings) -> None:
    async with replicas(settings, "a") as (a,):
        with batches_held(a) as gate:
            out = a._batcher.ask("p", "a|x|p", 1, 0, 0)
            await asyncio.sleep(0)  # its batch is out, held on the way
            first = a._batcher.ask("p", "a|y|p", 1, 0, 0)
            again = a._batcher.ask("p", "a|y|p", 1, 0, 0)
            assert again is first
            gate.set()
            assert await asyncio.wait_for(out, 2) == 1
            assert await asyncio.wait_for(first, 2) == 0  # it waits: the slot is x's
        a._batcher.give_back("a|y|p", "p")
        a._batcher.give_back("a|x|p", "p")
        await asyncio.sleep(0.1)
        assert await a.client.zcard(settings.prefix + ":leases:p") == 0
        assert await a.client.zcard(settings.prefix + ":waiters:p") == 0


async def test_a_waiter_withdrawn_before_its_ask_again_goes_leaves_no_waiter(
        settings: StateSettings) -> None:
    """Review (helper-22): Redis lost a waiter, the heartbeat starts asking again for it,
    and the call is sent back to its local queue before that ask goes: it is not asked
    for (it would wait in Redis with no call behind it, holding up the others)."""
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(a.lease("p", 1, 3, 0, 5))
        await asyncio.sleep(0.1)
        await a.client.delete(settings.prefix + ":waiters:p")  # Redis lost it
        await a._beat()  # reported lost: asked again soon
        assert a.withdraw_below("p", 0)
        assert await asyncio.wait_for(waiting, 2) is None
        await asyncio.sleep(0.2)
        assert await a.client.zrange(settings.prefix + ":waiters:p", 0, -1) == []
        a.release(held)


async def test_a_call_that_leaves_as_the_heartbeat_says_it_was_lost_leaves_no_waiter(
        settings: StateSettings) -> None:
    async with replicas(settings, "a") as (a,):
        held = await a.lease("p", 1, 0, 0, 5)
        assert held is not None
        waiting = asyncio.ensure_future(a.lease("p", 1, 1, 0, 5))
        await asyncio.sleep(0.1)
        await a.client.delete(settings.prefix + ":waiters:p")
        with heartbeats_held(a, after=True) as gate:
            beat = asyncio.ensure_future(a._beat())
            await asyncio.sleep(0.1)  # Redis answered "lost"; the answer is not read yet
            gate.set()
            waiting.cancel()  # the call's deadline, in the same moment
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await beat
        await asyncio.sleep(0.2)
        assert await a.client.zrange(settings.prefix + ":waiters:p", 0, -1) == []
        a.release(held)


async def test_a_lease_granted_while_a_heartbeat_that_finds_redis_forgot_is_out_is_kept(
        settings: StateSettings) -> None:
    """Review (helper-22): Redis forgot this replica (an older copy after a failover); a
    grant reaches it before the heartbeat that finds out, which drops the leases it did not
    list. The next heartbeat writes every lease held back, so the slot is not given twice."""
    async with replicas(settings, "a", "b") as (a, b):
        with heartbeats_held(a) as gate:
            beat = asyncio.ensure_future(a._beat())
            await asyncio.sleep(0)  # its arguments are built: a holds nothing
            await a.client.delete(settings.prefix + ":seen:a")
            lease = await a.lease("p", 1, 0, 0, 5)
            assert lease is not None
            gate.set()
            await beat
        await asyncio.sleep(a.beat_s + 0.2)
        assert await a.client.zscore(settings.prefix + ":leases:p", lease.member)
        with pytest.raises(TimeoutError):
            other = await b.lease("p", 1, 0, 0, 2)
            assert other is not None
            b.release(other)
        a.release(lease)


async def test_a_lease_released_while_a_heartbeat_writes_leases_back_stays_released(
        settings: StateSettings) -> None:
    async with replicas(settings, "a") as (a,):
        lease = await a.lease("p", 1, 0, 0, 5)
        assert lease is not None
        await a.client.delete(settings.prefix + ":seen:a")  # Redis forgot a
        with heartbeats_held(a) as gate:
            beat = asyncio.ensure_future(a._beat())
            await asyncio.sleep(0)  # its arguments are built: the lease is listed as held
            a.release(lease)
            await asyncio.sleep(0.1)  # the release reached Redis first
            gate.set()
            await beat
        await asyncio.sleep(0.1)
        assert await a.client.zrange(settings.prefix + ":leases:p", 0, -1) == []
