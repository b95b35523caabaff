from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.retry import RetryAllowance, backoff_s, parse_retry_after


def test_retry_allowance_allows_its_ratio() -> None:
    allowance = RetryAllowance(ratio=0.2, min_per_s=0.0, window_s=10.0)
    for _ in range(10):
        allowance.on_call(0.0)
    assert [allowance.try_retry(0.0) for _ in range(4)] == [True, True, False, False]
    assert allowance.available(0.0) == 0.0


def test_a_quiet_provider_can_still_retry_once() -> None:
    allowance = RetryAllowance(ratio=0.2, min_per_s=0.1, window_s=10.0)
    allowance.on_call(0.0)
    assert allowance.try_retry(0.0)
    assert not allowance.try_retry(0.0)


def test_retry_allowance_recovers_as_the_window_moves() -> None:
    allowance = RetryAllowance(ratio=0.5, min_per_s=0.0, window_s=10.0)
    allowance.on_call(0.0)
    allowance.on_call(0.0)
    assert allowance.try_retry(0.0)
    assert not allowance.try_retry(5.0)
    allowance.on_call(12.0)
    allowance.on_call(12.0)
    assert allowance.try_retry(12.0)  # the old calls and the old retry have both left


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["call", "retry"]), st.floats(0.0, 9.999)), max_size=200
    ),
    ratio=st.sampled_from([0.0, 0.1, 0.2, 0.5]),
    min_per_s=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_retries_never_exceed_the_ratio_within_a_window(
    events: list[tuple[str, float]], ratio: float, min_per_s: float
) -> None:
    """Within one window, granted retries <= ratio * calls + the reserve floor."""
    allowance = RetryAllowance(ratio=ratio, min_per_s=min_per_s, window_s=10.0)
    calls = retries = 0
    for kind, now in sorted(events, key=lambda e: e[1]):
        if kind == "call":
            allowance.on_call(now)
            calls += 1
        elif allowance.try_retry(now):
            retries += 1
        assert retries <= ratio * calls + min_per_s * 10.0 + 1e-9


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.booleans(), st.floats(0.0, 4.0), st.integers(0, 3)), min_size=1, max_size=200
    ),
    ratio=st.sampled_from([0.0, 0.1, 0.2, 0.5, 1.0]),
    min_per_s=st.sampled_from([0.0, 0.1, 0.35]),
)
def test_retries_stay_within_the_ratio_over_any_run(
    events: list[tuple[bool, float, int]], ratio: float, min_per_s: float
) -> None:
    """Over a run of any length, retries <= ratio * calls + one reserve per window started.

    Credit cannot be spent twice: a retry stays in the window at least as long as the calls
    that paid for it."""
    allowance = RetryAllowance(ratio=ratio, min_per_s=min_per_s, window_s=10.0)
    now, calls, retries = 0.0, 0, 0
    for is_call, gap, wanted in events:
        now += gap
        if is_call:
            allowance.on_call(now)
            calls += 1
        retries += sum(allowance.try_retry(now) for _ in range(wanted))
    windows = now // 10.0 + 1
    assert retries <= ratio * calls + min_per_s * 10.0 * windows + 1e-9


@pytest.mark.parametrize("rate_per_s", [0.2, 1.0, 10.0, 100.0])
def test_amplification_under_an_always_failing_upstream(rate_per_s: float) -> None:
    """Each call fails and would retry twice: attempts per call approach 1 + ratio."""
    rng = random.Random(1)
    allowance = RetryAllowance()
    now, calls, attempts = 0.0, 0, 0
    while now < 300.0:
        now += rng.expovariate(rate_per_s)
        allowance.on_call(now)
        calls += 1
        attempts += 1 + sum(allowance.try_retry(now) for _ in range(2))
    assert attempts / calls <= 1.2 + 0.1 * 10.0 * (300.0 / 10.0 + 1) / calls + 1e-9


@pytest.mark.parametrize("attempt, ceiling", [(1, 0.25), (2, 0.5), (3, 1.0), (6, 8.0), (50, 8.0)])
def test_backoff_full_jitter_bounds(attempt: int, ceiling: float) -> None:
    rng = random.Random(7)
    delays = [backoff_s(attempt, rng) for _ in range(2000)]
    assert all(0.0 <= d <= ceiling for d in delays)
    assert max(delays) > 0.9 * ceiling and min(delays) < 0.1 * ceiling  # spread, not fixed


@settings(max_examples=200, deadline=None)
@given(
    attempt=st.integers(0, 10_000),
    retry_after=st.none() | st.floats(-5.0, 1000.0),
    seed=st.integers(0, 2**32),
)
def test_backoff_honours_retry_after_up_to_its_cap(
    attempt: int, retry_after: float | None, seed: int
) -> None:
    delay = backoff_s(attempt, random.Random(seed), retry_after_s=retry_after)
    assert 0.0 <= delay <= 60.0
    if retry_after is not None:
        assert delay >= min(max(retry_after, 0.0), 60.0)


WALL = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC

RETRY_AFTER = {
    "milliseconds win": ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
    "seconds": ({"Retry-After": "3"}, 3.0),
    "fractional seconds": ({"retry-after": "0.25"}, 0.25),
    "HTTP date": ({"retry-after": "Tue, 14 Nov 2023 22:13:50 GMT"}, 30.0),
    "HTTP date in the past": ({"retry-after": "Tue, 14 Nov 2023 22:00:00 GMT"}, 0.0),
    "HTTP date with -0000 zone": ({"retry-after": "Tue, 14 Nov 2023 22:13:30 -0000"}, 10.0),
    "bad milliseconds fall back to seconds": ({"retry-after-ms": "x", "retry-after": "2"}, 2.0),
    "negative": ({"retry-after": "-1"}, None),
    "garbage": ({"retry-after": "later"}, None),
    "absent": ({}, None),
    "infinite": ({"retry-after": "inf"}, None),
}


@pytest.mark.parametrize("headers, seconds", RETRY_AFTER.values(), ids=RETRY_AFTER.keys())
def test_parse_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    got = parse_retry_after(headers, wall_now=WALL)
    assert got == (None if seconds is None else pytest.approx(seconds))


def test_an_http_date_needs_the_wall_clock() -> None:
    assert parse_retry_after({"retry-after": "Tue, 14 Nov 2023 22:13:50 GMT"}) is None
