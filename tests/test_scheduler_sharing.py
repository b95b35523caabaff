"""Weighted sharing of slot-seconds across tiers, on a fake clock."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import pytest

from proxy.core.scheduler import Ticket, TierSpec
from tests.scheduler_kit import Kit, ticket


def simulate_share(weights: Sequence[float], ests: Sequence[float], slots: int,
                   horizon: float, took: Sequence[float] | None = None,
                   load: float = 1.5, lend_s: float = 0.0) -> list[float]:
    """Every tier offers ``load`` times the provider's capacity on its own (open loop, so
    none fits); calls claim ``ests`` and really take ``took`` (default: what they claim).
    Slot-seconds used per tier by the horizon. No lending by default: the pure shares."""
    took = ests if took is None else took
    tiers = [TierSpec(f"t{i}", w, max_wait_s=1e9) for i, w in enumerate(weights)]
    k = Kit({"p": slots}, tiers, headroom_scale=0.0, max_queue=10**7, lend_s=lend_s)
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
])
def test_weights_share_slot_seconds(weights: tuple[float, ...], ests: tuple[float, ...],
                                    slots: int) -> None:
    used = simulate_share(weights, ests, slots, horizon=4_000.0)
    total = sum(used)
    for w, u in zip(weights, used, strict=True):
        assert u / total == pytest.approx(w / sum(weights), rel=0.05)


def test_a_tier_whose_calls_lie_about_their_size_is_charged_what_they_took() -> None:
    """Tier 0 claims 1 s a call and takes 10: its share is still what its weight says,
    because every call is charged its real service time when its slot comes back."""
    used = simulate_share((1, 1), (1.0, 1.0), 1, horizon=4_000.0, took=(10.0, 1.0))
    assert used[0] / sum(used) == pytest.approx(0.5, rel=0.05)


def test_idle_tier_banks_no_credit() -> None:
    tiers = (TierSpec("a", 1, max_wait_s=1e9), TierSpec("b", 1, max_wait_s=1e9))
    k = Kit(tiers=tiers, headroom_scale=0.0, quantum_s=5.0)
    now = 0.0
    k.occupy(now, tier=1)
    for _ in range(1000):  # tier b alone for a long time
        k.submit(ticket(1, 1.0), now)
        now += 1.0
        assert [t.tier for t in k.release("p", now)] == [1]
    for _ in range(50):  # tier a now has a backlog too
        k.submit(ticket(0, 1.0), now)
    for _ in range(50):
        k.submit(ticket(1, 1.0), now)
    order = [t.tier for t in k.drain(now)]
    run_of_a = order.index(1)
    assert 1 <= run_of_a <= 6  # a gets a quantum's worth first, not the 1000 s b had alone
    assert order[:40].count(0) == pytest.approx(20, abs=4)


def test_urgent_tier_within_its_share_goes_first() -> None:
    """Urgent calls use 20 % of the slot (their share is 8/9): whenever the slot frees while
    one waits, it goes next, however much low work is queued."""
    k = Kit({"p": 1}, headroom_scale=0.0)
    now, next_urgent, busy_until = 0.0, 0.0, 0.0
    urgent_waiting: list[Ticket] = []
    picked_urgent = 0
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
            busy_until = now + dispatched[0].est_service_s
        now = min(next_urgent, busy_until)
    assert picked_urgent > 100


def lender(lend_s: float, normal_ran_s: float,
           rescue_fraction: float = 0.25) -> tuple[Kit, Ticket, Ticket]:
    """Normal ran ``normal_ran_s`` while low waited, so low is owed about that much (in
    slot-seconds per unit of weight); then one call of each waits 10 s for the slot."""
    tiers = (TierSpec("normal", 2, max_wait_s=100), TierSpec("low", 1, max_wait_s=900))
    k = Kit(tiers=tiers, headroom_scale=0.0, quantum_s=1.0, lend_s=lend_s,
            rescue_fraction=rescue_fraction, tier_promote_after_s=None)
    n1, l1 = ticket(0), ticket(1)
    k.submit(n1, 0.0)
    k.submit(l1, 0.0)
    assert k.finish(n1, 0.0, normal_ran_s) == [l1]
    normal, low = ticket(0), ticket(1)
    k.submit(normal, 0.0)
    k.submit(low, 0.0)
    return k, normal, low


def test_a_tier_behind_its_share_lends_its_turn_to_a_more_urgent_tier_that_needs_it_more() -> None:
    """Both calls waited 10 s: normal's used a tenth of its 100 s, low's a ninetieth of its
    900 s. Low is behind its share, yet normal goes first."""
    k, normal, _ = lender(lend_s=50.0, normal_ran_s=40.0)
    assert k.release("p", 10.0) == [normal]


def test_lending_stops_where_lend_s_says() -> None:
    k, _, low = lender(lend_s=50.0, normal_ran_s=200.0)  # owed (200 - 1) / 2 > 50
    assert k.release("p", 10.0) == [low]


@pytest.mark.parametrize(("rescue_fraction", "first"), [(0.25, "low"), (0.1, "normal")])
def test_a_tier_at_risk_lends_nothing(rescue_fraction: float, first: str) -> None:
    """At 760 the low call has 140 s of its 900 left, the normal one 10 of its 100: normal
    has used more of its wait, but low only lends while it is not at risk itself."""
    k, normal, low = lender(lend_s=50.0, normal_ran_s=40.0, rescue_fraction=rescue_fraction)
    k.s.cancel(normal, 0.0)
    pressed = ticket(0)
    k.submit(pressed, 670.0)
    assert k.release("p", 760.0) == [low if first == "low" else pressed]


@pytest.mark.parametrize(("rescue_fraction", "rescued"), [(0.25, True), (0.0, False)])
def test_within_a_tier_a_call_at_risk_goes_before_shorter_later_ones(
    rescue_fraction: float, rescued: bool
) -> None:
    """Overtaking inside a tier is bounded: once a call has less than rescue_fraction of
    its max_wait_s left, it goes before later, shorter calls of its tier."""
    tiers = (TierSpec("normal", 1, max_wait_s=100),)
    k = Kit(tiers=tiers, headroom_scale=0.0, rescue_fraction=rescue_fraction)
    k.occupy(0.0)
    long_call = ticket(0, 40.0)
    k.submit(long_call, 0.0)
    now = 0.0
    while now < 74.0:
        k.submit(ticket(0, 0.5), now)
        now += 1.0
        assert long_call not in k.release("p", now)
    k.submit(ticket(0, 0.5), now)
    assert (k.release("p", 76.0) == [long_call]) is rescued


def test_a_slot_given_back_unused_refunds_its_charge() -> None:
    """Found in review: a grant that never went upstream (its provider's rate limit was
    spent) must not count against its tier's share, however often it bounces."""
    k = Kit({"p": 1})
    t = ticket(0, 20.0)
    for _ in range(5):
        k.submit(t, 0.0)
        assert t.pool is not None
        k.running[t.pool].remove(t)
        k.s.give_back(t, 0.0)
    assert k.s._share.virtual[0] == 0.0


def test_a_share_corrected_on_one_provider_refills_another() -> None:
    """Found in review: a release on P that corrects a tier's share can let Q serve a call
    it was holding back for fair share; Q is filled at once, not at the next deadline."""
    tiers = (TierSpec("t0", 1, max_wait_s=100, reserve=1), TierSpec("t1", 1, max_wait_s=100),
             TierSpec("t2", 1, max_wait_s=100))
    k = Kit({"P": 1, "Q": 2}, tiers, quantum_s=1.0, lend_s=0.0, headroom_scale=0.0)
    on_p = ticket(1, 1.0, ("P",))
    k.submit(on_p, 0.0)
    for _ in range(3):
        k.submit(ticket(1, 60.0, ("Q",)), 0.0)
    waiting = ticket(2, 1.0, ("Q",))
    k.submit(waiting, 0.0)
    assert not k.granted(waiting)
    k.finish(on_p, 1.0, 200.0)  # tier 1 really ran 200 s: now far ahead of its share
    assert k.granted(waiting) and waiting.pool == "Q"
