"""A harness for the scheduler's scenario tests: plain ``now`` floats, the slots each
provider has handed out tracked, and every decision collected."""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from proxy.core.scheduling.scheduler import (
    Decisions,
    Scheduler,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)

FOUR = (TierSpec("critical", 8), TierSpec("high", 4), TierSpec("normal", 2), TierSpec("low", 1))


def ticket(tier: int, est: float = 1.0, candidates: tuple[str, ...] = ("p",),
           **fields: object) -> Ticket:
    return Ticket(tier=tier, candidates=candidates, est_service_s=est,
                  **fields)  # type: ignore[arg-type]


class Kit:
    def __init__(self, caps: Mapping[str, int] | None = None,
                 tiers: Sequence[TierSpec] = FOUR,
                 deployments: Mapping[str, str] | None = None, **settings: object) -> None:
        self.s = Scheduler(SchedulerSettings(tiers=tuple(tiers), **settings),  # type: ignore[arg-type]
                           caps if caps is not None else {"p": 1}, deployments)
        self.running: dict[str, list[Ticket]] = defaultdict(list)  # per provider, in order
        self.refused: dict[Ticket, str] = {}
        self.log: list[Decisions] = []

    def collect(self) -> Decisions:
        decisions = self.s.take()
        for rejection in decisions.rejections:
            self.refused[rejection.ticket] = rejection.code
        for dispatch in decisions.dispatches:
            self.running[dispatch.pool].append(dispatch.ticket)
        self.log.append(decisions)
        return decisions

    def submit(self, t: Ticket, now: float) -> Decisions:
        self.s.submit(t, now)
        return self.collect()

    def granted(self, t: Ticket) -> bool:
        return t.state is TicketState.DISPATCHED

    def occupy(self, now: float = 0.0, provider: str = "p", tier: int = 0) -> Ticket:
        """Take one slot of ``provider`` with a running call."""
        t = ticket(tier, 1.0, (provider,))
        self.submit(t, now)
        assert self.granted(t)
        return t

    def release(self, provider: str, now: float, service_s: float | None = None) -> list[Ticket]:
        """Release the oldest call running on ``provider``; the tickets that got a slot."""
        return self.finish(self.running[provider][0], now, service_s)

    def finish(self, t: Ticket, now: float, service_s: float | None = None) -> list[Ticket]:
        assert t.pool is not None
        self.running[t.pool].remove(t)
        self.s.release(t, now, service_s)
        return [d.ticket for d in self.collect().dispatches]

    def drain(self, now: float, provider: str = "p") -> list[Ticket]:
        """Release ``provider``'s calls over and over; the tickets in dispatch order."""
        out: list[Ticket] = []
        while self.running[provider]:
            out += [t for t in self.release(provider, now) if t.pool == provider]
        return out

    def advance(self, now: float) -> Decisions:
        self.s.advance(now)
        return self.collect()

    def overload(self, backlog: list[Ticket], every: float, until: float,
                 provider: str = "p") -> None:
        """``backlog`` queued at 0, then a 1 s call of the most urgent tier every ``every``
        seconds until ``until``; every call takes 1 s."""
        for t in backlog:
            self.submit(t, 0.0)
        running = [(1.0, t.order, t) for t in backlog if self.granted(t)]
        now, next_urgent = 0.0, 0.0
        while now < until:
            if now >= next_urgent:
                self.s.submit(ticket(0, 1.0, (provider,)), now)
                next_urgent += every
            for d in self.collect().dispatches:
                heapq.heappush(running, (now + 1.0, d.ticket.order, d.ticket))
            now = min(next_urgent, running[0][0] if running else math.inf)
            while running and running[0][0] <= now:
                done = heapq.heappop(running)[2]
                self.running[provider].remove(done)
                self.s.release(done, now, 1.0)

    def urgent_flow(self, start: float, end: float, provider: str = "p", est: float = 1.0,
                    every: float = 0.5) -> float:
        """Urgent calls that each finish at once; returns the time after the last one."""
        now = start
        while now < end:
            t = ticket(0, est, (provider,))
            self.submit(t, now)
            assert self.granted(t)
            self.finish(t, now)
            now += every
        return now
