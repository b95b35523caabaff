"""The async shell: waiters, wake-ups, cancellation, the one timer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from proxy.core.clock import FakeClock, SystemClock
from proxy.core.errors import ShuttingDown
from proxy.core.scheduling.scheduler import (
    Dispatch,
    Rejection,
    Scheduler,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)
from proxy.http.call.admission import Admission

T = TypeVar("T")
FOUR = (TierSpec("critical", 8), TierSpec("high", 4), TierSpec("normal", 2), TierSpec("low", 1))


class CountingScheduler(Scheduler):
    """Counts the calls the shell makes, to prove there is no polling."""

    advances = 0

    def advance(self, now: float) -> None:
        self.advances += 1
        super().advance(now)


def make(caps: dict[str, int] | None = None, tiers: tuple[TierSpec, ...] = FOUR,
         clock: FakeClock | SystemClock | None = None,
         **settings: object) -> tuple[Admission, CountingScheduler]:
    scheduler = CountingScheduler(
        SchedulerSettings(tiers=tiers, **settings),  # type: ignore[arg-type]
        caps if caps is not None else {"p": 1},
    )
    return Admission(scheduler, clock or FakeClock()), scheduler


def ticket(tier: int, est: float = 1.0, candidates: tuple[str, ...] = ("p",)) -> Ticket:
    return Ticket(tier=tier, candidates=candidates, est_service_s=est)


async def within(awaitable: Awaitable[T], seconds: float = 2.0) -> T:
    """A broken shell must fail a test, not hang it."""
    return await asyncio.wait_for(awaitable, seconds)


async def spin() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def release(adm: Admission, t: Ticket) -> None:
    """The call holding ``t``'s slot finished (at the moment it was granted)."""
    adm.scheduler.release(t, t.dispatched_at)
    adm.act_on_decisions()


async def granted(adm: Admission, t: Ticket) -> Ticket:
    decision = await adm.wait(t)
    assert isinstance(decision, Dispatch), decision
    return t


async def test_waiters_wake_in_dispatch_order() -> None:
    adm, s = make()
    first = await granted(adm, ticket(0))
    order: list[int] = []

    async def call(tier: int) -> None:
        t = await granted(adm, ticket(tier))
        order.append(tier)
        release(adm, t)

    tasks = [asyncio.create_task(call(t)) for t in (3, 1, 2, 0, 3)]
    await spin()
    assert order == [] and sum(s.depth(i) for i in range(4)) == 5
    release(adm, first)
    await within(asyncio.gather(*tasks))
    assert order == [0, 1, 2, 3, 3]
    assert s.inflight("p") == 0
    adm.close()


async def test_cancelled_while_queued_leaves_no_ghost() -> None:
    adm, s = make()
    first = await granted(adm, ticket(0))
    gone = ticket(1)
    task = asyncio.create_task(adm.wait(gone))
    await spin()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task)
    assert gone.state is TicketState.CANCELLED and s.depth(1) == 0
    release(adm, first)
    assert s.inflight("p") == 0
    adm.close()


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_cancel_racing_with_dispatch_gives_the_slot_back(cancel_first: bool) -> None:
    adm, s = make()
    first = await granted(adm, ticket(0))
    racer, patient = ticket(1), ticket(2)
    racing = asyncio.create_task(adm.wait(racer))
    waiting = asyncio.create_task(adm.wait(patient))
    await spin()
    if cancel_first:  # the waiter is cancelled, then its slot is granted before it runs
        racing.cancel()
        release(adm, first)
    else:  # the slot is granted, then the waiter is cancelled before it sees it
        release(adm, first)
        racing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(racing)
    assert racer.state in (TicketState.RELEASED, TicketState.CANCELLED)
    decision = await within(waiting)  # the slot went on to the next waiter
    assert isinstance(decision, Dispatch) and decision.ticket is patient
    assert s.inflight("p") == 1
    release(adm, patient)
    assert s.inflight("p") == 0
    adm.close()


async def test_deadline_timer_fires_without_polling() -> None:
    tiers = (TierSpec("a", max_wait_s=0.05), TierSpec("b", max_wait_s=0.2))
    adm, s = make(tiers=tiers, clock=SystemClock())
    await granted(adm, ticket(0))
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(adm.wait(ticket(0)), adm.wait(ticket(1))),
                                     2.0)
    elapsed = time.monotonic() - started
    assert all(isinstance(r, Rejection) and r.code == "queue_timeout" for r in results)
    assert elapsed >= 0.2  # not before b's deadline; wait_for's 2 s bounds it generously
    assert s.advances <= 4  # one per deadline (a timer may fire a hair early once each)
    adm.close()


async def test_lapsed_reservation_wakes_a_waiter() -> None:
    # The low tier is background, so the urgent tier's floor is both slots and its hold
    # may keep the free one; the budget is unlimited, so only the lapse ends the hold.
    tiers = (*FOUR[:3], TierSpec("low", 0.0))
    adm, s = make({"p": 2}, tiers, clock=SystemClock(), headroom_horizon_s=0.1,
                  headroom_budget=1.0)
    await granted(adm, ticket(0, 30.0))  # heavy urgent demand holds the other slot back
    low = ticket(3)
    started = time.monotonic()
    await asyncio.wait_for(granted(adm, low), 2.0)
    assert time.monotonic() - started >= 0.09
    assert s.advances <= 3
    adm.close()


async def test_a_pause_that_ends_wakes_the_waiter_by_the_timer() -> None:
    clock = SystemClock()
    adm, s = make(clock=clock)
    s.pause("p", clock.now() + 0.1, clock.now())
    started = time.monotonic()
    await within(granted(adm, ticket(0)))
    assert time.monotonic() - started >= 0.09
    assert s.advances <= 2
    adm.close()


async def test_queue_full_and_eviction_are_decisions_with_retry_after() -> None:
    adm, _ = make(max_queue=1)
    first = await granted(adm, ticket(0))
    low = asyncio.create_task(adm.wait(ticket(3)))
    await spin()
    full = await within(adm.wait(ticket(3)))
    assert isinstance(full, Rejection) and full.code == "queue_full"
    assert full.retry_after_s >= 1
    high = asyncio.create_task(adm.wait(ticket(1)))
    evicted = await within(low)
    assert isinstance(evicted, Rejection) and evicted.code == "evicted"
    release(adm, first)
    assert isinstance(await within(high), Dispatch)
    adm.close()


async def test_core_changes_made_elsewhere_are_acted_on() -> None:
    """A verdict, a breaker or a limit changes the scheduler outside the shell;
    ``act_on_decisions`` wakes whoever that decided on."""
    clock = FakeClock()
    adm, s = make({"p": 1, "q": 0}, clock=clock)
    await granted(adm, ticket(0))
    on_q = asyncio.create_task(adm.wait(ticket(1, 1.0, ("q",))))
    on_p = asyncio.create_task(adm.wait(ticket(1)))
    await spin()
    s.set_max("q", 1, clock.now())
    assert not on_q.done()
    adm.act_on_decisions()
    assert isinstance(await within(on_q), Dispatch)
    s.set_max("p", 2, clock.now())
    adm.act_on_decisions()
    assert isinstance(await within(on_p), Dispatch)
    adm.close()


async def test_close_turns_waiters_away() -> None:
    adm, s = make()
    await granted(adm, ticket(0))
    waiting = asyncio.create_task(adm.wait(ticket(2)))
    await spin()
    adm.close()
    with pytest.raises(ShuttingDown):
        await within(waiting)
    assert s.depth(2) == 0
    with pytest.raises(ShuttingDown):
        await adm.wait(ticket(0))


async def test_a_grant_not_acted_on_for_a_waiter_that_leaves_is_given_back_once() -> None:
    """Found in review: a core change made outside the shell (a quota pause) granted two
    waiters; one left before the grants were acted on. Its slot comes back once, and the
    other waiter still gets its grant."""
    tiers = (TierSpec("critical", 8, max_wait_s=120, reserve=2),
             TierSpec("normal", 1, max_wait_s=100))
    clock = FakeClock(start=0.0)
    adm, s = make({"p": 3, "q": 1}, tiers=tiers, clock=clock)
    await granted(adm, ticket(1))
    leaving, staying = ticket(1), ticket(1)
    gone = asyncio.create_task(adm.wait(leaving))
    kept = asyncio.create_task(adm.wait(staying))
    await spin()
    clock.advance(60.0)  # past half their wait: the reserve no longer holds them back
    s.pause("q", 70.0, clock.now())  # grants both, not yet acted on
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(gone)
    decision = await within(kept)
    assert isinstance(decision, Dispatch) and decision.ticket is staying
    assert s.inflight("p") == 2


async def test_draining_serves_what_still_fits_and_turns_the_rest_away() -> None:
    clock = SystemClock()
    adm, s = make(clock=clock)
    holder = await granted(adm, ticket(0))
    short = asyncio.create_task(adm.wait(ticket(2, est=0.1)))
    long = asyncio.create_task(adm.wait(ticket(2, est=5.0)))
    await spin()
    deadline = clock.now() + 0.6
    adm.drain(deadline)
    with pytest.raises(ShuttingDown):
        await within(long)  # at once: it could not finish by the deadline
    assert not short.done() and s.depth(2) == 1
    release(adm, holder)
    assert isinstance(await within(short), Dispatch)  # it fits: served
    # A call that arrives while draining is queued if it fits, and turned away by the
    # timer once it no longer can finish in time (0.3 s before the deadline), not before.
    late = asyncio.create_task(adm.wait(ticket(1, est=0.3)))
    await spin()
    assert not late.done() and s.depth(1) == 1
    with pytest.raises(ShuttingDown):
        await within(late)
    assert clock.now() >= deadline - 0.3 - 0.01  # a timer may fire a hair early
    assert s.depth(1) == 0
    with pytest.raises(ShuttingDown):
        await adm.wait(ticket(0, est=1.0))
    adm.close()


async def test_enter_decides_at_once_on_a_free_slot_and_holds_no_future() -> None:
    adm, _ = make()
    t = ticket(2)
    decision = adm.enter(t)
    assert isinstance(decision, Dispatch) and decision.ticket is t
    assert t.state is TicketState.DISPATCHED and not adm._waiting


async def test_enter_queues_when_busy_and_decided_waits_for_the_slot() -> None:
    adm, _ = make()
    first = ticket(2)
    assert isinstance(adm.enter(first), Dispatch)
    second = ticket(2)
    assert adm.enter(second) is None and second.state is TicketState.QUEUED
    waiter = asyncio.ensure_future(adm.decision(second))
    await spin()
    assert not waiter.done()
    release(adm, first)
    decision = await within(waiter)
    assert isinstance(decision, Dispatch) and decision.ticket is second
    assert not adm._waiting and not adm._cutoffs


async def test_enter_returns_a_refusal_made_at_once() -> None:
    adm, _ = make(max_queue=1)
    assert isinstance(adm.enter(ticket(2)), Dispatch)
    assert adm.enter(ticket(2)) is None  # queued: the bound is reached
    refused = adm.enter(ticket(3))
    assert isinstance(refused, Rejection) and refused.code == "queue_full"


async def test_enter_while_draining_refuses_a_call_that_cannot_finish_in_time() -> None:
    clock = FakeClock()
    adm, s = make(clock=clock)
    adm.drain(clock.now() + 5.0)
    with pytest.raises(ShuttingDown):
        adm.enter(ticket(2, est=10.0))
    assert s.snapshot(clock.now())["queued"] == 0
    busy = ticket(2, est=1.0)
    assert isinstance(adm.enter(busy), Dispatch)
    queued = ticket(2, est=1.0)
    assert adm.enter(queued) is None and queued in adm._cutoffs  # turned away at its cutoff
    waiter = asyncio.ensure_future(adm.decision(queued))
    await spin()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queued.state is TicketState.CANCELLED and not adm._cutoffs and not adm._waiting
