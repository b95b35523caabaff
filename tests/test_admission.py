"""The async shell: waiters, wake-ups, cancellation, the one deadline timer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import pytest

from proxy.core.clock import FakeClock, SystemClock
from proxy.core.errors import Evicted, Overloaded, QueueFull, QueueTimeout
from proxy.core.scheduler import (
    Dispatch,
    Rejection,
    Scheduler,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)
from proxy.http.admission import Admission

T = TypeVar("T")
FOUR = (TierSpec("critical", 8), TierSpec("high", 4), TierSpec("normal", 2), TierSpec("low", 1))


class CountingScheduler(Scheduler):
    """Counts the calls the shell makes, to prove there is no polling."""

    advances = 0
    releases = 0

    def advance(self, now: float) -> tuple[list[Dispatch], list[Rejection]]:
        self.advances += 1
        return super().advance(now)

    def release(self, provider: str, now: float, service_s: float | None = None,
                ticket: Ticket | None = None) -> list[Dispatch]:
        self.releases += 1
        return super().release(provider, now, service_s, ticket)


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


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_wake_in_dispatch_order() -> None:
    adm, s = make()
    assert await adm.acquire(ticket(0)) == "p"
    order: list[int] = []

    async def call(tier: int) -> None:
        async with adm.slot(ticket(tier)):
            order.append(tier)

    tasks = [asyncio.create_task(call(t)) for t in (3, 1, 2, 0, 3)]
    await settle()
    assert order == [] and sum(s.depth(i) for i in range(4)) == 5
    adm.release("p")
    await within(asyncio.gather(*tasks))
    assert order == [0, 1, 2, 3, 3]
    assert s.inflight("p") == 0
    adm.close()


async def test_cancelled_while_queued_leaves_no_ghost() -> None:
    adm, s = make()
    await adm.acquire(ticket(0))
    gone = ticket(1)
    task = asyncio.create_task(adm.acquire(gone))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task)
    assert gone.state is TicketState.CANCELLED and s.depth(1) == 0
    adm.release("p")
    assert s.inflight("p") == 0
    adm.close()


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_cancel_racing_with_dispatch_gives_the_slot_back(cancel_first: bool) -> None:
    adm, s = make()
    await adm.acquire(ticket(0))
    racer, patient = ticket(1), ticket(2)
    racing = asyncio.create_task(adm.acquire(racer))
    waiting = asyncio.create_task(adm.acquire(patient))
    await settle()
    if cancel_first:  # the waiter is cancelled, then its slot is granted before it runs
        racing.cancel()
        adm.release("p")
    else:  # the slot is granted, then the waiter is cancelled before it sees it
        adm.release("p")
        racing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(racing)
    assert racer.state is TicketState.DISPATCHED
    assert await within(waiting) == "p"  # the slot went on to the next waiter
    assert s.inflight("p") == 1
    adm.release("p")
    assert s.inflight("p") == 0
    adm.close()


async def test_deadline_timer_fires_without_polling() -> None:
    tiers = (TierSpec("a", max_wait_s=0.05), TierSpec("b", max_wait_s=0.2))
    adm, s = make(tiers=tiers, clock=SystemClock())
    await adm.acquire(ticket(0))
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(
        adm.acquire(ticket(0)), adm.acquire(ticket(1)), return_exceptions=True), 2.0)
    elapsed = time.monotonic() - started
    assert all(isinstance(r, QueueTimeout) for r in results)
    assert all(isinstance(r, QueueTimeout) and r.retry_after for r in results)
    assert 0.2 <= elapsed < 1.0
    assert s.advances <= 4  # one per deadline (a timer may fire a hair early once each)
    adm.close()


async def test_lapsed_reservation_wakes_a_waiter() -> None:
    adm, s = make({"p": 2}, clock=SystemClock(), headroom_horizon_s=0.1)
    await adm.acquire(ticket(0, 30.0))  # heavy urgent demand holds the other slot back
    low = ticket(3)
    started = time.monotonic()
    assert await asyncio.wait_for(adm.acquire(low), 2.0) == "p"
    assert time.monotonic() - started >= 0.09
    assert s.advances <= 3
    adm.close()


async def test_slot_releases_exactly_once() -> None:
    adm, s = make()
    with pytest.raises(RuntimeError):
        async with adm.slot(ticket(1)):
            raise RuntimeError("upstream blew up")
    assert s.inflight("p") == 0 and s.releases == 1
    blocker = await adm.acquire(ticket(0))

    async def body() -> None:
        async with adm.slot(ticket(1)):
            await asyncio.sleep(10)

    task = asyncio.create_task(body())
    await settle()
    adm.release(blocker)
    await settle()
    assert s.inflight("p") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task)
    assert s.inflight("p") == 0 and s.releases == 3  # the blocker's, then the body's
    adm.close()


async def test_queue_full_and_eviction_raise_errors_with_retry_after() -> None:
    adm, _ = make(max_queue=1)
    await adm.acquire(ticket(0))
    low = asyncio.create_task(adm.acquire(ticket(3)))
    await settle()
    with pytest.raises(QueueFull) as full:
        await within(adm.acquire(ticket(3)))
    assert full.value.retry_after is not None and full.value.retry_after >= 1
    high = asyncio.create_task(adm.acquire(ticket(1)))
    with pytest.raises(Evicted):
        await within(low)
    adm.release("p")
    assert await within(high) == "p"
    adm.close()


async def test_pass_throughs_wake_waiters() -> None:
    adm, s = make({"p": 1, "q": 0})
    await adm.acquire(ticket(0))
    on_q = asyncio.create_task(adm.acquire(ticket(1, 1.0, ("q",))))
    on_p = asyncio.create_task(adm.acquire(ticket(1)))
    await settle()
    adm.set_available("q", False)
    adm.set_capacity("q", 1)
    await settle()
    assert not on_q.done()
    adm.set_available("q", True)
    assert await within(on_q) == "q"
    adm.set_capacity("p", 2)
    assert await within(on_p) == "p"
    adm.set_policy({0: 2.0}, {0: 1})
    assert s.snapshot(0.0)["providers"]["p"]["held_back"][3] == 1  # type: ignore[index]
    adm.close()


async def test_close_turns_waiters_away() -> None:
    adm, s = make()
    await adm.acquire(ticket(0))
    waiting = asyncio.create_task(adm.acquire(ticket(2)))
    await settle()
    adm.close()
    with pytest.raises(Overloaded):
        await within(waiting)
    assert s.depth(2) == 0
    with pytest.raises(Overloaded):
        await adm.acquire(ticket(0))
