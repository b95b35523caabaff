"""Headroom: free slots held for more urgent tiers, adaptive and fixed."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import pytest

from proxy.core.scheduler import Dispatch, Ticket, TicketState, TierSpec
from tests.scheduler_kit import FOUR, make, occupy, ticket, urgent_flow


@pytest.mark.parametrize(("urgent", "low_dispatched"), [(False, 4), (True, 2)])
def test_adaptive_headroom_follows_urgent_demand(urgent: bool, low_dispatched: int) -> None:
    s = make({"p": 4}, headroom_scale=1.5)
    now = urgent_flow(s, 0.0, 20.0) if urgent else 20.0
    lows = [ticket(3, 30.0) for _ in range(4)]
    got = [s.submit(t, now).dispatch is not None for t in lows]
    assert sum(got) == low_dispatched
    if urgent:
        assert s.held_back("p", 3, now) == 2
        assert s.submit(ticket(0, 1.0), now).dispatch is not None


def simulate_urgent_vs_batch(urgent_every: float, **settings: object) -> tuple[list[float],
                                                                             float]:
    """4 slots; a standing backlog of 20 s batch calls; a 0.5 s urgent call every
    ``urgent_every`` seconds. Urgent waits, and the share of slot time batch work got."""
    s = make({"p": 4}, FOUR, **settings)
    running: list[tuple[float, int, Ticket]] = []
    waits: list[float] = []
    batch_s = 0.0

    def started(dispatches: Sequence[Dispatch], now: float) -> None:
        nonlocal batch_s
        for d in dispatches:
            t = d.ticket
            heapq.heappush(running, (now + t.est_service_s, t.order, t))
            if t.tier == 0:
                waits.append(now - t.arrived)
            else:
                batch_s += t.est_service_s

    now, next_urgent, horizon = 0.0, 0.0, 2000.0
    while now < horizon:
        while s.depth(3) < 4:
            result = s.submit(ticket(3, 20.0), now)
            started([result.dispatch] if result.dispatch else [], now)
        next_done = running[0][0] if running else math.inf
        wakeup = s.next_wakeup(now) or math.inf
        now = min(next_urgent, next_done, wakeup)
        if now == wakeup:
            started(s.advance(now)[0], now)
        elif now == next_urgent:
            result = s.submit(ticket(0, 0.5), now)
            started([result.dispatch] if result.dispatch else [], now)
            next_urgent += urgent_every
        else:
            t = heapq.heappop(running)[2]
            started(s.release("p", now, t.est_service_s, t), now)
    return sorted(waits), batch_s / (4 * horizon)


def test_default_headroom_protects_short_urgent_calls_from_long_jobs() -> None:
    """The issue's overload: urgent calls short and frequent, the rest long. Defaults cut
    the urgent p99 wait to a small fraction of what it is with no headroom, at a small
    cost to the batch tier's share of slot time."""
    waits, batch_share = simulate_urgent_vs_batch(2.0)
    bare_waits, bare_share = simulate_urgent_vs_batch(2.0, headroom_scale=0.0)
    p99 = waits[int(0.99 * len(waits))]
    bare_p99 = bare_waits[int(0.99 * len(bare_waits))]
    assert bare_p99 > 3.0
    assert p99 <= 0.15 * bare_p99
    assert batch_share >= bare_share - 0.25  # at most one slot of four


def test_default_headroom_costs_nothing_without_urgent_work() -> None:
    _, batch_share = simulate_urgent_vs_batch(math.inf)
    assert batch_share > 0.99


def test_adaptive_headroom_lapses_without_urgent_arrivals() -> None:
    s = make({"p": 4}, headroom_horizon_s=30.0, headroom_scale=1.5)
    now = urgent_flow(s, 0.0, 20.0)
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        s.submit(t, now)
    assert [t.state for t in lows].count(TicketState.QUEUED) == 2
    wakeup = s.next_wakeup(now)
    assert wakeup is not None
    assert now < wakeup <= 20.0 + 30.0
    assert s.advance(wakeup - 0.01) == ([], [])
    dispatches, _ = s.advance(wakeup)
    assert len(dispatches) >= 1
    at: float | None = wakeup
    while at is not None and at < 1000:
        s.advance(at)
        at = s.next_wakeup(at)
    assert all(t.state is TicketState.DISPATCHED for t in lows)
    assert s.held_back("p", 3, 60.0) == 0


def quiet_after(last: float, every: float, horizon: float = 30.0) -> float:
    """When a flow that arrived every ``every`` s since 0 counts as quiet: four of its mean
    gaps, by an EWMA rate over ``horizon``, after its last arrival."""
    arrivals = [k * every for k in range(int(last / every) + 1)]
    rate = sum(math.exp(-(last - t) / horizon) for t in arrivals) / horizon
    return last + 4.0 / rate


@pytest.mark.parametrize(("flow_est", "wakeup"), [
    (10.0, quiet_after(19.5, 0.5)),    # heavy: held until the flow has gone quiet
    (None, 30.0 * math.log(2.0)),      # one 2 s call: its EWMA decays below a slot first
])
def test_headroom_lapse_wakes_exactly_when_due(flow_est: float | None, wakeup: float) -> None:
    s = make({"p": 4}, headroom_horizon_s=30.0, headroom_scale=1.5)
    if flow_est is None:
        last = urgent_flow(s, 0.0, 0.1, est=2.0) - 0.5
    else:
        last = urgent_flow(s, 0.0, 20.0, est=flow_est) - 0.5
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        s.submit(t, max(last, 0.0))
    blocked = [t for t in lows if t.state is TicketState.QUEUED]
    assert blocked
    assert s.next_wakeup(max(last, 0.0)) == pytest.approx(wakeup)
    assert s.advance(wakeup - 1e-3) == ([], [])
    s.advance(wakeup + 1e-5)
    assert all(t.state is TicketState.DISPATCHED for t in blocked)


@pytest.mark.parametrize("start", [6.868013784925738, 0.1, 1e6 + 0.3])
def test_headroom_wakeups_make_progress_at_awkward_times(start: float) -> None:
    """Found by the state machine: a wake-up computed as stamp + horizon must see the
    reservation gone, or the shell's timer fires forever at the same instant."""
    s = make({"a": 3}, headroom_horizon_s=10.0, headroom_scale=1.5)
    assert s.submit(ticket(0, 45.0, ("a",)), start).dispatch is not None
    waiting = ticket(1, 0.2, ("a",))
    s.submit(waiting, start)
    now = start
    for _ in range(3):
        wakeup = s.next_wakeup(now)
        assert wakeup is not None and wakeup > now
        now = wakeup
        s.advance(now)
        if waiting.state is TicketState.DISPATCHED:
            break
    assert waiting.state is TicketState.DISPATCHED
    assert now == pytest.approx(start + 10.0)


def test_middle_tier_is_held_back_only_for_more_urgent_demand() -> None:
    s = make({"p": 4}, headroom_scale=1.5)
    now = urgent_flow(s, 0.0, 20.0)
    assert s.held_back("p", 0, now) == 0
    assert s.held_back("p", 1, now) == 2
    assert s.held_back("p", 3, now) == 2


@pytest.mark.parametrize(("urgent_running", "held"), [(0, 3), (1, 2), (3, 0)])
def test_urgent_calls_running_count_towards_their_adaptive_headroom(urgent_running: int,
                                                                   held: int) -> None:
    s = make({"p": 8}, headroom_scale=1.5)
    now = urgent_flow(s, 0.0, 20.0, est=1.0, every=0.33)  # about 3 busy slots x 1.5 -> 3
    assert s.held_back("p", 3, now) == 3
    running = [occupy(s, now) for _ in range(urgent_running)]
    assert s.held_back("p", 3, now) == held
    for t in running:
        s.release("p", now, 1.0, t)
    assert s.held_back("p", 3, now) == 3


@pytest.mark.parametrize(("reserves", "capacity", "tier", "dispatched"), [
    ((2, None, None, None), 4, 1, 2),
    ((2, None, None, None), 4, 3, 2),
    ((0, 1, None, None), 4, 1, 4),        # a tier's reserve only binds tiers below it
    ((0, 1, None, None), 4, 2, 3),
    ((1, 3, None, None), 4, 3, 1),        # the largest reserve above the tier counts
    ((9, None, None, None), 4, 3, 1),     # never every slot: one stays usable
    ((1, None, None, None), 1, 3, 1),     # a single slot is never reserved
    ((0, 0, 0, 0), 4, 3, 4),              # fixed zero turns adaptive headroom off
])
def test_fixed_reserve(reserves: tuple[int | None, ...], capacity: int, tier: int,
                       dispatched: int) -> None:
    tiers = [TierSpec(spec.name, spec.weight, reserve=r) for spec, r in zip(FOUR, reserves,
                                                                            strict=True)]
    s = make({"p": capacity}, tiers)
    urgent_flow(s, 0.0, 20.0, est=0.2)  # adaptive demand that fixed reserves override
    calls = [ticket(tier, 30.0) for _ in range(capacity)]
    got = [s.submit(t, 20.0).dispatch is not None for t in calls]
    assert sum(got) == dispatched
