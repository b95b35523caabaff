"""Shared helpers for the scheduler's scenario tests: plain ``now`` floats, one provider."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.core.scheduler import Scheduler, SchedulerSettings, Ticket, TierSpec

FOUR = (TierSpec("critical", 8), TierSpec("high", 4), TierSpec("normal", 2), TierSpec("low", 1))


def make(caps: dict[str, int] | None = None, tiers: Sequence[TierSpec] = FOUR,
         **settings: object) -> Scheduler:
    return Scheduler(SchedulerSettings(tiers=tuple(tiers), **settings),  # type: ignore[arg-type]
                     caps if caps is not None else {"p": 1})


def ticket(tier: int, est: float = 1.0, candidates: tuple[str, ...] = ("p",)) -> Ticket:
    return Ticket(tier=tier, candidates=candidates, est_service_s=est)


def occupy(s: Scheduler, now: float = 0.0, provider: str = "p", tier: int = 0) -> Ticket:
    """Take one slot of ``provider`` with a running call."""
    t = ticket(tier, 1.0, (provider,))
    assert s.submit(t, now).dispatch is not None
    return t


def drain(s: Scheduler, now: float, provider: str = "p") -> list[Ticket]:
    """Release ``provider``'s slot over and over; the tickets in dispatch order."""
    out: list[Ticket] = []
    while True:
        got = s.release(provider, now)
        if not got:
            return out
        out += [d.ticket for d in got]


def urgent_flow(s: Scheduler, start: float, end: float, provider: str = "p",
                est: float = 1.0, every: float = 0.5) -> float:
    """Urgent calls that each finish at once; returns the time after the last one."""
    now = start
    while now < end:
        t = ticket(0, est, (provider,))
        assert s.submit(t, now).dispatch is not None
        s.release(provider, now, 0.0, t)
        now += every
    return now
