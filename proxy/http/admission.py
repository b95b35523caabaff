"""Admission: the async shell that makes callers wait in the scheduler for a slot.

Each waiter awaits its own future; the scheduler's decisions resolve exactly the chosen
futures, in dispatch order. One timer, armed at ``Scheduler.next_wakeup``, delivers
deadlines and lapsed reservations; nothing polls. A waiter cancelled while queued leaves
the queue; a waiter cancelled after its slot was granted gives the slot back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping

from ..core.clock import Clock
from ..core.errors import Evicted, Overloaded, QueueFull, QueueTimeout
from ..core.scheduler import Dispatch, Rejection, Scheduler, Ticket, TicketState

_ERRORS: dict[str, type[Overloaded]] = {
    "queue_full": QueueFull,
    "evicted": Evicted,
    "queue_timeout": QueueTimeout,
}
_MESSAGES = {
    "queue_full": "The proxy's queue is full; retry later.",
    "evicted": "A more urgent call took this call's place in the queue; retry later.",
    "queue_timeout": "The call waited longer than its tier allows; retry later.",
}


class Admission:
    def __init__(self, scheduler: Scheduler, clock: Clock) -> None:
        self.scheduler = scheduler
        self._clock = clock
        self._waiting: dict[Ticket, asyncio.Future[str]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False

    async def acquire(self, ticket: Ticket) -> str:
        """Wait for a slot; returns the provider. Raises QueueFull, Evicted, QueueTimeout
        (with ``retry_after``), or Overloaded once closed."""
        if self._closed:
            raise Overloaded("The proxy is shutting down.", retry_after=1.0)
        result = self.scheduler.submit(ticket, self._clock.now())
        self._settle(result.woken, result.rejections)
        if result.dispatch is not None:
            return result.dispatch.provider
        own = next((r for r in result.rejections if r.ticket is ticket), None)
        if own is not None:
            raise _error(own)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(ticket, future)
            raise

    def release(self, provider: str, service_s: float | None = None,
                ticket: Ticket | None = None) -> None:
        """Give a slot back (exactly once per successful ``acquire``); pass the ticket
        when at hand, see ``Scheduler.release``."""
        now = self._clock.now()
        self._settle(self.scheduler.release(provider, now, service_s, ticket), ())

    @contextlib.asynccontextmanager
    async def slot(self, ticket: Ticket) -> AsyncIterator[str]:
        """Hold a slot for the body of the ``async with``; it is released exactly once."""
        provider = await self.acquire(ticket)
        try:
            yield provider
        finally:
            self.release(provider, self._clock.now() - ticket.dispatched_at, ticket)

    def set_capacity(self, provider: str, limit: int) -> None:
        self._settle(self.scheduler.set_capacity(provider, limit, self._clock.now()), ())

    def set_available(self, provider: str, available: bool) -> None:
        self._settle(self.scheduler.set_available(provider, available, self._clock.now()), ())

    def set_policy(self, weights: Mapping[int, float] | None,
                   reserves: Mapping[int, int] | None) -> None:
        self._settle(self.scheduler.set_policy(weights, reserves, self._clock.now()), ())

    def close(self) -> None:
        """Stop the timer and turn every queued waiter away."""
        self._closed = True
        self._disarm()
        now = self._clock.now()
        waiting, self._waiting = self._waiting, {}
        for ticket, future in waiting.items():
            self.scheduler.cancel(ticket, now)
            if not future.done():
                future.set_exception(Overloaded("The proxy is shutting down.", retry_after=1.0))

    def _abandon(self, ticket: Ticket, future: asyncio.Future[str]) -> None:
        """The waiter was cancelled: leave the queue, or hand back a slot it never used."""
        self._waiting.pop(ticket, None)
        if ticket.state is TicketState.QUEUED:
            self.scheduler.cancel(ticket, self._clock.now())
            self._rearm()
        elif future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), None, ticket)

    def _settle(self, dispatches: Iterable[Dispatch], rejections: Iterable[Rejection]) -> None:
        """Resolve the waiters the scheduler decided on; a slot granted to a waiter that is
        already gone goes straight back."""
        for rejection in rejections:
            future = self._waiting.pop(rejection.ticket, None)
            if future is not None and not future.done():
                future.set_exception(_error(rejection))
        pending = deque(dispatches)
        while pending:
            dispatch = pending.popleft()
            future = self._waiting.pop(dispatch.ticket, None)
            if future is not None and not future.done():
                future.set_result(dispatch.provider)
            elif future is not None:
                pending += self.scheduler.release(dispatch.provider, self._clock.now(), None,
                                                  dispatch.ticket)
        self._rearm()

    def _rearm(self) -> None:
        now = self._clock.now()
        wakeup = self.scheduler.next_wakeup(now)
        if wakeup == self._timer_at or self._closed:
            return
        self._disarm()
        if wakeup is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(wakeup - now, 0.0), self._on_timer)
            self._timer_at = wakeup

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        dispatches, rejections = self.scheduler.advance(self._clock.now())
        self._settle(dispatches, rejections)


def _error(rejection: Rejection) -> Overloaded:
    return _ERRORS[rejection.code](_MESSAGES[rejection.code],
                                   retry_after=rejection.retry_after_s)
