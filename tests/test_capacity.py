"""A provider's slots (pool) and a deployment's gate, driven by plain ``now`` floats."""

from __future__ import annotations

import math

import pytest

from proxy.core.scheduling.capacity import GROW_EVERY_S, Gate, Pool

# Adaptive limit: (now, event, calls still in flight, expected limit). max 16.
ADAPTIVE_STEPS = {
    "a 429 with nothing else in flight halves the limit": [
        (0.0, "429", 0, 8), (1.0, "429", 0, 4), (2.0, "429", 0, 2), (3.0, "429", 0, 1),
        (4.0, "429", 0, 1)],
    "a 429 with as many in flight as the limit allows cuts nothing more": [
        (0.0, "429", 6, 8), (0.1, "429", 8, 8)],
    "a 429 cuts to the concurrency the provider bore, at most by half": [
        (0.0, "429", 11, 11), (0.0, "429", 2, 6)],
    "a burst of 429s walks down to the real limit": [
        (0.0, "429", 15, 15), (0.0, "429", 10, 10), (0.0, "429", 6, 6), (0.0, "429", 2, 3),
        (0.0, "429", 2, 2)],
    "grows back with time alone, one step per period": [
        (0.0, "429", 0, 8), (GROW_EVERY_S - 0.01, "-", 0, 8), (GROW_EVERY_S, "-", 0, 9),
        (3 * GROW_EVERY_S, "-", 0, 11), (100 * GROW_EVERY_S, "-", 0, 16)],
    "a 429 restarts the wait for growth": [
        (0.0, "429", 6, 8), (GROW_EVERY_S - 1, "429", 5, 5), (GROW_EVERY_S + 1, "-", 0, 5),
        (2 * GROW_EVERY_S - 1, "-", 0, 6)],
}


@pytest.mark.parametrize("steps", ADAPTIVE_STEPS.values(), ids=ADAPTIVE_STEPS.keys())
def test_adaptive_concurrency(steps: list[tuple[float, str, int, int]]) -> None:
    pool = Pool("p", 16)
    for index, (now, event, inflight, expected) in enumerate(steps):
        if event == "429":
            pool.cut(now, inflight)
        pool.free(now)
        assert pool.limit == expected, f"step {index}"


def test_a_big_limit_grows_back_by_an_eighth() -> None:
    pool = Pool("p", 64)
    pool.cut(0.0, 0)
    assert pool.limit == 32
    pool.free(GROW_EVERY_S)
    assert pool.limit == 36


def test_free_slots_follow_limit_inflight_and_pause() -> None:
    pool = Pool("p", 3)
    pool.inflight = 2
    assert pool.free(0.0) == 1
    pool.paused_until = 5.0
    assert (pool.free(4.9), pool.next_change(4.9)) == (0, 5.0)
    assert pool.free(5.0) == 1
    pool.inflight = 5  # more running than the limit, after a cut: no slot, never negative
    assert pool.free(6.0) == 0


def test_growing_back_is_a_wakeup_only_while_below_the_maximum() -> None:
    pool = Pool("p", 2)
    assert pool.next_change(0.0) == math.inf
    pool.cut(0.0, 0)
    assert pool.next_change(0.0) == GROW_EVERY_S
    pool.free(GROW_EVERY_S)
    assert pool.limit == 2 and pool.next_change(GROW_EVERY_S) == math.inf


def test_a_raised_maximum_is_followed_unless_a_cut_holds_the_limit_down() -> None:
    pool = Pool("p", 4)
    pool.set_max(6, 0.0)
    assert pool.limit == 6
    pool.cut(1.0, 0)
    pool.set_max(10, 1.5)
    assert pool.limit == 3  # grows back towards 10 with time
    pool.set_max(2, 2.0)
    assert pool.limit == 2


def test_a_zero_maximum_stays_closed_whatever_happens() -> None:
    pool = Pool("p", 0)
    pool.cut(0.0, 0)
    assert pool.free(1000.0) == 0 and pool.limit == 0


@pytest.mark.parametrize(("paused", "down", "probes", "inflight", "now", "is_open"), [
    (-math.inf, -math.inf, None, 9, 0.0, True),
    (5.0, -math.inf, None, 0, 4.0, False),
    (5.0, -math.inf, None, 0, 5.0, True),
    (-math.inf, 10.0, 1, 0, 9.9, False),   # breaker open
    (-math.inf, 10.0, 1, 0, 10.0, True),   # half-open: one probe
    (-math.inf, 10.0, 1, 1, 11.0, False),  # the probe is out
    (-math.inf, 10.0, 2, 1, 11.0, True),
])
def test_gate(paused: float, down: float, probes: int | None, inflight: int, now: float,
              is_open: bool) -> None:
    gate = Gate("p/m", Pool("p", 4), inflight=inflight, paused_until=paused, down_until=down,
                probes=probes)
    assert gate.open(now) is is_open
    assert gate.down(now) is (now < down)
    assert gate.next_change(now) == (max(paused, down) if max(paused, down) > now
                                     else math.inf)
