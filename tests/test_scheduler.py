"""Scenario tables for the scheduler, driven by plain ``now`` floats."""

from __future__ import annotations

import math

import pytest

from proxy.core.scheduler import (
    Dispatch,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)
from tests.scheduler_kit import FOUR, drain, make, occupy, ticket

# --- tiers, levels ----------------------------------------------------------------------


@pytest.mark.parametrize("arrivals", [(3, 2, 1, 0), (0, 1, 2, 3), (2, 0, 3, 1), (3, 3, 0, 0)])
def test_saturated_slot_serves_tiers_in_urgency_order(arrivals: tuple[int, ...]) -> None:
    s = make()
    occupy(s)
    queued = [ticket(t) for t in arrivals]
    for i, t in enumerate(queued):
        assert s.submit(t, 0.1 * i).dispatch is None
    order = drain(s, 5.0)
    assert [t.tier for t in order] == sorted(arrivals)
    same_tier = [t for t in order if t.tier == arrivals[-1]]
    assert same_tier == [t for t in queued if t.tier == arrivals[-1]]  # FIFO within a tier


@pytest.mark.parametrize(("ests", "expected"), [
    ((20.0, 0.5), [1, 0]),            # short overtakes long in the same tier
    ((3.0, 40.0, 0.2), [2, 0, 1]),    # levels 1, 3, 0
    ((0.5, 0.7, 0.9), [0, 1, 2]),     # same level: FIFO
    ((10.0, 12.0, 2.0), [2, 0, 1]),
])
def test_skip_join_short_calls_start_at_higher_levels(ests: tuple[float, ...],
                                                      expected: list[int]) -> None:
    s = make()
    occupy(s)
    queued = [ticket(2, e) for e in ests]
    for i, t in enumerate(queued):
        s.submit(t, 0.1 * i)
    assert drain(s, 1.0) == [queued[i] for i in expected]


@pytest.mark.parametrize(("est", "level"), [(0.0, 0), (1.0, 0), (1.01, 1), (5.0, 1),
                                             (29.9, 2), (30.5, 3), (1e6, 3)])
def test_level_follows_the_estimate(est: float, level: int) -> None:
    s = make()
    occupy(s)
    t = ticket(1, est)
    s.submit(t, 0.0)
    assert t.level == level


# --- aging -------------------------------------------------------------------------------


@pytest.mark.parametrize(("at", "level"), [(0.0, 2), (19.9, 2), (20.0, 1), (24.9, 1),
                                           (25.0, 0), (500.0, 0)])
def test_level_aging_moves_up_one_level_at_a_time(at: float, level: int) -> None:
    s = make(promote_after_s=(math.inf, 5.0, 20.0, 60.0))
    occupy(s)
    long_call = ticket(1, 10.0)
    s.submit(long_call, 0.0)
    # aging is applied lazily when a slot is handed out; a capacity of zero forces a look
    s.set_capacity("p", 0, at)
    assert long_call.level == level


def test_aged_call_overtakes_later_short_calls() -> None:
    s = make(promote_after_s=(math.inf, 5.0, 20.0, 60.0))
    occupy(s)
    long_call = ticket(2, 10.0)
    s.submit(long_call, 0.0)
    shorts = [ticket(2, 0.5) for _ in range(3)]
    for i, t in enumerate(shorts):
        s.submit(t, 30.0 + i)
    assert drain(s, 40.0)[0] is long_call


@pytest.mark.parametrize(("at", "tier"), [(0.0, 3), (59.0, 3), (60.0, 2), (119.0, 2),
                                          (200.0, 2), (899.0, 2)])
def test_tier_promotion_moves_at_most_one_tier(at: float, tier: int) -> None:
    s = make(tier_promote_after_s=60.0)
    occupy(s)
    low = ticket(3, 1.0)
    s.submit(low, 0.0)
    s.set_capacity("p", 0, at)
    assert low.current_tier == tier
    assert low.tier == 3
    assert s.depth(tier) == 1


def test_tier_promotion_skips_tiers_whose_deadline_comes_first() -> None:
    s = make(tier_promote_after_s=60.0)  # high's max_wait is 120 by default, critical 120
    tiers = (TierSpec("a", 1, max_wait_s=10), TierSpec("b", 1, max_wait_s=30))
    s = make(tiers=tiers, tier_promote_after_s=60.0)
    occupy(s)
    b = ticket(1)
    s.submit(b, 0.0)
    s.set_capacity("p", 0, 29.0)
    assert b.current_tier == 1
    assert [r.code for r in s.expire(30.0)] == ["queue_timeout"]


def test_promoted_call_goes_before_its_old_tier() -> None:
    s = make(tier_promote_after_s=60.0)
    occupy(s)
    old_low, young_low = ticket(3), ticket(3)
    s.submit(old_low, 0.0)
    s.submit(young_low, 10.0)
    normal = ticket(2)
    s.submit(normal, 59.0)
    # old_low joins the tail of tier normal at 60; young_low is still low at 61
    assert drain(s, 61.0) == [normal, old_low, young_low]


def test_promotion_past_a_reserve_is_a_wakeup() -> None:
    tiers = (TierSpec("a"), TierSpec("b", reserve=1), TierSpec("c"))
    s = make({"p": 2}, tiers, tier_promote_after_s=60.0)
    occupy(s, tier=2)
    c = ticket(2)
    s.submit(c, 0.0)
    assert c.state is TicketState.QUEUED  # b holds the last free slot against c
    assert s.next_wakeup(0.0) == 60.0
    assert s.advance(60.0) == ([Dispatch(c, "p")], [])
    assert c.current_tier == 1


# --- deadlines ---------------------------------------------------------------------------


def test_deadlines_per_tier() -> None:
    tiers = (TierSpec("a", max_wait_s=10), TierSpec("b", max_wait_s=30))
    s = make(tiers=tiers)
    occupy(s)
    a, b = ticket(0), ticket(1)
    s.submit(b, 0.0)
    s.submit(a, 5.0)
    assert s.next_deadline() == 15.0
    steps: list[tuple[float, list[Ticket]]] = [(14.9, []), (15.0, [a]), (29.0, []),
                                               (30.0, [b]), (100.0, [])]
    for now, expected in steps:
        rejections = s.expire(now)
        assert [r.ticket for r in rejections] == expected
        assert all(r.code == "queue_timeout" and 1 <= r.retry_after_s <= 120
                   for r in rejections)
    assert s.next_deadline() is None
    assert drain(s, 100.0) == []


# --- bounded queue -----------------------------------------------------------------------


@pytest.mark.parametrize(("max_queue", "tier_max", "arrivals", "outcome"), [
    # outcome per arrival: "q" queued, "full" refused, "evict:i" evicted arrival i
    (2, None, (3, 3, 3), ["q", "q", "full"]),
    (2, None, (3, 3, 0), ["q", "q", "evict:1"]),          # most recently queued goes
    (2, None, (2, 3, 1), ["q", "q", "evict:1"]),          # least urgent goes
    (2, None, (1, 1, 1), ["q", "q", "full"]),
    (2, None, (0, 1, 2), ["q", "q", "full"]),             # no less urgent call to evict
    (3, 1, (3, 3, 0), ["q", "full", "q"]),                # the tier's own bound
    (3, 1, (0, 0, 3), ["q", "full", "q"]),
])
def test_queue_bounds_and_eviction(max_queue: int, tier_max: int | None,
                                   arrivals: tuple[int, ...], outcome: list[str]) -> None:
    tiers = [TierSpec(t.name, t.weight, max_queue=tier_max) for t in FOUR]
    s = make(tiers=tiers, max_queue=max_queue)
    occupy(s)
    tickets = [ticket(t) for t in arrivals]
    for i, (t, expected) in enumerate(zip(tickets, outcome, strict=True)):
        result = s.submit(t, float(i))
        assert result.dispatch is None
        if expected == "q":
            assert result.rejections == ()
        elif expected == "full":
            assert [(r.ticket, r.code) for r in result.rejections] == [(t, "queue_full")]
        else:
            victim = tickets[int(expected.split(":")[1])]
            assert [(r.ticket, r.code) for r in result.rejections] == [(victim, "evicted")]
            assert victim.state is TicketState.REJECTED
    assert sum(s.depth(i) for i in range(4)) <= max_queue


@pytest.mark.parametrize(("queued_s", "capacity", "retry_after"), [
    (0.0, 1, 1.0), (30.0, 1, 30.0), (30.0, 3, 10.0), (1e6, 1, 120.0),
])
def test_retry_after_is_the_drain_time(queued_s: float, capacity: int,
                                       retry_after: float) -> None:
    s = make({"p": capacity}, max_queue=1)
    for _ in range(capacity):
        occupy(s)
    s.submit(ticket(0, queued_s), 0.0)
    result = s.submit(ticket(0, 1.0), 0.0)
    assert [r.retry_after_s for r in result.rejections] == [pytest.approx(retry_after)]


# --- candidates, cancel, capacity, availability, policy ---------------------------------------


def test_freed_slot_goes_to_the_best_call_that_can_use_it() -> None:
    s = make({"a": 1, "b": 1})
    occupy(s, provider="a")
    occupy(s, provider="b")
    only_a = ticket(0, 1.0, ("a",))
    either = ticket(1, 1.0, ("a", "b"))
    only_b = ticket(2, 1.0, ("b",))
    for t in (only_a, either, only_b):
        s.submit(t, 0.0)
    assert [(d.ticket, d.provider) for d in s.release("b", 1.0)] == [(either, "b")]
    assert [(d.ticket, d.provider) for d in s.release("b", 2.0)] == [(only_b, "b")]
    assert [(d.ticket, d.provider) for d in s.release("a", 3.0)] == [(only_a, "a")]


@pytest.mark.parametrize(("busy", "candidates", "provider"), [
    ((), ("a", "b"), "a"), ((), ("b", "a"), "b"), (("a",), ("a", "b"), "b"),
])
def test_submit_takes_the_first_free_candidate(busy: tuple[str, ...],
                                               candidates: tuple[str, ...],
                                               provider: str) -> None:
    s = make({"a": 1, "b": 1})
    for name in busy:
        occupy(s, provider=name)
    result = s.submit(ticket(0, 1.0, candidates), 0.0)
    assert result.dispatch is not None and result.dispatch.provider == provider


def test_cancelled_call_is_never_dispatched() -> None:
    s = make()
    occupy(s)
    a, b = ticket(0), ticket(1)
    s.submit(a, 0.0)
    s.submit(b, 0.0)
    s.cancel(a, 1.0)
    s.cancel(a, 1.0)
    assert s.depth(0) == 0
    assert drain(s, 2.0) == [b]
    assert a.state is TicketState.CANCELLED
    s.cancel(b, 3.0)  # dispatched already: nothing happens
    assert b.state is TicketState.DISPATCHED


def test_many_cancellations_keep_memory_bounded() -> None:
    s = make(max_queue=100_000)
    occupy(s)
    keep = ticket(3)
    s.submit(keep, 0.0)
    for _ in range(20_000):
        t = ticket(1, 3.0)
        s.submit(t, 0.0)
        s.cancel(t, 0.0)
    assert s._queues._entries < 5000
    assert drain(s, 1.0) == [keep]


def test_set_capacity_raises_and_lowers_the_limit() -> None:
    s = make({"p": 2})
    running = [occupy(s, tier=3), occupy(s, tier=3)]
    waiting = [ticket(1) for _ in range(3)]
    for t in waiting:
        s.submit(t, 0.0)
    assert [d.ticket for d in s.set_capacity("p", 3, 1.0)] == waiting[:1]
    assert s.set_capacity("p", 1, 2.0) == []
    assert s.inflight("p") == 3 and s.capacity("p") == 1
    assert s.release("p", 3.0) == [] and s.release("p", 3.0) == []
    assert [d.ticket for d in s.release("p", 4.0)] == waiting[1:2]
    assert len(running) == 2


def test_unavailable_provider_gets_nothing() -> None:
    s = make({"a": 1, "b": 1})
    s.set_available("a", False, 0.0)
    t = ticket(0, 1.0, ("a", "b"))
    assert s.submit(t, 0.0).dispatch == Dispatch(t, "b")
    u = ticket(0, 1.0, ("a",))
    assert s.submit(u, 0.0).dispatch is None
    assert s.release("b", 1.0) == []
    assert s.set_available("a", True, 2.0) == [Dispatch(u, "a")]


def test_set_policy_overrides_and_restores() -> None:
    s = make({"p": 4})
    s.set_policy(None, {0: 3}, 0.0)
    assert s.held_back("p", 3, 0.0) == 3
    s.set_policy({3: 50.0}, None, 1.0)
    assert s.held_back("p", 3, 1.0) == 0
    assert s.snapshot(1.0)["tiers"][3]["weight"] == 50.0  # type: ignore[index]
    s.set_policy(None, None, 2.0)
    assert s.snapshot(2.0)["tiers"][3]["weight"] == 1.0  # type: ignore[index]


@pytest.mark.parametrize(("weights", "reserves"), [({0: 0.0}, None), (None, {1: -1})])
def test_invalid_policy_is_refused_and_changes_nothing(weights: dict[int, float] | None,
                                                        reserves: dict[int, int] | None) -> None:
    s = make({"p": 4})
    before = s.snapshot(0.0)
    with pytest.raises(ValueError):
        s.set_policy(weights, reserves, 0.0)
    assert s.snapshot(0.0) == before


def test_set_policy_dispatches_what_a_dropped_reserve_frees() -> None:
    tiers = [TierSpec(t.name, t.weight, reserve=r) for t, r in zip(FOUR, (2, 0, 0, 0),
                                                                   strict=True)]
    s = make({"p": 3}, tiers)
    lows = [ticket(3) for _ in range(3)]
    for t in lows:
        s.submit(t, 0.0)
    assert s.inflight("p") == 1
    assert [d.ticket for d in s.set_policy(None, {0: 0}, 1.0)] == lows[1:]


def test_snapshot_is_json_shaped() -> None:
    import json

    s = make({"p": 1})
    occupy(s)
    s.submit(ticket(2, 7.0), 0.0)
    snap = s.snapshot(3.0)
    json.dumps(snap)
    assert snap["queued"] == 1
    tier = snap["tiers"][2]  # type: ignore[index]
    assert tier["depth"] == 1 and tier["by_level"] == [0, 0, 1, 0]
    assert tier["oldest_wait_s"] == 3.0
    assert snap["providers"]["p"]["inflight"] == 1  # type: ignore[index]


@pytest.mark.parametrize("bad", [
    {"tiers": ()},
    {"tiers": (TierSpec("a"), TierSpec("a"))},
    {"tiers": (TierSpec("a", weight=0),)},
    {"tiers": FOUR, "level_bounds_s": (5.0, 1.0)},
    {"tiers": FOUR, "promote_after_s": (1.0, 2.0)},
    {"tiers": FOUR, "max_queue": 0},
])
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SchedulerSettings(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [ticket(9), ticket(0, 1.0, ()), ticket(0, 1.0, ("nope",)),
                                 ticket(0, math.nan), ticket(0, -1.0)])
def test_invalid_tickets_are_refused(bad: Ticket) -> None:
    with pytest.raises(ValueError):
        make().submit(bad, 0.0)


def test_a_ticket_is_submitted_once_and_released_slots_must_exist() -> None:
    s = make()
    t = occupy(s)
    with pytest.raises(ValueError):
        s.submit(t, 0.0)
    s.release("p", 1.0)
    with pytest.raises(ValueError):
        s.release("p", 1.0)


def test_wait_is_recorded_on_the_ticket() -> None:
    s = make()
    occupy(s)
    t = ticket(1)
    s.submit(t, 2.0)
    s.release("p", 4.5)
    assert (t.arrived, t.dispatched_at, t.wait_s, t.provider) == (2.0, 4.5, 2.5, "p")
