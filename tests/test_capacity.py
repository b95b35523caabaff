"""A provider's slots (pool) and a deployment's gate, driven by plain ``now`` floats."""

from __future__ import annotations

import math

import pytest

from proxy.core.capacity import GROW_EVERY_S, HOLD_S, Gate, Pool

# AIMD: (now, event, expected limit). max 16.
AIMD_STEPS = {
    "halves on a 429": [(0.0, "429", 8), (2.0, "429", 4), (4.0, "429", 2), (6.0, "429", 1)],
    "never below one": [(t, "429", max(1, 16 >> (t // 2 + 1))) for t in range(0, 14, 2)],
    "a burst of 429s halves once": [(0.0, "429", 8), (0.1, "429", 8), (0.9, "429", 8)],
    "one more after `limit` successes": (
        [(0.0, "429", 8), (0.5, "ok", 8)]  # during the hold: ignored
        + [(2.0, "ok", 8)] * 7
        + [(2.0, "ok", 9)]
        + [(2.0, "ok", 9)] * 8
        + [(2.0, "ok", 10)]
    ),
    "never above the maximum": [(0.0, "ok", 16)] * 40,
    "grows back by one every few seconds without traffic": [
        (0.0, "429", 8), (GROW_EVERY_S - 0.01, "-", 8), (GROW_EVERY_S, "-", 9),
        (3 * GROW_EVERY_S, "-", 11), (100 * GROW_EVERY_S, "-", 16),
    ],
}


@pytest.mark.parametrize("steps", AIMD_STEPS.values(), ids=AIMD_STEPS.keys())
def test_adaptive_concurrency(steps: list[tuple[float, str, int]]) -> None:
    pool = Pool("p", 16)
    for index, (now, event, expected) in enumerate(steps):
        if event == "429":
            pool.cut(now)
        elif event == "ok":
            pool.succeed(now)
        pool.free(now)
        assert pool.limit == expected, f"step {index}"


def test_a_cut_is_one_signal_per_hold() -> None:
    pool = Pool("p", 8)
    pool.cut(0.0)
    pool.cut(HOLD_S - 0.01)
    assert pool.limit == 4
    pool.cut(HOLD_S)
    assert pool.limit == 2


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
    pool.cut(0.0)
    assert pool.next_change(0.0) == GROW_EVERY_S
    pool.free(GROW_EVERY_S)
    assert pool.limit == 2 and pool.next_change(GROW_EVERY_S) == math.inf


def test_a_raised_maximum_is_followed_unless_a_cut_holds_the_limit_down() -> None:
    pool = Pool("p", 4)
    pool.set_max(6, 0.0)
    assert pool.limit == 6
    pool.cut(1.0)
    pool.set_max(10, 1.5)
    assert pool.limit == 3  # grows back towards 10 with time and successes
    pool.set_max(2, 2.0)
    assert pool.limit == 2


def test_a_zero_maximum_stays_closed_whatever_happens() -> None:
    pool = Pool("p", 0)
    pool.cut(0.0)
    pool.succeed(5.0)
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
