from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.health.breaker import Breaker, BreakerSettings, BreakerState

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

# Steps: (now, event, expected state after it). Events: "ok", "fail", "throttle",
# "abandon", "acquire", "deny" (acquire that must be refused), "-" (look only).
Step = tuple[float, str, BreakerState]


def run(breaker: Breaker, steps: list[Step]) -> None:
    for index, (now, event, expected) in enumerate(steps):
        if event == "ok":
            breaker.on_success(now)
        elif event == "fail":
            breaker.on_failure(now)
        elif event == "throttle":
            breaker.on_throttle(now)
        elif event == "abandon":
            breaker.on_abandon(now)
        elif event == "acquire":
            assert breaker.acquire(now), f"step {index}: acquire refused"
        elif event == "deny":
            assert not breaker.acquire(now), f"step {index}: acquire allowed"
        assert breaker.state(now) is expected, f"step {index} ({now}, {event})"


def make(**overrides: float) -> Breaker:
    base: dict[str, float] = {"jitter": 0.0, "min_calls": 1000, "cooldown_s": 5.0}
    base.update(overrides)
    return Breaker(BreakerSettings(**base), random.Random(0))  # type: ignore[arg-type]


SCENARIOS: dict[str, tuple[dict[str, float], list[Step]]] = {
    "consecutive failures open": (
        {"consecutive_failures": 3},
        [(0, "fail", CLOSED), (1, "fail", CLOSED), (2, "fail", OPEN)],
    ),
    "a success resets the consecutive count": (
        {"consecutive_failures": 3},
        [
            (0, "fail", CLOSED),
            (0, "fail", CLOSED),
            (0, "ok", CLOSED),
            (0, "fail", CLOSED),
            (0, "fail", CLOSED),
            (0, "fail", OPEN),
        ],
    ),
    "error rate opens once min_calls is reached": (
        {"consecutive_failures": 100, "min_calls": 4, "error_rate": 0.5, "window_s": 10},
        [(0, "ok", CLOSED), (0, "fail", CLOSED), (0, "ok", CLOSED), (0, "fail", OPEN)],
    ),
    "error rate below min_calls does not open": (
        {"consecutive_failures": 100, "min_calls": 4, "error_rate": 0.5, "window_s": 10},
        [(0, "fail", CLOSED), (0, "fail", CLOSED), (0, "fail", CLOSED)],
    ),
    "error rate under the threshold stays closed": (
        {"consecutive_failures": 100, "min_calls": 4, "error_rate": 0.5, "window_s": 10},
        [
            (0, "ok", CLOSED),
            (0, "ok", CLOSED),
            (0, "ok", CLOSED),
            (0, "fail", CLOSED),
            (0, "fail", CLOSED),
            (0, "ok", CLOSED),
        ],
    ),
    "old calls leave the window": (
        {"consecutive_failures": 100, "min_calls": 4, "error_rate": 0.5, "window_s": 10},
        # Counting all nine calls it would be 4/9; the window holds only the last four, 2/4.
        [
            (0, "ok", CLOSED),
            (0, "ok", CLOSED),
            (0, "ok", CLOSED),
            (0, "fail", CLOSED),
            (0, "fail", CLOSED),
            (20, "fail", CLOSED),
            (20, "ok", CLOSED),
            (20, "ok", CLOSED),
            (20, "fail", OPEN),
        ],
    ),
    "open refuses calls, half-opens after the cooldown": (
        {"consecutive_failures": 1},
        [(0, "fail", OPEN), (1, "deny", OPEN), (4.99, "deny", OPEN), (5, "-", HALF)],
    ),
    "a probe success closes": (
        {"consecutive_failures": 1},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (6, "ok", CLOSED),
            (6, "acquire", CLOSED),
            (6, "acquire", CLOSED),
        ],
    ),
    "a probe failure re-opens with a doubled cooldown": (
        {"consecutive_failures": 1},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (6, "fail", OPEN),
            (15.9, "deny", OPEN),
            (16, "acquire", HALF),
        ],
    ),
    "exactly one probe by default": (
        {"consecutive_failures": 1},
        [(0, "fail", OPEN), (5, "acquire", HALF), (5, "deny", HALF), (9, "deny", HALF)],
    ),
    "exactly K probes, all must succeed": (
        {"consecutive_failures": 1, "half_open_probes": 3},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (5, "acquire", HALF),
            (5, "acquire", HALF),
            (5, "deny", HALF),
            (6, "ok", HALF),
            (6, "deny", HALF),
            (6, "ok", HALF),
            (6, "ok", CLOSED),
        ],
    ),
    "one failing probe of K re-opens; late probe verdicts are ignored": (
        {"consecutive_failures": 1, "half_open_probes": 2},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (5, "acquire", HALF),
            (6, "fail", OPEN),
            (6, "ok", OPEN),
            (7, "deny", OPEN),
        ],
    ),
    "abandon returns the probe": (
        {"consecutive_failures": 1},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (5, "deny", HALF),
            (5, "abandon", HALF),
            (5, "acquire", HALF),
            (6, "ok", CLOSED),
        ],
    ),
    "a verdict with no probe out does not close": (
        {"consecutive_failures": 1},
        [(0, "fail", OPEN), (5, "ok", HALF), (5, "acquire", HALF)],
    ),
    "throttles never open the breaker (pausing is the scheduler's business)": (
        {"consecutive_failures": 2},
        [(float(t), "throttle", CLOSED) for t in range(10)]
        + [(10, "acquire", CLOSED), (10, "fail", CLOSED)],
    ),
    "a throttled probe gives its permit back": (
        {"consecutive_failures": 1},
        [
            (0, "fail", OPEN),
            (5, "acquire", HALF),
            (5, "deny", HALF),
            (5, "throttle", HALF),
            (5, "acquire", HALF),
            (6, "ok", CLOSED),
        ],
    ),
}


@pytest.mark.parametrize("overrides, steps", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_scenarios(overrides: dict[str, float], steps: list[Step]) -> None:
    run(make(**overrides), steps)


def cooldowns(breaker: Breaker, openings: int) -> list[float]:
    """Open the breaker ``openings`` times (failing each probe) and return each cooldown."""
    now, result = 0.0, []
    breaker.on_failure(now)
    for _ in range(openings):
        until = breaker.retry_at(now)
        result.append(until - now)
        now = until
        assert breaker.acquire(now)
        breaker.on_failure(now)
    return result


def test_cooldown_doubles_up_to_the_cap() -> None:
    breaker = make(consecutive_failures=1, cooldown_s=5, cooldown_max_s=60)
    assert cooldowns(breaker, 7) == pytest.approx([5, 10, 20, 40, 60, 60, 60])
    assert breaker.opened_count == 8


def test_cooldown_growth_starts_over_after_a_long_healthy_spell() -> None:
    breaker = make(consecutive_failures=1, cooldown_s=5, cooldown_max_s=60)
    breaker.on_failure(0)  # open 5 s
    assert breaker.acquire(5)
    breaker.on_failure(5)  # open 10 s, until 15
    assert breaker.acquire(15)
    breaker.on_success(15)  # closed
    breaker.on_failure(20)  # soon after closing: the streak goes on (20 s)
    assert breaker.retry_at(20) == pytest.approx(40)
    assert breaker.acquire(40)
    breaker.on_success(40)
    breaker.on_failure(100)  # closed for 60 s: back to the first cooldown
    assert breaker.retry_at(100) == pytest.approx(105)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), openings=st.integers(1, 8))
def test_jittered_cooldown_stays_within_bounds(seed: int, openings: int) -> None:
    config = BreakerSettings(consecutive_failures=1, cooldown_s=5, cooldown_max_s=60, jitter=0.2)
    breaker = Breaker(config, random.Random(seed))
    for opening, cooldown in enumerate(cooldowns(breaker, openings)):
        base = min(60.0, 5.0 * 2**opening)
        assert base * 0.8 - 1e-9 <= cooldown <= min(60.0, base * 1.2) + 1e-9


def test_transitions_reach_the_hook() -> None:
    seen: list[tuple[BreakerState, BreakerState, float]] = []
    config = BreakerSettings(consecutive_failures=1, jitter=0.0)
    breaker = Breaker(config, random.Random(0),
                      on_transition=lambda a, b, at: seen.append((a, b, at)))
    breaker.on_failure(0)
    assert breaker.acquire(5)
    breaker.on_failure(5)
    assert breaker.acquire(15)
    breaker.on_success(15)
    assert seen == [(CLOSED, OPEN, 0), (OPEN, HALF, 5), (HALF, OPEN, 5), (OPEN, HALF, 15),
                    (HALF, CLOSED, 15)]
    assert breaker.open_until == 15


@pytest.mark.parametrize(
    "steps, now, expected",
    [
        ([], 0.0, 0.0),  # available: now
        ([(0.0, "fail")], 1.0, 5.0),  # open: end of cooldown
        ([(0.0, "throttle")], 1.0, 1.0),  # a 429 is no sickness
        ([(0.0, "fail"), (5.0, "acquire")], 6.0, 11.0),  # probe out: estimate one cooldown
    ],
)
def test_retry_at(steps: list[tuple[float, str]], now: float, expected: float) -> None:
    breaker = make(consecutive_failures=1)
    for at, event in steps:
        if event == "fail":
            breaker.on_failure(at)
        elif event == "acquire":
            assert breaker.acquire(at)
        else:
            breaker.on_throttle(at)
    assert breaker.retry_at(now) == pytest.approx(expected)


def test_snapshot() -> None:
    breaker = make(consecutive_failures=2, window_s=10)
    breaker.on_success(0)
    breaker.on_failure(1)
    breaker.on_failure(2)
    assert breaker.snapshot(3) == {
        "state": "open",
        "available": False,
        "consecutive_failures": 2,
        "window_calls": 3,
        "window_failures": 2,
        "opened_count": 1,
        "probes_in_flight": 0,
        "retry_at": pytest.approx(7.0),
        "retry_in_s": pytest.approx(4.0),
    }


def test_stale_verdicts_are_ignored_when_start_time_is_given() -> None:
    breaker = make(consecutive_failures=1, half_open_probes=1)
    assert breaker.acquire(0)  # a slow call starts while closed
    breaker.on_failure(1)  # another call fails: open until 6
    assert breaker.acquire(6)  # the probe
    breaker.on_success(7, started=0)  # the slow call ends: not a probe verdict
    assert breaker.state(7) is HALF
    assert not breaker.acquire(7)
    breaker.on_abandon(7, started=0)  # nor does its end return a permit
    assert not breaker.acquire(7)
    breaker.on_success(8, started=6)
    assert breaker.state(8) is CLOSED


@pytest.mark.parametrize(
    "field, value",
    [
        ("consecutive_failures", 0),
        ("min_calls", 0),
        ("half_open_probes", 0),
        ("window_s", 0),
        ("cooldown_s", 0),
        ("jitter", 1.0),
    ],
)
def test_settings_reject_nonsense(field: str, value: float) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**{field: value})  # type: ignore[arg-type]


# Acquire twice as often as anything else, so half-open periods see contention.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "acquire", "ok", "fail", "abandon", "throttle", "wait"]),
        st.floats(0.0, 2.0),
    ),
    min_size=20,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, probes=st.integers(1, 3), seed=st.integers(0, 1000))
def test_never_more_than_k_probes_in_flight(
    ops: list[tuple[str, float]], probes: int, seed: int
) -> None:
    """Calls finish in any order and any way; with start times given, a half-open breaker
    never has more than K of its own probes in flight, and an open one admits nothing."""
    config = BreakerSettings(
        consecutive_failures=2, half_open_probes=probes, cooldown_s=0.5, cooldown_max_s=2.0
    )
    now = 0.0
    opened_at = [-1.0]

    def record(old: BreakerState, new: BreakerState, at: float) -> None:
        if new is OPEN:
            opened_at.append(now)

    breaker = Breaker(config, random.Random(seed), on_transition=record)
    rng = random.Random(seed)
    inflight: list[float] = []  # start times of calls not yet finished
    for op, amount in ops:
        now += amount if op == "wait" else 0.01
        state = breaker.state(now)
        if op == "acquire":
            granted = breaker.acquire(now)
            assert not (granted and state is OPEN)
            if granted:
                inflight.append(now)
        elif inflight and op != "wait":
            started = inflight.pop(rng.randrange(len(inflight)))
            if op == "ok":
                breaker.on_success(now, started)
            elif op == "fail":
                breaker.on_failure(now, started)
            elif op == "abandon":
                breaker.on_abandon(now, started)
            else:
                breaker.on_throttle(now, started)
        if breaker.state(now) is HALF:
            # Nothing starts while open, so calls started since the last opening are probes.
            assert sum(1 for t in inflight if t >= opened_at[-1]) <= probes
