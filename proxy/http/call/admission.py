"""Admission: the async shell that lets calls wait in the scheduler for a slot.

Each waiter awaits its own future. Whatever changes the pure core (a submit, a release, a
verdict that pauses a provider, the timer), ``act_on_decisions`` then resolves exactly the
futures the scheduler decided on, in order, and re-arms one timer at
``Scheduler.next_wakeup`` for what time alone will change (deadlines, pauses that end,
limits that grow back, holds that lapse); nothing polls. A waiter cancelled while queued
leaves the queue; one cancelled after its slot was granted gives the slot back.
"""

from __future__ import annotations

import asyncio

from ...core.clock import Clock
from ...core.errors import ShuttingDown
from ...core.scheduling.scheduler import Dispatch, Rejection, Scheduler, Ticket, TicketState


class Admission:
    def __init__(self, scheduler: Scheduler, clock: Clock) -> None:
        self.scheduler = scheduler
        self._clock = clock
        self._waiting: dict[Ticket, asyncio.Future[Dispatch | Rejection]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closed = False
        self._drain_until: float | None = None
        self._cutoffs: dict[Ticket, asyncio.TimerHandle] = {}

    async def wait(self, ticket: Ticket) -> Dispatch | Rejection:
        """Queue ``ticket`` and wait for the scheduler's decision about it: a slot
        (``Dispatch``) or a refusal (``Rejection``). Raises ShuttingDown once closed, or
        while draining once the call could no longer finish in time."""
        decision = self.enter(ticket)
        return decision if decision is not None else await self.decision(ticket)

    def enter(self, ticket: Ticket) -> Dispatch | Rejection | None:
        """Queue ``ticket``: the decision if the scheduler made it at once (a free slot, a
        refusal), else None, and ``decision`` waits for it. Raises as ``wait`` does.
        A call that finds a free slot thus costs no future and no coroutine."""
        if self._closed:
            raise ShuttingDown()
        now = self._clock.now()
        cutoff_s = None if self._drain_until is None else self._cutoff_s(ticket, now)
        if cutoff_s is not None and cutoff_s <= 0:
            raise ShuttingDown()
        self.scheduler.submit(ticket, now)
        decision = self._act_on_decisions(ticket)
        if decision is None:
            self._waiting[ticket] = asyncio.get_running_loop().create_future()
            if cutoff_s is not None:
                self._arm_cutoff(ticket, cutoff_s)
        return decision

    async def decision(self, ticket: Ticket) -> Dispatch | Rejection:
        """Wait for the decision about a ticket ``enter`` queued."""
        future = self._waiting[ticket]
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(ticket, future)
            raise
        finally:
            cutoff = self._cutoffs.pop(ticket, None)
            if cutoff is not None:
                cutoff.cancel()

    def drain(self, until: float) -> None:
        """Keep serving, but only calls expected to finish by ``until``: a queued call is
        turned away (ShuttingDown) once its expected service time no longer fits."""
        self._drain_until = until
        now = self._clock.now()
        for ticket in list(self._waiting):
            self._arm_cutoff(ticket, self._cutoff_s(ticket, now))

    def _cutoff_s(self, ticket: Ticket, now: float) -> float:
        assert self._drain_until is not None
        return self._drain_until - ticket.est_service_s - now

    def _arm_cutoff(self, ticket: Ticket, delay: float) -> None:
        if delay <= 0:
            self._turn_away(ticket)
        else:
            self._cutoffs[ticket] = asyncio.get_running_loop().call_later(
                delay, self._turn_away, ticket)

    def _turn_away(self, ticket: Ticket) -> None:
        self._cutoffs.pop(ticket, None)
        future = self._waiting.pop(ticket, None)
        if future is None or future.done():
            return
        if ticket.state is TicketState.QUEUED:
            self.scheduler.cancel(ticket, self._clock.now())
        future.set_exception(ShuttingDown())
        self.act_on_decisions()

    def act_on_decisions(self) -> None:
        """Act on what the scheduler decided since last asked; call after anything that
        changed the core."""
        self._act_on_decisions(None)

    def _act_on_decisions(self, entering: Ticket | None) -> Dispatch | Rejection | None:
        """``act_on_decisions``; what was decided about ``entering`` (which has no future yet)."""
        if self._timer_at is None and self.scheduler.quiet:
            return None
        mine: Dispatch | Rejection | None = None
        while decisions := self.scheduler.take():
            for rejection in decisions.rejections:
                if rejection.ticket is entering:
                    mine = rejection
                    continue
                future = self._waiting.pop(rejection.ticket, None)
                if future is not None and not future.done():
                    future.set_result(rejection)
            for dispatch in decisions.dispatches:
                if dispatch.ticket is entering:
                    mine = dispatch
                    continue
                future = self._waiting.pop(dispatch.ticket, None)
                if future is not None and not future.done():
                    future.set_result(dispatch)
                elif dispatch.ticket.state is TicketState.DISPATCHED:
                    # Granted to a waiter that is already gone (and did not give the slot
                    # back itself): straight back.
                    self.scheduler.give_back(dispatch.ticket, self._clock.now())
        self._rearm()
        return mine

    def close(self) -> None:
        """Stop the timer and turn every queued waiter away."""
        self._closed = True
        self._disarm()
        for cutoff in self._cutoffs.values():
            cutoff.cancel()
        self._cutoffs.clear()
        now = self._clock.now()
        waiting, self._waiting = self._waiting, {}
        for ticket, future in waiting.items():
            self.scheduler.cancel(ticket, now)
            if not future.done():
                future.set_exception(ShuttingDown())
        self.scheduler.take()

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Dispatch | Rejection]) -> None:
        """The waiter was cancelled: leave the queue, or hand back a slot it never used."""
        self._waiting.pop(ticket, None)
        if ticket.state is TicketState.QUEUED:
            self.scheduler.cancel(ticket, self._clock.now())
        elif ticket.state is TicketState.DISPATCHED:
            self.scheduler.give_back(ticket, self._clock.now())
        if not self._closed:
            self.act_on_decisions()

    def _rearm(self) -> None:
        if self._closed:
            return
        now = self._clock.now()
        wakeup = self.scheduler.next_wakeup(now)
        if wakeup == self._timer_at:
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
        self.scheduler.advance(self._clock.now())
        self.act_on_decisions()
