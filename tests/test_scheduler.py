"""Scenario tables for the scheduler, driven by plain ``now`` floats."""

from __future__ import annotations

import json
import math

import pytest

from proxy.core.scheduling.scheduler import SchedulerSettings, Ticket, TicketState, TierSpec
from tests.scheduler_kit import FOUR, Kit, ticket

PATIENT = tuple(TierSpec(t.name, t.weight, max_wait_s=1000) for t in FOUR)
# So patient that levels age by promote_after_s alone (not by a fraction of max_wait_s).
VERY_PATIENT = tuple(TierSpec(t.name, t.weight, max_wait_s=10_000) for t in FOUR)

# --- tiers, levels ----------------------------------------------------------------------


@pytest.mark.parametrize("arrivals", [(3, 2, 1, 0), (0, 1, 2, 3), (2, 0, 3, 1), (3, 3, 0, 0)])
def test_saturated_slot_serves_tiers_in_urgency_order(arrivals: tuple[int, ...]) -> None:
    k = Kit()
    k.occupy()
    queued = [ticket(t) for t in arrivals]
    for i, t in enumerate(queued):
        k.submit(t, 0.1 * i)
        assert not k.granted(t)
    order = k.drain(5.0)
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
    k = Kit()
    k.occupy()
    queued = [ticket(2, e) for e in ests]
    for i, t in enumerate(queued):
        k.submit(t, 0.1 * i)
    assert k.drain(1.0) == [queued[i] for i in expected]


@pytest.mark.parametrize(("est", "level"), [(0.0, 0), (1.0, 0), (1.01, 1), (5.0, 1),
                                             (29.9, 2), (30.5, 3), (1e6, 3)])
def test_level_follows_the_size(est: float, level: int) -> None:
    k = Kit()
    k.occupy()
    t = ticket(1, est)
    k.submit(t, 0.0)
    assert t.level == level


def test_the_level_comes_from_the_stable_size_not_the_learned_estimate() -> None:
    """Identical calls join the same level however the estimate drifts, so a later one
    never overtakes an earlier one just because the estimator learned in between."""
    k = Kit()
    k.occupy()
    early = ticket(2, 0.5, size_s=3.0)  # prior-based estimate: short
    late = ticket(2, 8.0, size_s=3.0)  # the estimator has learned the provider is slow
    k.submit(early, 0.0)
    k.submit(late, 1.0)
    assert early.level == late.level == 1
    assert k.drain(2.0) == [early, late]


# --- aging -------------------------------------------------------------------------------


LEVEL_EST = (0.5, 3.0, 10.0, 40.0)  # a call of each level


@pytest.mark.parametrize(("at", "standing"), [(0.0, 2), (19.9, 2), (20.0, 1), (24.9, 1),
                                              (25.0, 0), (110.0, 0)])
def test_a_level_stands_one_higher_at_a_time_as_its_oldest_call_ages(
        at: float, standing: int) -> None:
    """A level-2 call that has waited ``at`` goes before a later call of its standing, and
    after a later call of the level above it."""
    for rival, first in ((standing, 0), (standing - 1, 1)):
        if rival < 0:
            continue
        k = Kit(tiers=VERY_PATIENT, promote_after_s=(math.inf, 5.0, 20.0, 60.0))
        k.occupy()
        long_call, other = ticket(1, 10.0), ticket(1, LEVEL_EST[rival])
        k.submit(long_call, 0.0)
        k.submit(other, at)
        assert k.drain(at)[first] is long_call


def test_aged_call_goes_before_later_short_calls() -> None:
    k = Kit(tiers=VERY_PATIENT, promote_after_s=(math.inf, 5.0, 20.0, 60.0))
    k.occupy()
    long_call = ticket(2, 10.0)
    k.submit(long_call, 0.0)
    shorts = [ticket(2, 0.5) for _ in range(3)]
    for i, t in enumerate(shorts):
        k.submit(t, 30.0 + i)
    assert k.drain(40.0)[0] is long_call  # it arrived first, and now shares their level


@pytest.mark.parametrize(("at", "tier"), [(0.0, 3), (59.0, 3), (60.0, 2), (119.0, 2),
                                          (200.0, 2), (899.0, 2)])
def test_tier_promotion_moves_at_most_one_tier(at: float, tier: int) -> None:
    k = Kit(tiers=PATIENT, tier_promote_after_s=60.0)
    k.occupy()
    low = ticket(3, 1.0)
    k.submit(low, 0.0)
    k.advance(at)
    assert (low.current_tier, low.tier, k.s.depth(tier)) == (tier, 3, 1)


@pytest.mark.parametrize(("ceiling", "tier_after"), [(3, 3), (2, 2), (0, 2)])
def test_tier_promotion_never_passes_the_callers_ceiling(ceiling: int, tier_after: int) -> None:
    k = Kit(tiers=PATIENT, tier_promote_after_s=60.0)
    k.occupy()
    low = ticket(3, 1.0, ceiling=ceiling)
    k.submit(low, 0.0)
    k.advance(500.0)
    assert low.current_tier == tier_after


def test_tier_promotion_skips_tiers_whose_deadline_comes_first() -> None:
    tiers = (TierSpec("a", 1, max_wait_s=10), TierSpec("b", 1, max_wait_s=30))
    k = Kit(tiers=tiers, tier_promote_after_s=60.0)
    k.occupy()
    b = ticket(1)
    k.submit(b, 0.0)
    k.advance(29.0)
    assert b.current_tier == 1
    assert k.advance(30.0).rejections[0].code == "queue_timeout"


def test_promoted_call_goes_before_its_new_tier_if_it_arrived_first() -> None:
    k = Kit(tier_promote_after_s=60.0)
    k.occupy()
    old_low, young_low = ticket(3), ticket(3)
    k.submit(old_low, 0.0)
    k.submit(young_low, 10.0)
    normal = ticket(2)
    k.submit(normal, 59.0)
    # at 61 old_low has moved up into normal, where it is the oldest arrival
    assert k.drain(61.0) == [old_low, normal, young_low]


def test_promotion_past_a_reserve_is_a_wakeup() -> None:
    tiers = (TierSpec("a"), TierSpec("b", reserve=1), TierSpec("c"))
    k = Kit({"p": 2}, tiers, tier_promote_after_s=60.0)
    k.occupy(tier=2)
    c = ticket(2)
    k.submit(c, 0.0)
    assert c.state is TicketState.QUEUED  # b holds the last free slot against c
    assert k.s.next_wakeup(0.0) == 60.0
    assert [d.ticket for d in k.advance(60.0).dispatches] == [c]
    assert c.current_tier == 1


# --- deadlines ---------------------------------------------------------------------------


def test_deadlines_per_tier_are_exact() -> None:
    tiers = (TierSpec("a", max_wait_s=10), TierSpec("b", max_wait_s=30))
    k = Kit(tiers=tiers)
    k.occupy()
    a, b = ticket(0), ticket(1)
    k.submit(b, 0.0)
    k.submit(a, 5.0)
    assert k.s.next_wakeup(5.0) == 15.0
    steps: list[tuple[float, list[Ticket]]] = [(14.9, []), (15.0, [a]), (29.0, []),
                                               (30.0, [b]), (100.0, [])]
    for now, expected in steps:
        rejections = k.advance(now).rejections
        assert [r.ticket for r in rejections] == expected
        assert all(r.code == "queue_timeout" and 1 <= r.retry_after_s <= 120
                   for r in rejections)
    assert k.s.next_wakeup(100.0) is None
    assert k.drain(100.0) == []


@pytest.mark.parametrize(("asked", "deadline"), [
    (None, 15.0),  # the tier's 10 s
    (4.0, 9.0),  # a caller may allow less
    (25.0, 15.0),  # ... never more
    (0.0, 5.0),
    (-3.0, 5.0),  # nonsense is no wait at all, not a deadline in the past
    (math.nan, 15.0),  # nor a deadline that never comes
    (math.inf, 15.0),
])
def test_a_callers_own_wait_shortens_the_tiers(asked: float | None, deadline: float) -> None:
    k = Kit(tiers=(TierSpec("a", max_wait_s=10),))
    k.occupy()
    t = Ticket(0, ("p",), 1.0, max_wait_s=asked)
    k.submit(t, 5.0)
    assert t.deadline == deadline


def test_a_requeued_call_keeps_its_arrival_deadline_and_place() -> None:
    """A call whose slot came back (a 429, a re-try) goes back ahead of later arrivals,
    and its original deadline holds exactly, though it sits behind calls that arrived
    after it with later deadlines."""
    k = Kit(tiers=(TierSpec("a", max_wait_s=100),))
    first = ticket(0)
    k.submit(first, 0.0)
    assert k.granted(first)
    later = [ticket(0) for _ in range(3)]
    for i, t in enumerate(later):
        k.submit(t, 10.0 + i)
    k.finish(first, 20.0)  # the upstream said 429: the slot comes back...
    assert k.running["p"] == [later[0]]
    k.submit(first, 20.0)  # ...and the call queues again
    assert (first.arrived, first.deadline) == (0.0, 100.0)
    assert k.release("p", 30.0) == [first]  # its old place: before later[1]
    k.finish(first, 40.0)
    k.submit(first, 40.0)
    assert [r.ticket for r in k.advance(100.0).rejections] == [first, *later[1:]][:1]
    assert first.state is TicketState.REJECTED


def test_a_requeued_call_past_its_deadline_is_refused_at_once() -> None:
    k = Kit(tiers=(TierSpec("a", max_wait_s=10),))
    t = ticket(0)
    k.submit(t, 0.0)
    k.finish(t, 12.0)
    decisions = k.submit(t, 12.0)
    assert [(r.ticket, r.code) for r in decisions.rejections] == [(t, "queue_timeout")]


def test_a_requeued_call_keeps_its_tier_promotion_and_level() -> None:
    k = Kit(tier_promote_after_s=60.0, promote_after_s=(math.inf, 5.0, 20.0, 60.0))
    k.occupy()
    t = ticket(3, 10.0)
    k.submit(t, 0.0)
    k.advance(70.0)
    assert (t.current_tier, t.level) == (2, 2)
    k.release("p", 70.0)
    assert k.granted(t)
    k.finish(t, 71.0)
    k.occupy(71.0)
    k.submit(t, 71.0)
    assert (t.current_tier, t.level, t.arrived) == (2, 2, 0.0)  # its level stands at 0


# --- bounded queue -----------------------------------------------------------------------


@pytest.mark.parametrize(("max_queue", "tier_max", "arrivals", "outcome"), [
    # outcome per arrival: "q" queued, "full" refused, "evict:i" evicted arrival i
    (2, None, (3, 3, 3), ["q", "q", "full"]),
    (2, None, (3, 3, 0), ["q", "q", "evict:1"]),          # the latest arrival goes
    (2, None, (2, 3, 1), ["q", "q", "evict:1"]),          # least urgent goes
    (2, None, (1, 1, 1), ["q", "q", "full"]),
    (2, None, (0, 1, 2), ["q", "q", "full"]),             # no less urgent call to evict
    (3, 1, (3, 3, 0), ["q", "full", "q"]),                # the tier's own bound
    (3, 1, (0, 0, 3), ["q", "full", "q"]),
])
def test_queue_bounds_and_eviction(max_queue: int, tier_max: int | None,
                                   arrivals: tuple[int, ...], outcome: list[str]) -> None:
    tiers = [TierSpec(t.name, t.weight, max_queue=tier_max) for t in FOUR]
    k = Kit(tiers=tiers, max_queue=max_queue)
    k.occupy()
    tickets = [ticket(t) for t in arrivals]
    for i, (t, expected) in enumerate(zip(tickets, outcome, strict=True)):
        decisions = k.submit(t, float(i))
        assert not decisions.dispatches
        refused = [(r.ticket, r.code) for r in decisions.rejections]
        if expected == "q":
            assert refused == []
        elif expected == "full":
            assert refused == [(t, "queue_full")]
        else:
            victim = tickets[int(expected.split(":")[1])]
            assert refused == [(victim, "evicted")]
            assert victim.state is TicketState.REJECTED
    assert sum(k.s.depth(i) for i in range(4)) <= max_queue


@pytest.mark.parametrize(("queued_s", "capacity", "retry_after"), [
    (0.0, 1, 1.0), (30.0, 1, 30.0), (30.0, 3, 10.0), (1e6, 1, 120.0),
])
def test_retry_after_is_the_drain_time(queued_s: float, capacity: int,
                                       retry_after: float) -> None:
    k = Kit({"p": capacity}, max_queue=1)
    for _ in range(capacity):
        k.occupy()
    k.submit(ticket(0, queued_s), 0.0)
    decisions = k.submit(ticket(0, 1.0), 0.0)
    assert [r.retry_after_s for r in decisions.rejections] == [pytest.approx(retry_after)]


# --- candidates, cancel -------------------------------------------------------------------


def test_freed_slot_goes_to_the_best_call_that_can_use_it() -> None:
    k = Kit({"a": 1, "b": 1})
    k.occupy(provider="a")
    k.occupy(provider="b")
    only_a = ticket(0, 1.0, ("a",))
    either = ticket(1, 1.0, ("a", "b"))
    only_b = ticket(2, 1.0, ("b",))
    for t in (only_a, either, only_b):
        k.submit(t, 0.0)
    assert k.release("b", 1.0) == [either]
    assert k.release("b", 2.0) == [only_b]
    assert k.release("a", 3.0) == [only_a]


@pytest.mark.parametrize(("busy", "candidates", "provider"), [
    ((), ("a", "b"), "a"), ((), ("b", "a"), "b"), (("a",), ("a", "b"), "b"),
])
def test_submit_takes_the_first_free_candidate(busy: tuple[str, ...],
                                               candidates: tuple[str, ...],
                                               provider: str) -> None:
    k = Kit({"a": 1, "b": 1})
    for name in busy:
        k.occupy(provider=name)
    t = ticket(0, 1.0, candidates)
    k.submit(t, 0.0)
    assert t.pool == provider


def test_deployments_share_their_providers_slots() -> None:
    k = Kit({"openai": 1}, deployments={"openai/big": "openai", "openai/small": "openai"})
    big, small = ticket(0, 1.0, ("openai/big",)), ticket(1, 1.0, ("openai/small",))
    k.submit(big, 0.0)
    k.submit(small, 0.0)
    assert (big.deployment, big.pool, k.granted(small)) == ("openai/big", "openai", False)
    assert k.release("openai", 1.0) == [small]
    assert small.deployment == "openai/small"


def test_cancelled_call_is_never_dispatched() -> None:
    k = Kit()
    k.occupy()
    a, b = ticket(0), ticket(1)
    k.submit(a, 0.0)
    k.submit(b, 0.0)
    k.s.cancel(a, 1.0)
    k.s.cancel(a, 1.0)
    assert k.s.depth(0) == 0
    assert k.drain(2.0) == [b]
    assert a.state is TicketState.CANCELLED
    k.s.cancel(b, 3.0)  # no longer queued: nothing happens
    assert b.state is TicketState.RELEASED


def test_many_cancellations_keep_memory_bounded() -> None:
    k = Kit(max_queue=100_000)
    k.occupy()
    keep = ticket(3)
    k.submit(keep, 0.0)
    for _ in range(20_000):
        t = ticket(1, 3.0)
        k.submit(t, 0.0)
        k.s.cancel(t, 0.0)
    assert k.s._queues._entries < 5000
    assert k.drain(1.0) == [keep]


# --- capacity: limits, pauses, breakers ---------------------------------------------------


def test_set_max_raises_and_lowers_the_limit() -> None:
    k = Kit({"p": 2})
    running = [k.occupy(tier=3), k.occupy(tier=3)]
    waiting = [ticket(1) for _ in range(3)]
    for t in waiting:
        k.submit(t, 0.0)
    k.s.set_max("p", 3, 1.0)
    assert [d.ticket for d in k.collect().dispatches] == waiting[:1]
    k.s.set_max("p", 1, 2.0)
    assert not k.collect()
    assert k.s.inflight("p") == 3 and k.s.capacity("p") == 1
    assert k.finish(running[0], 3.0) == [] and k.finish(running[1], 3.0) == []
    assert k.release("p", 4.0) == waiting[1:2]


def test_a_paused_deployment_keeps_its_queued_calls_and_serves_them_when_it_resumes() -> None:
    k = Kit({"a": 1, "b": 1})
    k.occupy(provider="b")
    only_a = ticket(0, 1.0, ("a",))
    either = ticket(1, 1.0, ("a", "b"))
    k.s.pause("a", 5.0, 0.0)
    k.submit(only_a, 0.0)
    k.submit(either, 0.1)
    assert not k.granted(only_a) and not k.granted(either)
    assert only_a.candidates == ("a",)  # the pause removed nothing
    assert k.s.next_wakeup(0.1) == 5.0
    assert k.release("b", 1.0) == [either]  # another candidate frees first
    assert [d.ticket for d in k.advance(5.0).dispatches] == [only_a]


def test_pausing_one_deployment_leaves_its_providers_others_alone() -> None:
    k = Kit({"p": 2}, deployments={"p/x": "p", "p/y": "p"})
    k.s.pause("p/x", 10.0, 0.0)
    x, y = ticket(0, 1.0, ("p/x",)), ticket(0, 1.0, ("p/y",))
    k.submit(x, 0.0)
    k.submit(y, 0.0)
    assert (k.granted(x), k.granted(y)) == (False, True)
    assert k.s.expected_wait_s("p/x", 0, 1.0, 0.0) == pytest.approx(10.0)


def test_a_later_pause_never_shortens_an_earlier_one() -> None:
    k = Kit()
    k.s.pause("p", 10.0, 0.0)
    k.s.pause("p", 2.0, 0.0)
    assert k.s.paused_until("p") == 10.0


def test_an_open_breaker_refuses_calls_with_no_other_candidate_and_keeps_the_rest() -> None:
    k = Kit({"a": 1, "b": 1})
    k.occupy(provider="a")
    k.occupy(provider="b")
    only_a = ticket(0, 1.0, ("a",))
    either = ticket(0, 1.0, ("a", "b"))
    k.submit(only_a, 0.0)
    k.submit(either, 0.0)
    k.s.set_down("a", 30.0, 1, 1.0)
    decisions = k.collect()
    assert [(r.ticket, r.code) for r in decisions.rejections] == [
        (only_a, "upstream_unavailable")]
    assert decisions.rejections[0].retry_after_s == pytest.approx(29.0)
    assert either.state is TicketState.QUEUED
    late = ticket(0, 1.0, ("a",))
    assert [r.code for r in k.submit(late, 2.0).rejections] == ["upstream_unavailable"]


def test_half_open_lets_only_the_probes_through_and_the_rest_wait_in_place() -> None:
    k = Kit({"a": 4})
    k.s.set_down("a", 10.0, 1, 0.0)
    k.collect()
    waiting = [ticket(0, 1.0, ("a",)) for _ in range(3)]
    for t in waiting:
        k.submit(t, 10.0)  # half-open from 10: the queue is kept, one probe goes
    assert [t.state for t in waiting] == [TicketState.DISPATCHED] + [TicketState.QUEUED] * 2
    k.finish(waiting[0], 11.0)  # the probe came back (no verdict yet): the next probe
    assert k.running["a"] == [waiting[1]]
    k.s.set_up("a", 12.0)  # the breaker closed
    assert [d.ticket for d in k.collect().dispatches] == [waiting[2]]


def test_a_cut_limit_grows_back_with_time_alone() -> None:
    k = Kit({"p": 4})
    k.s.cut("p", 0.0, 0)
    assert k.s.capacity("p") == 2
    for _ in range(2):
        k.occupy()
    waiting = ticket(0)
    k.submit(waiting, 0.0)
    assert not k.granted(waiting)
    wake = k.s.next_wakeup(0.0)
    assert wake is not None and 0.0 < wake <= 10.0
    k.advance(wake)
    assert k.granted(waiting) and k.s.capacity("p") == 3


# --- expected waits -------------------------------------------------------------------------


def test_expected_wait_counts_only_what_that_provider_could_serve() -> None:
    k = Kit({"a": 2, "b": 2})
    for _ in range(2):
        k.occupy(provider="a")
    for _ in range(10):
        k.submit(ticket(0, 4.0, ("a",)), 0.0)
    assert k.s.expected_wait_s("b", 2, 1.0, 0.0) == 0.0  # idle: the backlog is a's alone
    assert k.s.expected_wait_s("a", 2, 1.0, 0.0) == pytest.approx((40.0 + 1.0) / 2)
    assert k.s.expected_wait_s("a", 0, 1.0, 0.0) == pytest.approx((40.0 + 1.0) / 2)


# --- policy overrides ---------------------------------------------------------------------


def test_set_policy_overrides_and_restores() -> None:
    k = Kit({"p": 4})
    k.s.set_policy(None, {0: 3}, 0.0)
    assert k.s.held_back("p", 3, 0.0) == 3
    k.s.set_policy({3: 50.0}, None, 1.0)
    assert k.s.held_back("p", 3, 1.0) == 0
    assert k.s.snapshot(1.0)["tiers"][3]["weight"] == 50.0  # type: ignore[index]
    k.s.set_policy(None, None, 2.0)
    assert k.s.snapshot(2.0)["tiers"][3]["weight"] == 1.0  # type: ignore[index]


@pytest.mark.parametrize(("weights", "reserves"), [({0: -1.0}, None), (None, {1: -1})])
def test_invalid_policy_is_refused_and_changes_nothing(weights: dict[int, float] | None,
                                                        reserves: dict[int, int] | None) -> None:
    k = Kit({"p": 4})
    before = k.s.snapshot(0.0)
    with pytest.raises(ValueError):
        k.s.set_policy(weights, reserves, 0.0)
    assert k.s.snapshot(0.0) == before


def test_set_policy_dispatches_what_a_dropped_reserve_frees() -> None:
    tiers = [TierSpec(t.name, t.weight, reserve=r) for t, r in zip(FOUR, (2, 0, 0, 0),
                                                                   strict=True)]
    k = Kit({"p": 3}, tiers)
    lows = [ticket(3) for _ in range(3)]
    for t in lows:
        k.submit(t, 0.0)
    assert k.s.inflight("p") == 1
    k.s.set_policy(None, {0: 0}, 1.0)
    assert [d.ticket for d in k.collect().dispatches] == lows[1:]


def test_snapshot_is_json_shaped() -> None:
    k = Kit({"p": 1})
    k.occupy()
    k.submit(ticket(2, 7.0), 0.0)
    snap = k.s.snapshot(3.0)
    json.dumps(snap)
    assert snap["queued"] == 1
    tier = snap["tiers"][2]  # type: ignore[index]
    assert tier["depth"] == 1 and tier["by_level"] == [0, 0, 1, 0]
    assert tier["oldest_wait_s"] == 3.0
    assert snap["providers"]["p"]["inflight"] == 1  # type: ignore[index]


# --- refusals of nonsense --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"tiers": ()},
    {"tiers": (TierSpec("a"), TierSpec("a"))},
    {"tiers": (TierSpec("a", weight=-1),)},
    {"tiers": (TierSpec("a", weight=math.inf),)},
    {"tiers": FOUR, "headroom_spread": -1.0},
    {"tiers": FOUR, "level_bounds_s": (5.0, 1.0)},
    {"tiers": FOUR, "promote_after_s": (1.0, 2.0)},
    {"tiers": FOUR, "max_queue": 0},
    {"tiers": FOUR, "rescue_fraction": 1.5},
])
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SchedulerSettings(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [
    ticket(9), ticket(0, 1.0, ()), ticket(0, 1.0, ("nope",)), ticket(0, math.nan),
    ticket(0, -1.0), ticket(0, 1.0, size_s=math.inf), ticket(1, 1.0, ceiling=2),
])
def test_invalid_tickets_are_refused(bad: Ticket) -> None:
    with pytest.raises(ValueError):
        Kit().s.submit(bad, 0.0)


def test_a_queued_or_running_ticket_cannot_be_submitted_and_a_slot_is_released_once() -> None:
    k = Kit()
    t = k.occupy()
    with pytest.raises(ValueError):
        k.s.submit(t, 0.0)
    k.s.release(t, 1.0)
    with pytest.raises(ValueError):
        k.s.release(t, 1.0)


def test_wait_is_recorded_on_the_ticket() -> None:
    k = Kit()
    k.occupy()
    t = ticket(1)
    k.submit(t, 2.0)
    k.release("p", 4.5)
    assert (t.arrived, t.dispatched_at, t.wait_s, t.pool, t.waited_s) == (2.0, 4.5, 2.5, "p", 2.5)


def test_an_infinite_or_negative_weight_is_refused() -> None:
    """Found in review: a schedule window's `.inf` weight made every share NaN and each
    submit raise."""
    k = Kit({"p": 4})
    for bad in (math.inf, -1.0, math.nan):
        with pytest.raises(ValueError):
            k.s.set_policy({1: bad}, None, 0.0)
    k.submit(ticket(2), 0.0)  # still serving
