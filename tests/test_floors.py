"""Floors: each tier's share of slot-seconds while it waits, on a fake clock; and within a
tier, the order of calls at risk."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import pytest

from proxy.core.scheduling.floors import Floors
from proxy.core.scheduling.scheduler import Ticket, TicketState, TierSpec
from tests.scheduler_kit import Kit, ticket


def simulate_share(weights: Sequence[float], ests: Sequence[float], slots: int,
                   horizon: float, took: Sequence[float] | None = None,
                   load: float = 1.5) -> list[float]:
    """Every tier offers ``load`` times the provider's capacity on its own (open loop, so
    none fits); calls claim ``ests`` and really take ``took`` (default: what they claim).
    Slot-seconds used per tier by the horizon."""
    took = ests if took is None else took
    tiers = [TierSpec(f"t{i}", w, max_wait_s=1e9) for i, w in enumerate(weights)]
    k = Kit({"p": slots}, tiers, headroom_spread=None, max_queue=10**7)
    used = [0.0] * len(weights)
    events: list[tuple[float, int, int, Ticket | None]] = []  # (time, order, tier, running)
    for tier in range(len(ests)):
        heapq.heappush(events, (0.0, -1, tier, None))
    gap = [took[t] / (load * slots) for t in range(len(ests))]

    def start(now: float) -> None:
        for d in k.collect().dispatches:
            t = d.ticket
            heapq.heappush(events, (now + took[t.tier], t.order, t.tier, t))
            used[t.tier] += took[t.tier]

    while events:
        now, _, tier, done = heapq.heappop(events)
        if now > horizon:
            break
        if done is None:
            k.s.submit(ticket(tier, ests[tier]), now)
            heapq.heappush(events, (now + gap[tier], -1, tier, None))
        else:
            k.running["p"].remove(done)
            k.s.release(done, now, took[tier])
        start(now)
    return used


@pytest.mark.parametrize(("weights", "ests", "slots"), [
    ((1, 1), (1.0, 1.0), 1),
    ((2, 1), (1.0, 1.0), 1),
    ((2, 1), (0.5, 4.0), 2),          # a weight is a share of slot time, not of calls
    ((1, 3), (3.0, 0.3), 1),          # the less urgent tier may have the larger share
    ((8, 4, 2, 1), (0.5, 2.0, 8.0, 20.0), 4),
    # Calls longer than the claim cap (4x the provider's mean): each was charged the cap
    # when it started, so its tier was owed again before its slot came back and took 1.4x
    # (19.7 s), 2.4x (40 s), 1.6x (10 slots) or 1.3x (4:2:1:1) its floor.
    ((8, 4, 2, 1), (0.5, 2.0, 8.0, 19.7), 4),
    ((8, 4, 2, 1), (0.5, 2.0, 8.0, 40.0), 4),
    ((8, 4, 2, 1), (0.5, 2.0, 8.0, 20.0), 10),
    ((4, 2, 1, 1), (0.5, 2.0, 8.0, 20.0), 4),
])
def test_when_every_tier_waits_each_is_served_its_floor(
        weights: tuple[float, ...], ests: tuple[float, ...], slots: int) -> None:
    """The floors of the tiers that wait add up to the whole provider: each tier below the
    most urgent is served its floor and no more, and the most urgent one the rest, which
    is its own floor."""
    used = simulate_share(weights, ests, slots, horizon=4_000.0)
    total = sum(used)
    for w, u in zip(weights, used, strict=True):
        assert u / total == pytest.approx(w / sum(weights), rel=0.05)


def test_a_tier_whose_calls_lie_about_their_size_is_charged_what_they_took() -> None:
    """Tier 1 claims 1 s a call and takes 10: its floor is still what its weight says,
    because every call is charged its real service time when its slot comes back."""
    used = simulate_share((1, 1), (1.0, 1.0), 1, horizon=4_000.0, took=(1.0, 10.0))
    assert used[1] / sum(used) == pytest.approx(0.5, rel=0.05)


def test_a_tier_of_weight_zero_is_served_only_what_the_others_leave() -> None:
    """Background: however long it has waited, it gets a slot only while no other tier
    waits for one, even one less urgent by its place in the list."""
    tiers = (TierSpec("idle", 0.0, max_wait_s=1e9), TierSpec("low", 1.0, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers, headroom_spread=None)
    k.occupy(0.0, tier=1)
    background = [ticket(0) for _ in range(3)]
    lows = [ticket(1) for _ in range(3)]
    for t in [*background, *lows]:
        k.submit(t, 0.0)
    assert k.drain(1000.0) == [*lows, *background]


def test_urgency_decides_what_the_floors_leave() -> None:
    """An urgent tier offering 20 % of the slot, well within its floor: whenever the slot
    frees while one of its calls waits, that call goes next, however much low work is
    queued; low is served the rest, far more than its floor."""
    k = Kit({"p": 1}, headroom_spread=None)
    now, next_urgent, busy_until = 0.0, 0.0, 0.0
    urgent_waiting: list[Ticket] = []
    picked_urgent = low_served = 0
    while now < 2000.0:
        while k.s.depth(3) < 3:
            low = ticket(3, 5.0)
            k.submit(low, now)
            busy_until = now + 5.0 if k.granted(low) else busy_until
        if now >= next_urgent:
            urgent = ticket(0, 0.2)
            k.submit(urgent, now)
            if k.granted(urgent):
                busy_until = now + 0.2
            else:
                urgent_waiting.append(urgent)
            next_urgent += 1.0
        if now >= busy_until:
            dispatched = k.release("p", now)
            assert len(dispatched) == 1
            if urgent_waiting:
                assert dispatched[0] is urgent_waiting.pop(0)
                picked_urgent += 1
            else:
                low_served += 1
            busy_until = now + dispatched[0].est_service_s
        now = min(next_urgent, busy_until)
    assert picked_urgent > 100
    assert low_served * 5.0 > 0.5 * 2000.0


def test_a_backlogged_tier_keeps_its_floor_against_an_urgent_overload() -> None:
    """Critical offers twice the capacity for 300 s; the low tier's calls (1 of 15 of the
    weights) are served one in every 15 slot-seconds, within two calls of that, from the
    first seconds on: its floor does not wait for the overload to end, and urgency decides
    the rest."""
    k = Kit({"p": 4}, headroom_spread=None, max_queue=10**6)
    lows = [ticket(3, 1.0) for _ in range(200)]
    k.overload(lows, every=0.125, until=300.0)  # 8 busy slots of urgent demand on 4
    served = sorted(t.dispatched_at for t in lows if t.state is not t.state.QUEUED)
    delivered = 4 * 300.0
    assert delivered / 15 - 2 <= len(served) <= delivered / 15 + 6  # the first 4 at once
    later = served[4:]
    assert later[0] <= 15 * 2 / 4  # within two calls' worth of its floor


def test_a_tier_owed_its_floor_goes_before_a_more_urgent_one() -> None:
    tiers = (TierSpec("critical", 1, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers, headroom_spread=None)
    k.occupy(0.0)
    low = ticket(1, 1.0)
    k.submit(low, 0.0)
    urgent = [ticket(0, 1.0) for _ in range(4)]
    for t in urgent:
        k.submit(t, 0.0)
    # critical's call ran 1 s while low waited: low is owed half of it, not yet one call
    assert k.release("p", 1.0, 1.0) == [urgent[0]]
    assert k.release("p", 2.0, 1.0) == [urgent[1]]
    # two calls on: half of two seconds is one (longest) call: low goes now
    assert k.release("p", 3.0, 1.0) == [low]


def test_while_a_more_urgent_tier_waits_floors_are_paid_at_its_pace() -> None:
    """Low (weight 1, short calls) is owed several of its calls while critical (weight 1)
    calls wait: while they wait, low is granted no more slot-seconds ahead of them than
    they are granted (their shares are equal), so the debt is paid between critical calls,
    not as a run of low calls ahead of all of them (heavy-tail's draw 3 paid high eight in
    a row while a critical call waited 3 s)."""
    tiers = (TierSpec("critical", 1, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers, headroom_spread=None)
    k.submit(first := ticket(1, 0.5), 0.0)
    lows = [ticket(1, 0.5) for _ in range(30)]
    for t in lows:
        k.submit(t, 0.0)
    k.finish(first, 0.5, 0.5)  # low's unit: one 0.5 s call
    k.submit(long := ticket(0, 8.0), 0.5)
    now = 0.5
    for t in lows:
        if k.granted(t):  # low took the slot freed at 0.5: let it end
            now += 0.5
            k.finish(t, now, 0.5)
    urgent = [ticket(0, 1.0) for _ in range(8)]
    for t in urgent:
        k.submit(t, now)
    granted = {"critical": 0.0, "low": 0.0}
    order = []
    while not all(k.granted(t) or t.state is TicketState.RELEASED for t in urgent):
        running = k.running["p"][0]
        took = running.est_service_s
        now += took
        for t in k.finish(running, now, took):
            tier = "low" if t.tier else "critical"
            if tier == "low":  # ahead of waiting critical calls: within their pace
                assert granted["low"] <= granted["critical"] + 1e-9, order
            granted[tier] += t.est_service_s
            order.append(tier)
    assert long.state is TicketState.RELEASED
    assert "low" in order  # low was owed: it was paid while critical waited
    assert order.count("low") >= 2


def credit(floors: Floors) -> float:
    """Tier 1's credit on provider p."""
    credits = floors.credits("p")
    assert credits is not None
    return credits[1]


def test_idle_tier_banks_no_credit() -> None:
    """A tier that waited nothing while others were served is owed nothing when it starts
    waiting: it gets its floor from then on, not what it would have had before."""
    floors = Floors([1.0, 1.0])
    for _ in range(100):
        floors.serve("p", 0, 1.0, [5, 0], cap=2.0)
    assert credit(floors) == 0.0
    floors.serve("p", 0, 1.0, [5, 1], cap=2.0)
    assert credit(floors) == pytest.approx(0.5)


def test_credit_is_capped_and_never_negative() -> None:
    floors = Floors([1.0, 1.0])
    for _ in range(100):
        floors.serve("p", 0, 1.0, [5, 1], cap=2.0)
    assert credit(floors) == pytest.approx(2.0)
    floors.serve("p", 1, 30.0, [5, 1], cap=2.0)
    assert credit(floors) == 0.0  # served far above its floor: banks nothing


@pytest.mark.parametrize(("rescue_fraction", "rescued"), [(0.25, True), (0.0, False)])
def test_within_a_tier_a_call_at_risk_goes_before_later_ones_that_overtook_it(
    rescue_fraction: float, rescued: bool
) -> None:
    """Overtaking inside a tier is bounded: a heavy key's call that its key's own backlog
    put behind another key's calls goes first once it has less than rescue_fraction of its
    max_wait_s left."""
    tiers = (TierSpec("normal", 1, max_wait_s=100),)
    k = Kit(tiers=tiers, headroom_spread=None, rescue_fraction=rescue_fraction)
    backlog = ticket(0, 40.0, key="heavy")  # moves the heavy key's virtual start on 40 s
    k.submit(backlog, 0.0)
    k.finish(backlog, 0.0, 40.0)
    k.occupy(0.0)
    late = ticket(0, 0.5, key="heavy")
    k.submit(late, 0.0)
    now = 0.0
    while now < 74.0:
        k.submit(ticket(0, 0.5, key="light"), now)
        now += 1.0
        assert late not in k.release("p", now)
    k.submit(ticket(0, 0.5, key="light"), now)
    assert (k.release("p", 76.0) == [late]) is rescued


def test_a_slot_given_back_unused_refunds_its_charge() -> None:
    """Found in review: a grant that never went upstream (its provider's rate limit was
    spent) must not count against its tier's floor, however often it bounces."""
    tiers = (TierSpec("a", 1, max_wait_s=1e9), TierSpec("b", 1, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers)
    waiting = ticket(1)
    t = ticket(0, 20.0)
    k.submit(t, 0.0)
    k.submit(waiting, 0.0)
    for _ in range(5):
        assert t.pool is not None
        k.running[t.pool].remove(t)
        k.s.give_back(t, 0.0)
        if k.granted(waiting):
            break
        k.submit(t, 0.0)
    assert k.s.snapshot(0.0)["providers"]["p"]["floor_credit_s"][1] == 0.0  # type: ignore[index]


def test_one_very_long_call_long_ago_does_not_raise_another_tiers_floor_unit() -> None:
    """Found in review: the longest call was only halved when its own tier served again, so
    one 1,800 s call kept every tier without calls of its own owed only after 1,800 slot-s.
    It is halved every half-life whoever reads it."""
    k = Kit({"p": 2}, headroom_spread=None)
    batch = ticket(3, 1800.0)
    k.submit(batch, 0.0)
    k.finish(batch, 1800.0, 1800.0)
    pool = k.s._pools["p"]
    later = 1800.0 + 3600.0
    assert k.s._policy.unit(pool, 2, later) < 1800.0 * 0.5 ** 11


def test_a_held_slot_goes_to_the_owed_tier_when_its_call_has_used_half_its_wait() -> None:
    """Found in review: the wake-up was computed for the most urgent waiting tier only, so a
    slot held from an owed tier's call stayed idle past the moment the call may take it
    (half its max_wait_s), until it timed out."""
    tiers = (TierSpec("hi", 8, max_wait_s=10, reserve=2), TierSpec("mid", 1, max_wait_s=3600),
             TierSpec("low", 4, max_wait_s=60))
    k = Kit({"p": 4}, tiers, headroom_spread=None)
    for _ in range(22):
        k.submit(ticket(1, 10.0), 0.0)
    low = ticket(2, 10.0)
    k.submit(low, 1.0)
    for now in (2.0, 3.0, 4.0, 5.0):
        k.release("p", now, 10.0)
    assert low.state is TicketState.QUEUED and k.s.held_back("p", 2, 5.0) == 2
    assert k.s.next_wakeup(5.0) == pytest.approx(31.0)
    k.advance(31.0)
    assert low.state is TicketState.DISPATCHED


def replay(k: Kit, calls: Sequence[tuple[float, Ticket, float]], until: float) -> list[
        tuple[float, Ticket, str]]:
    """Submit ``calls`` (arrival, ticket, real service seconds) to ``k``; each granted call
    ends after its service, and the scheduler's wake-ups are honoured. The grants in order
    (when, ticket, provider)."""
    took = {t: s for _, t, s in calls}
    events = [(at, 0, n, "submit", t) for n, (at, t, _) in enumerate(calls)]
    heapq.heapify(events)
    n = len(events)
    grants: list[tuple[float, Ticket, str]] = []
    while events and events[0][0] <= until:
        now, _, _, kind, t = heapq.heappop(events)
        if kind == "submit":
            k.s.submit(t, now)
        elif kind == "end":
            k.s.release(t, now, took[t])
        else:
            k.s.advance(now)
        for dispatch in k.s.take().dispatches:
            grants.append((now, dispatch.ticket, dispatch.pool))
            n += 1
            heapq.heappush(events, (now + took[dispatch.ticket], -1, n, "end", dispatch.ticket))
        wake = k.s.next_wakeup(now)
        if wake is not None and wake > now:
            n += 1
            heapq.heappush(events, (wake, 1, n, "wake", None))
    return grants


def test_a_floor_ahead_of_its_pace_still_takes_a_slot_the_headroom_keeps_from_urgent() -> None:
    """Found in review: while pacing held an owed tier back, only the urgent tier was
    offered the slot, so the owed tier's own way past a hold (its call has used half its
    max_wait_s) was never tried. Here p's free slot is held for critical (reserve 1), high
    waits for p or q and q always serves it before its patience: low, owed on p, got 1 of
    its 30 calls and 29 timed out while p's slot stayed free."""
    tiers = (TierSpec("critical", 1, max_wait_s=100, reserve=1),
             TierSpec("high", 1, max_wait_s=100), TierSpec("low", 1, max_wait_s=200))
    k = Kit({"p": 2, "q": 1}, tiers, headroom_spread=None)
    calls = [(0.0, ticket(1, 1.0, ("p",)), 1e6)]  # holds p's other slot throughout
    lows = [ticket(2, 0.5, ("p",)) for _ in range(30)]
    calls += [(0.01, t, 0.5) for t in lows]
    calls += [(1.0 + 5 * i, ticket(0, 5.0, ("p",)), 5.0) for i in range(6)]  # low earns credit
    calls += [(40.0, ticket(1, 1.0, ("q", "p")), 1.0) for _ in range(3)]
    calls += [(40.0 + i, ticket(1, 1.0, ("q", "p")), 1.0) for i in range(1, 400)]
    grants = replay(k, calls, 420.0)
    low_grants = [at for at, t, _ in grants if t in lows]
    assert len(low_grants) >= 25, low_grants
    assert low_grants[0] <= 100.1  # as soon as its oldest call has used half its wait


def test_an_urgent_tier_that_claims_nothing_still_lets_the_floors_be_paid() -> None:
    """Pacing counted what calls claimed when granted: an urgent tier claiming 0 s (which
    a call may) never added to its side, so once a floor had gone ahead once, it waited
    until urgent had no call left. What calls take, learnt when their slots come back,
    counts too."""
    tiers = (TierSpec("critical", 1, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers, headroom_spread=None)
    urgent = [(0.0, ticket(0, 0.0), 1.0) for _ in range(40)]
    lows = [ticket(1, 0.5) for _ in range(40)]
    grants = replay(k, urgent + [(0.0, t, 0.5) for t in lows], 30.0)
    low_grants = [at for at, t, _ in grants if t in lows]
    assert len(low_grants) >= 20, low_grants  # about its half of 30 s: 29 calls of 0.5 s
    assert max(at for at, t, _ in grants if t not in lows) > 25.0  # critical waited throughout


@pytest.mark.parametrize("leaves", ["cancelled", "granted elsewhere", "promoted"])
def test_a_pace_ends_with_its_urgent_tiers_last_waiting_call_however_it_leaves(
        leaves: str) -> None:
    """Found in review: a pace ended only when the urgent tier's last waiting call was
    granted on the pace's provider, so one whose calls were cancelled, served by another
    provider or moved up a tier lived on, and its next calls inherited what the floors had
    been granted."""
    tiers = (TierSpec("top", 1, max_wait_s=1e9), TierSpec("critical", 1, max_wait_s=1e9),
             TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 1, "q": 1}, tiers, headroom_spread=None, tier_promote_after_s=10.0)
    k.occupy(0.0, "p", tier=2)
    k.occupy(0.0, "q", tier=2)
    waiting = [ticket(1, 1.0, ("p", "q"), ceiling=0) for _ in range(2)]
    for t in waiting:
        k.submit(t, 0.0)
    k.submit(ticket(2, 1.0, ("p",), ceiling=2), 0.0)
    k.release("p", 1.0, 1.0)  # critical is granted on p: a pace begins there
    assert "p" in k.s._policy._paced
    if leaves == "cancelled":
        k.s.cancel(waiting[1], 1.5)
    elif leaves == "granted elsewhere":
        k.release("q", 1.5, 1.0)
    else:
        k.advance(11.0)
        assert waiting[1].current_tier == 0
    assert k.granted(waiting[0])
    assert waiting[1].state is not TicketState.QUEUED or waiting[1].current_tier == 0
    assert "p" not in k.s._policy._paced


def test_a_slot_given_back_unused_leaves_the_pace_as_it_was() -> None:
    """Found in review: a grant given back (its provider's rate limit was spent) still
    counted in the pace, so a floor call re-queued that way counted twice."""
    tiers = (TierSpec("critical", 1, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 1}, tiers, headroom_spread=None)
    k.submit(first := ticket(1, 0.5), 0.0)
    lows = [ticket(1, 0.5) for _ in range(4)]
    for t in [*lows, *(ticket(0, 1.0) for _ in range(6))]:
        k.submit(t, 0.0)
    k.finish(first, 0.5, 0.5)
    now = 0.5
    while not any(k.granted(t) for t in lows):  # critical runs until low is owed
        running = k.running["p"][0]
        now += 1.0
        k.finish(running, now, 1.0)
    pace = k.s._policy._paced["p"]
    before = pace[1] - 0.5  # what the floors had been granted before this low call
    low = next(t for t in lows if k.granted(t))
    k.running["p"].remove(low)
    k.s.give_back(low, now)
    again = [d.ticket for d in k.collect().dispatches if d.ticket.tier == 1]  # owed still
    assert pace[1] == pytest.approx(before + sum(t.est_service_s for t in again))


def test_a_call_that_claims_far_too_much_does_not_hold_its_tiers_floor_back() -> None:
    """Found in review: what a running call claimed beyond its capped charge counted whole
    against its tier's credit, so one call claiming 100,000 s cancelled the floor of every
    key of its tier while it ran. It counts at most one of the tier's longest calls."""
    tiers = (TierSpec("critical", 1, max_wait_s=1e9), TierSpec("low", 1, max_wait_s=1e9))
    k = Kit({"p": 2}, tiers, headroom_spread=None)
    for i in range(20):  # the provider's mean: 1 s
        k.submit(t := ticket(0, 1.0), float(i))
        k.finish(t, i + 1.0, 1.0)
    k.submit(big := ticket(1, 1e5), 30.0)  # runs throughout, claiming 100,000 s
    k.submit(ticket(0, 1.0), 30.0)
    lows = [ticket(1, 1.0) for _ in range(5)]
    for t in [*lows, *(ticket(0, 1.0) for _ in range(30))]:
        k.submit(t, 30.0)
    served = 0
    for now in range(31, 51):
        other = next(t for t in k.running["p"] if t is not big)
        served += sum(t in lows for t in k.finish(other, float(now), 1.0))
    assert served == 5
