"""Headroom: free slots held for more urgent arrivals, adaptive and fixed.

Most scenarios here give the holds an unlimited allowance (``headroom_budget=1``) to test
their sizing and lapses alone; the allowance has its own tests at the end."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.scheduling.headroom import ALLOWANCE_HORIZON_S, Headroom
from proxy.core.scheduling.scheduler import SchedulerSettings, Ticket, TicketState, TierSpec
from tests.scheduler_kit import FOUR, Kit, ticket

UNLIMITED = {"headroom_budget": 1.0}


def staffed(load: float, spread: float = 1.0) -> int:
    """Square-root staffing: the slots ``load`` busy slots of Poisson demand are given."""
    return math.ceil(load + spread * math.sqrt(load) - 0.05)


@pytest.mark.parametrize(("urgent", "low_dispatched"), [(False, 4), (True, 1)])
def test_adaptive_headroom_follows_urgent_demand(urgent: bool, low_dispatched: int) -> None:
    """Urgent calls claiming 1 s every 0.5 s for 20 s: two busy slots of demand. An EWMA
    (30 s) started 20 s ago sees one; bias-corrected, two, staffed with 2 + sqrt(2): 4
    slots, at most the floors of the tiers above low (12/15 of 4 slots): 3 held."""
    k = Kit({"p": 4}, **UNLIMITED)
    now = k.urgent_flow(0.0, 20.0) if urgent else 20.0
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        k.submit(t, now)
    assert sum(k.granted(t) for t in lows) == low_dispatched
    if urgent:
        load = k.s._headroom.offered("p", 0, now)
        assert load == pytest.approx(2.0, rel=0.03)
        assert staffed(load) == 4 and k.s.held_back("p", 3, now) == 3
        urgent_call = ticket(0, 1.0)
        k.submit(urgent_call, now)
        assert k.granted(urgent_call)


def test_a_hold_never_starves_a_less_urgent_tier_of_its_floor() -> None:
    """Urgent calls arrive faster than the provider serves them (their load does not fit),
    so its hold is at its maximum the whole time: the least urgent tier still gets its
    floor (1 of 15 of the slot-seconds: its weight of all the weights), never nothing."""
    tiers = [TierSpec("critical", 8, max_wait_s=10), *FOUR[1:3],
             TierSpec("low", 1, max_wait_s=1e9)]
    k = Kit({"p": 4}, tiers, **UNLIMITED)
    lows = [ticket(3, 1.0) for _ in range(60)]
    k.overload(lows, every=0.2, until=200.0)  # 5 busy slots of urgent demand on 4
    served = sum(t.state is not TicketState.QUEUED for t in lows)
    assert served >= 200 * 4 / 15 - 2  # its floor of 200 s on 4 slots, less two calls


def simulate_urgent_vs_batch(urgent_every: float, **settings: object) -> tuple[list[float],
                                                                             float]:
    """4 slots; a standing backlog of 20 s batch calls; a 0.5 s urgent call every
    ``urgent_every`` seconds. Urgent waits, and the share of slot time batch work got."""
    k = Kit({"p": 4}, FOUR, **settings)
    running: list[tuple[float, int, Ticket]] = []
    waits: list[float] = []
    batch_s = 0.0

    def started(tickets: Sequence[Ticket], now: float) -> None:
        nonlocal batch_s
        for t in tickets:
            heapq.heappush(running, (now + t.est_service_s, t.order, t))
            if t.tier == 0:
                waits.append(now - t.arrived)
            else:
                batch_s += t.est_service_s

    def dispatched() -> list[Ticket]:
        return [d.ticket for d in k.collect().dispatches]

    now, next_urgent, horizon = 0.0, 0.0, 2000.0
    while now < horizon:
        while k.s.depth(3) < 4:
            k.s.submit(ticket(3, 20.0), now)
            started(dispatched(), now)
        next_done = running[0][0] if running else math.inf
        wakeup = k.s.next_wakeup(now) or math.inf
        now = min(next_urgent, next_done, wakeup)
        if now == wakeup:
            k.s.advance(now)
            started(dispatched(), now)
        elif now == next_urgent:
            k.s.submit(ticket(0, 0.5), now)
            started(dispatched(), now)
            next_urgent += urgent_every
        else:
            t = heapq.heappop(running)[2]
            assert t.pool is not None
            k.running[t.pool].remove(t)
            k.s.release(t, now, t.est_service_s)
            started(dispatched(), now)
    return sorted(waits), batch_s / (4 * horizon)


def test_headroom_protects_short_urgent_calls_from_long_jobs_as_far_as_its_allowance_goes() -> None:
    """Urgent 0.5 s calls every 2 s beside 20 s batch calls on 4 slots: holding one slot
    for them costs most of a slot. Given an allowance of a quarter of the capacity the
    headroom cuts the urgent p99 wait to a small fraction of what it is with no headroom;
    with the default allowance it costs the batch tier no more than that allowance."""
    bare_waits, bare_share = simulate_urgent_vs_batch(2.0, headroom_spread=None)
    waits, batch_share = simulate_urgent_vs_batch(2.0, headroom_budget=0.25)
    _, default_share = simulate_urgent_vs_batch(2.0)
    p99 = waits[int(0.99 * len(waits))]
    bare_p99 = bare_waits[int(0.99 * len(bare_waits))]
    assert bare_p99 > 3.0
    assert p99 <= 0.15 * bare_p99
    assert batch_share >= bare_share - 0.25  # at most one slot of four
    assert default_share >= bare_share - SchedulerSettings(tiers=FOUR).headroom_budget - 0.005


def test_default_headroom_costs_nothing_without_urgent_work() -> None:
    _, batch_share = simulate_urgent_vs_batch(math.inf)
    assert batch_share > 0.99


def test_adaptive_headroom_lapses_without_urgent_arrivals() -> None:
    k = Kit({"p": 4}, headroom_horizon_s=30.0, **UNLIMITED)
    now = k.urgent_flow(0.0, 20.0)
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        k.submit(t, now)
    assert [t.state for t in lows].count(TicketState.QUEUED) == 3
    wakeup = k.s.next_wakeup(now)
    assert wakeup is not None
    assert now < wakeup <= 20.0 + 30.0
    assert not k.advance(wakeup - 0.01)
    assert len(k.advance(wakeup).dispatches) >= 1
    at: float | None = wakeup
    while at is not None and at < 1000:
        k.advance(at)
        at = k.s.next_wakeup(at)
    assert all(t.state is TicketState.DISPATCHED for t in lows)
    assert k.s.held_back("p", 3, 60.0) == 0


def quiet_after(last: float, every: float, horizon: float = 30.0) -> float:
    """When a flow that arrived every ``every`` s since 0 counts as quiet: six of its mean
    gaps, by an EWMA rate over ``horizon``, after its last arrival."""
    arrivals = [k * every for k in range(int(last / every) + 1)]
    rate = sum(math.exp(-(last - t) / horizon) for t in arrivals) / horizon
    return last + 6.0 / rate


@pytest.mark.parametrize(("flow_est", "wakeup"), [
    (10.0, quiet_after(19.5, 0.5)),    # heavy: held until the flow has gone quiet
    (None, 30.0),                      # one 2 s call: quiet (a horizon) before it decays
])
def test_headroom_lapse_wakes_exactly_when_due(flow_est: float | None, wakeup: float) -> None:
    k = Kit({"p": 4}, headroom_horizon_s=30.0, **UNLIMITED)
    if flow_est is None:
        last = k.urgent_flow(0.0, 0.1, est=2.0) - 0.5
    else:
        last = k.urgent_flow(0.0, 20.0, est=flow_est) - 0.5
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        k.submit(t, max(last, 0.0))
    blocked = [t for t in lows if t.state is TicketState.QUEUED]
    assert blocked
    assert k.s.next_wakeup(max(last, 0.0)) == pytest.approx(wakeup)
    assert not k.advance(wakeup - 1e-3)
    k.advance(wakeup + 1e-5)
    assert all(t.state is TicketState.DISPATCHED for t in blocked)


@pytest.mark.parametrize("start", [6.868013784925738, 0.1, 1e6 + 0.3])
def test_headroom_wakeups_make_progress_at_awkward_times(start: float) -> None:
    """Found by the state machine: a wake-up computed as stamp + horizon must see the
    reservation gone, or the shell's timer fires forever at the same instant. (The tier
    held back is background, so the urgent tier's floor is every slot: its hold covers
    both free ones.)"""
    tiers = (TierSpec("a", 1.0, max_wait_s=120), TierSpec("b", 0.0, max_wait_s=120))
    k = Kit({"a": 3}, tiers, headroom_horizon_s=10.0, **UNLIMITED,
            level_bounds_s=(1.0, 5.0, 60.0))  # a 45 s claim is charged in full
    first = ticket(0, 45.0, ("a",))
    k.submit(first, start)
    assert k.granted(first)
    waiting = ticket(1, 0.2, ("a",))
    k.submit(waiting, start)
    now = start
    for _ in range(3):
        wakeup = k.s.next_wakeup(now)
        assert wakeup is not None and wakeup > now
        now = wakeup
        k.advance(now)
        if waiting.state is TicketState.DISPATCHED:
            break
    assert waiting.state is TicketState.DISPATCHED
    assert now == pytest.approx(start + 10.0)


def test_middle_tier_is_held_back_only_for_more_urgent_demand_within_their_floors() -> None:
    """The urgent demand would be staffed with 4 slots; against ``high`` critical holds at
    most its own floor (8 of 15 of 4 slots: 2), against ``low`` the three tiers above it at
    most theirs (14 of 15: 3), so the floors of the tiers held back stay theirs."""
    k = Kit({"p": 4}, **UNLIMITED)
    now = k.urgent_flow(0.0, 20.0, every=0.2)
    assert staffed(k.s._headroom.offered("p", 0, now)) >= 4
    assert k.s.held_back("p", 0, now) == 0
    assert k.s.held_back("p", 1, now) == 2
    assert k.s.held_back("p", 3, now) == 3


@pytest.mark.parametrize("urgent_running", [0, 1, 2, 4])
def test_urgent_calls_running_count_towards_their_adaptive_headroom(urgent_running: int) -> None:
    k = Kit({"p": 16}, **UNLIMITED)
    now = k.urgent_flow(0.0, 20.0, est=1.0, every=0.2)
    load = k.s._headroom.offered("p", 0, now)
    assert 4.9 < load < 5.1  # 5 busy slots (an EWMA of 30 s, bias-corrected, after 20 s)
    assert k.s.held_back("p", 3, now) == staffed(load) == 8
    running = [k.occupy(now) for _ in range(urgent_running)]  # arrivals too: more load
    assert k.s.held_back("p", 3, now) == max(
        0, staffed(k.s._headroom.offered("p", 0, now)) - urgent_running)
    for t in running:
        k.finish(t, now, 1.0)
    assert k.s.held_back("p", 3, now) == staffed(k.s._headroom.offered("p", 0, now))


def test_a_call_that_took_less_than_estimated_gives_its_load_back() -> None:
    """The offered load learns what calls really cost: urgent calls that claimed 10 s and
    took 0.1 s hold (almost) nothing once they are done."""
    k = Kit({"p": 8}, **UNLIMITED)
    now = 0.0
    while now < 20.0:
        t = ticket(0, 10.0)
        k.submit(t, now)
        k.finish(t, now + 0.1, 0.1)
        now += 0.5
    assert k.s.held_back("p", 3, now) <= 1


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
    k = Kit({"p": capacity}, tiers)
    k.urgent_flow(0.0, 20.0, est=0.2)  # adaptive demand that fixed reserves override
    calls = [ticket(tier, 30.0) for _ in range(capacity)]
    for t in calls:
        k.submit(t, 20.0)
    assert sum(k.granted(t) for t in calls) == dispatched


def test_a_hold_lets_go_of_a_call_half_way_to_its_deadline_on_time() -> None:
    """Found in review: with a fixed reserve the only wake-up was the deadline, so a held
    call was refused with a slot free. The timer fires when the call has used half its
    wait, and the call gets the slot then."""
    tiers = (TierSpec("critical", 8, max_wait_s=120, reserve=1),
             TierSpec("normal", 1, max_wait_s=100))
    k = Kit({"p": 2}, tiers)
    first, held = ticket(1), ticket(1)
    k.submit(first, 0.0)
    k.submit(held, 0.0)
    assert k.granted(first) and not k.granted(held)
    assert k.s.next_wakeup(0.0) == pytest.approx(50.0)
    assert [d.ticket for d in k.advance(50.0).dispatches] == [held]


def test_holds_stop_when_they_have_idled_their_allowance() -> None:
    """Holds that keep 3 of 4 slots free cost 75 % of the provider: with the default allowance
    (1.5 % of its slot-time, an EWMA over 30 s) they keep low calls out for about 0.6 s,
    then let them in; with no allowance at all they hold until the urgent flow goes quiet."""
    settings = SchedulerSettings(tiers=FOUR)
    allowance = settings.headroom_budget * 4 * ALLOWANCE_HORIZON_S  # slot-seconds
    for unlimited in (False, True):
        k = Kit({"p": 4}, **(UNLIMITED if unlimited else {}))
        now = k.urgent_flow(0.0, 20.0, every=0.2)
        lows = [ticket(3, 30.0) for _ in range(4)]
        for t in lows:
            k.submit(t, now)
        assert sum(k.granted(t) for t in lows) == 1
        wakeup = k.s.next_wakeup(now)
        assert wakeup is not None
        expected = now + ALLOWANCE_HORIZON_S * math.log(3 * ALLOWANCE_HORIZON_S / (
            3 * ALLOWANCE_HORIZON_S - allowance))
        if unlimited:
            assert wakeup > 20.0
        else:
            assert wakeup == pytest.approx(expected, abs=1e-3)
            assert [d.ticket for d in k.advance(wakeup).dispatches] == lows[1:]


def test_a_fixed_reserve_holds_whatever_it_costs() -> None:
    tiers = [TierSpec(t.name, t.weight, reserve=r) for t, r in zip(FOUR, (2, None, None, None),
                                                                   strict=True)]
    k = Kit({"p": 4}, tiers)
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        k.submit(t, 0.0)
    assert sum(k.granted(t) for t in lows) == 2
    assert k.s.next_wakeup(0.0) == pytest.approx(60.0)  # only the calls' patience ends it


SHARES = (8 / 15, 4 / 15, 2 / 15, 1 / 15)


def test_a_peak_from_nothing_is_staffed_for_the_peak() -> None:
    """Chat at 15/s x 0.2 s (3 busy slots) from a quiet start: an EWMA of 30 s that started
    from nothing sees 0.7 slots of it after 8 s and 1.7 after 25 s; corrected for its age,
    twice that at most (1.4) after 8 s and the 3 there are after 25 s, staffed with
    3 + sqrt(3): 5 slots."""
    k = Kit({"p": 16}, **UNLIMITED)
    now = k.urgent_flow(0.0, 8.0, est=0.2, every=1 / 15)
    raw = 3.0 * (1 - math.exp(-now / 30.0))
    assert k.s._headroom.offered("p", 0, now) == pytest.approx(
        raw / (1 - math.exp(-20.0 / 30.0)), rel=0.03)
    now = k.urgent_flow(now, 25.0, est=0.2, every=1 / 15)
    load = k.s._headroom.offered("p", 0, now)
    assert load == pytest.approx(3.0, rel=0.03)
    assert k.s.held_back("p", 3, now) == staffed(load) == 5


def test_a_first_call_counts_once_and_a_first_few_at_most_as_often_as_they_came() -> None:
    """The correction is at most the number of calls seen: one call that claims 1,000 s
    (charged the longest level's bound, 30 s) is one such call in a horizon, not two."""
    h = Headroom(4, 1.0, 30.0, SHARES)
    h.record("p", 0, 30.0, 0.0)
    assert h.offered("p", 0, 0.0) == pytest.approx(30.0 / 30.0)
    h.record("p", 0, 30.0, 0.0)
    assert h.offered("p", 0, 0.0) == pytest.approx(2 * 2 * 30.0 / 30.0)  # 2 calls: 2x
    h.record("p", 0, 30.0, 0.0)
    warm = 1 / (1 - math.exp(-20.0 / 30.0))  # the youngest age counted: 20 s, 2.05x
    assert h.offered("p", 0, 0.0) == pytest.approx(3 * warm * 30.0 / 30.0)


def test_the_correction_starts_again_when_a_tier_comes_back_from_quiet() -> None:
    k = Kit({"p": 16}, **UNLIMITED)
    k.urgent_flow(0.0, 20.0, est=0.2, every=1 / 15)
    now = k.urgent_flow(100.0, 125.0, est=0.4, every=1 / 10)  # 4 busy slots, 25 s old
    assert k.s._headroom.offered("p", 0, now) == pytest.approx(4.0, rel=0.05)


@pytest.mark.parametrize(("spent", "held"), [(0.0, 8), (0.5, 8), (0.75, 4), (0.9, 2),
                                             (1.0, 0)])
def test_holds_shrink_as_they_spend_their_allowance(spent: float, held: int) -> None:
    """Five busy slots of urgent demand are staffed with 5 + sqrt(5): 8 slots, in full until
    half of the allowance is spent, then by what is left of it (twice that, at most 1): at
    three quarters, half of 7.24 rounds up to 4."""
    h = Headroom(4, 1.0, 30.0, SHARES, allowance=0.1)
    for i in range(300):
        h.record("p", 0, 0.5, i / 10)  # 10/s x 0.5 s for 30 s
    now = 30.0
    assert h.offered("p", 0, now) == pytest.approx(5.0, rel=0.03)
    h._idle["p"] = [spent * 0.1 * 16 * ALLOWANCE_HORIZON_S, now, 0.0]
    assert h.held_against("p", 3, now, [None] * 4, [0] * 4, 16) == held


@given(arrivals=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(0, 1),
                                   st.floats(0.05, 20.0)), min_size=1, max_size=30),
       spent=st.floats(0.0, 1.2), holding=st.integers(0, 3),
       capacity=st.integers(2, 12), running=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       tier=st.integers(1, 3), allowance=st.sampled_from([0.01, 0.05, 0.2]),
       gap=st.floats(0.0, 10.0))
def test_a_hold_never_lapses_before_the_wakeup_it_gives(
        arrivals: list[tuple[float, int, float]], spent: float, holding: int,
        capacity: int, running: tuple[int, int], tier: int, allowance: float,
        gap: float) -> None:
    """Whatever the demand and the idle time spent: until the earlier of lapse_time and
    allowance_end, the slots held against a tier stay above the target they were asked for
    (demand decays, the bias correction and what is left of the allowance with it; a wake-up
    past the moment would leave a slot idle that a waiting call could use)."""
    h = Headroom(4, 1.0, 30.0, SHARES, allowance=allowance)
    now = 0.0
    for dt, urgent, service in arrivals:
        now += dt
        h.record("p", urgent, service, now)
    # What holds idled so far (a fraction of the allowance), and how many slots they keep now.
    h._idle["p"] = [spent * allowance * capacity * ALLOWANCE_HORIZON_S, now, float(holding)]
    now += gap
    busy = [*running, 0, 0]
    fixed: list[int | None] = [None] * 4
    before = h.held_against("p", tier, now, fixed, busy, capacity)
    for target in range(before):
        lapse = h.lapse_time("p", tier, target, now, fixed, busy, capacity)
        assert lapse is not None
        spent = h.allowance_end("p", now, capacity)
        end = min(lapse, spent if spent is not None and spent > now else math.inf)
        for step in range(200):
            at = now + (end - now) * step / 200
            assert h.held_against("p", tier, at, fixed, busy, capacity) > target, (at, end)


def test_an_allowance_of_nothing_holds_nothing_from_the_first_call() -> None:
    """``headroom_budget: 0`` leaves no slot idle for adaptive holds, not even before any
    idle time has been counted; a fixed reserve still holds."""
    k = Kit({"p": 4}, headroom_budget=0.0)
    now = k.urgent_flow(0.0, 20.0, every=0.2)
    for _ in range(4):
        low = ticket(3, 30.0)
        k.submit(low, now)
        assert k.granted(low)
    tiers = [TierSpec(t.name, t.weight, reserve=r) for t, r in zip(FOUR, (1, None, None, None),
                                                                   strict=True)]
    k = Kit({"p": 4}, tiers, headroom_budget=0.0)
    lows = [ticket(3, 30.0) for _ in range(4)]
    for t in lows:
        k.submit(t, 0.0)
    assert sum(k.granted(t) for t in lows) == 3


def test_a_pass_keeps_no_slot_free_that_its_own_bookkeeping_then_releases() -> None:
    """Found in review: urgent calls claiming 5 s every second (8 of 16 slots staffed), low
    calls waiting for the rest, a pass every 0.25 s. A pass sized its holds by the allowance
    left at the pass before and then booked the idle time since: once over half the
    allowance was spent, the holds it left said one slot fewer than it kept free (7 free, 6
    held at t = 33.75 s), and no wake-up came for that slot for 3.9 s."""
    k = Kit({"p": 16}, headroom_budget=0.1)
    now = k.urgent_flow(0.0, 30.0, est=5.0, every=1.0)
    lows = [ticket(3, 30.0) for _ in range(16)]
    for t in lows:
        k.submit(t, now)
    for step in range(1, 20):
        at = now + 0.25 * step
        k.advance(at)
        if any(t.state is TicketState.QUEUED for t in lows):
            assert k.s._pools["p"].free(at) <= k.s.held_back("p", 3, at), at


def test_the_bias_correction_is_at_most_2x_at_any_horizon() -> None:
    """Found in review: the youngest age counted was 20 s whatever the horizon, so at a
    horizon of 300 s ten first calls counted ten times each (1 / (1 - e^(-20/300)) = 15x,
    capped by the calls seen)."""
    for horizon in (3.0, 30.0, 300.0):
        h = Headroom(4, 1.0, horizon, SHARES)
        for _ in range(10):
            h.record("p", 0, 30.0, 0.0)
        assert h.offered("p", 0, 0.0) == pytest.approx(
            10 * 30.0 / horizon / (1 - math.exp(-2 / 3)))


def test_a_pause_holds_nothing_but_keeps_the_demand_that_came_before_it() -> None:
    """Chat at 15/s (3 busy slots) for 25 s, then a gap of 1 s: quiet after six of its
    mean gaps (0.7 s by its rate's EWMA), so nothing is held during the pause; its next
    call finds the 3 busy slots of demand there were, not one call's worth (each such
    pause emptied the estimate mid-peak). After a horizon without a call the demand
    starts again from nothing."""
    k = Kit({"p": 16}, **UNLIMITED)
    now = k.urgent_flow(0.0, 25.0, est=0.2, every=1 / 15)
    last = now - 1 / 15
    assert k.s._headroom.offered("p", 0, last + 0.6) > 2.5
    assert k.s._headroom.offered("p", 0, last + 0.9) == 0.0  # quiet: holds nothing
    k.urgent_flow(last + 1.0, last + 1.01, est=0.2)
    assert k.s._headroom.offered("p", 0, last + 1.0) == pytest.approx(
        3.0 * math.exp(-1.0 / 30.0), rel=0.03)  # decayed over the pause
    k.urgent_flow(last + 40.0, last + 40.01, est=0.2)
    assert k.s._headroom.offered("p", 0, last + 40.0) == pytest.approx(0.2 / 30.0)

