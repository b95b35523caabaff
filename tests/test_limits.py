from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.health.limits import (
    RateLimits,
    RollingCounts,
    TokenBucket,
    parse_duration,
)


def test_rolling_counts_forget_old_slots() -> None:
    counts = RollingCounts(window_s=10.0, buckets=10)
    counts.add("calls", 0.0)
    counts.add("calls", 5.5, n=2)
    counts.add("errors", 9.9)
    assert counts.total("calls", 9.9) == 3
    assert counts.total("calls", 10.0) == 2  # slot [0, 1) has left the window
    assert counts.total("errors", 18.9) == 1
    assert counts.total("errors", 19.0) == 0  # the slot of 9.9 ([9, 10)) just left
    counts.clear()
    assert counts.total("calls", 18.9) == 0


@settings(max_examples=100, deadline=None)
@given(times=st.lists(st.floats(0.0, 1000.0), max_size=200))
def test_rolling_counts_stay_bounded_and_never_overcount(times: list[float]) -> None:
    counts = RollingCounts(window_s=10.0, buckets=5)
    seen: list[float] = []
    for now in sorted(times):
        counts.add("calls", now)
        seen.append(now)
        # Everything from the last (window - one slot) seconds is in; nothing older than
        # the window is.
        recent = sum(1 for t in seen if now - 8.0 < t)
        within = sum(1 for t in seen if now - 10.0 < t)
        assert recent <= counts.total("calls", now) <= within


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 240).map(lambda q: q / 4),
                                st.sampled_from(["a", "b"]), st.integers(1, 3),
                                st.booleans()), max_size=80))
def test_rolling_counts_count_exactly_the_slots_in_the_window(
        steps: list[tuple[float, str, int, bool]]) -> None:
    """Adds (many within one slot, which take a shortcut) and reads interleaved, against
    the definition: the slots floor(t / slot) within the last ``buckets`` of the read's."""
    counts = RollingCounts(window_s=10.0, buckets=5)
    added: list[tuple[int, str, int]] = []
    for now, name, n, read in sorted(steps):
        if read:
            slot = int(now // 2.0)
            expected = sum(k for s, m, k in added if m == name and s > slot - 5)
            assert counts.total(name, now) == expected
        else:
            counts.add(name, now, n)
            added.append((int(now // 2.0), name, n))
    counts.clear()
    assert counts.total("a", 60.0) == 0


def test_an_add_just_past_a_slot_counts_in_the_next_one() -> None:
    counts = RollingCounts(window_s=10.0, buckets=5)  # slots of 2 s
    counts.add("calls", 1.0)  # slot 0
    counts.add("calls", 2.0)  # slot 1: the shortcut must not take it for slot 0
    assert counts.total("calls", 10.0) == 1  # slot 0 has left the window, slot 1 has not


def test_an_add_at_a_float_slot_boundary_goes_in_the_slot_prune_computes() -> None:
    counts = RollingCounts(1.0, 10)  # slots of 0.1 s: 7.8 / 0.1 is slot 78, 78 * 0.1 > 7.8
    counts.add("x", 7.75)
    counts.add("y", 7.8)
    assert counts.total("y", 8.75) == 1  # slot 77 has left the window, slot 78 has not


def test_an_add_after_a_read_emptied_the_window_is_kept() -> None:
    counts = RollingCounts(10.0, 10)
    counts.add("x", 100.0)
    counts.total("x", 200.0)  # every slot leaves
    counts.add("x", 100.5)  # an earlier reading of the clock, added late
    assert counts.total("x", 100.6) == 1


# Steps: (now, tokens to take, expected wait). A bucket of 60 a minute: one token a second.
BUCKET_STEPS = {
    "starts full and drains": [(0.0, 60, 0.0), (0.0, 1, 1.0)],
    "refills at the rate": [(0.0, 60, 0.0), (10.0, 10, 0.0), (10.0, 1, 1.0)],
    "a refused take takes nothing": [(0.0, 50, 0.0), (0.0, 20, 10.0), (0.0, 10, 0.0)],
    "waiting the reported time is enough": [(0.0, 60, 0.0), (0.0, 30, 30.0), (30.0, 30, 0.0)],
    "never fills past the burst": [(0.0, 1, 0.0), (1000.0, 60, 0.0), (1000.0, 1, 1.0)],
    "larger than the bucket: waits for a full bucket, then goes into debt": [
        (0.0, 30, 0.0),
        (0.0, 100, 30.0),
        (30.0, 100, 0.0),
        (30.0, 1, 41.0),
    ],
    "time going backwards refills nothing": [(10.0, 60, 0.0), (5.0, 1, 1.0)],
}


@pytest.mark.parametrize("steps", BUCKET_STEPS.values(), ids=BUCKET_STEPS.keys())
def test_token_bucket(steps: list[tuple[float, float, float]]) -> None:
    bucket = TokenBucket(rate_per_min=60)
    for now, tokens, wait in steps:
        assert bucket.take(tokens, now) == pytest.approx(wait)


def test_token_bucket_adjust_refunds_and_charges() -> None:
    bucket = TokenBucket(rate_per_min=600, burst=100)
    assert bucket.take(100, 0.0) == 0.0
    bucket.adjust(40, 0.0)  # estimated 100, used 60
    assert bucket.available(0.0) == pytest.approx(40)
    bucket.adjust(-100, 0.0)  # used 100 more than estimated: debt
    assert bucket.available(0.0) == pytest.approx(-60)
    assert bucket.take(10, 0.0) == pytest.approx(7.0)  # 70 tokens at 10/s
    bucket.adjust(1000, 0.0)
    assert bucket.available(0.0) == 100  # capped at the burst


@settings(max_examples=100, deadline=None)
@given(takes=st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(1, 50)), min_size=1, max_size=60))
def test_token_bucket_never_grants_more_than_rate_allows(takes: list[tuple[float, int]]) -> None:
    bucket = TokenBucket(rate_per_min=120)  # 2 a second, burst 120
    now, granted = 0.0, 0
    for gap, tokens in takes:
        now += gap
        if bucket.take(tokens, now) == 0.0:
            granted += tokens
    assert granted <= 120 + 2 * now + 1e-6


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5s", 0.5),
        ("12", 12.0),
        ("1.5", 1.5),
        (" 2S ", 2.0),
        ("", None),
        ("soon", None),
        ("5x", None),
        ("1s junk", None),
        ("-3", None),
        ("m1s", None),
        ("nan", None),
    ],
)
def test_parse_duration(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == (None if seconds is None else pytest.approx(seconds))


def test_rate_limits_rpm_and_tpm() -> None:
    limits = RateLimits(rpm=2, tpm=1000)
    assert limits.take(400, 0.0) == 0.0
    assert limits.take(700, 0.0) == pytest.approx(6.0)  # 100 short at 1000/min
    assert limits.take(500, 0.0) == 0.0  # the refused call took nothing
    assert limits.take(1, 0.0) == pytest.approx(30.0)  # rpm: two a minute
    limits.reconcile(estimated=500, actual=100, now=0.0)  # 400 back
    assert limits.wait_s(400, 30.0) == 0.0


def test_rate_limits_without_local_limits_always_go() -> None:
    limits = RateLimits()
    assert all(limits.take(10**6, 0.0) == 0.0 for _ in range(100))
    limits.reconcile(10, 20, 0.0)
    assert limits.paused_until(0.0) == 0.0


HEADER_CASES = {
    "no requests left: pause until the reset": (
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.5s"},
        10,
        1.5,
    ),
    "no tokens left, minutes format": (
        {"X-RateLimit-Remaining-Tokens": "0", "X-RateLimit-Reset-Tokens": "1m0s"},
        10,
        60.0,
    ),
    "fewer tokens left than the call needs": (
        {"x-ratelimit-remaining-tokens": "50", "x-ratelimit-reset-tokens": "20ms"},
        100,
        0.02,
    ),
    "enough left: go": (
        {"x-ratelimit-remaining-tokens": "5000", "x-ratelimit-reset-tokens": "6m0s"},
        100,
        0.0,
    ),
    "no reset header: the default": ({"x-ratelimit-remaining-requests": "0"}, 1, 1.0),
    "absurd reset: capped": (
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "99h"},
        1,
        120.0,
    ),
    "unreadable remaining: ignored": (
        {"x-ratelimit-remaining-requests": "lots", "x-ratelimit-reset-requests": "9s"},
        1,
        0.0,
    ),
}


@pytest.mark.parametrize("headers, tokens, wait", HEADER_CASES.values(), ids=HEADER_CASES.keys())
def test_observe_headers(headers: dict[str, str], tokens: int, wait: float) -> None:
    limits = RateLimits()
    limits.observe_headers(headers, 0.0)
    assert limits.wait_s(tokens, 0.0) == pytest.approx(wait)
    assert limits.take(tokens, wait) == 0.0  # after the reset, the call goes


def test_paused_until_and_local_spending_of_reported_quota() -> None:
    limits = RateLimits()
    limits.observe_headers(
        {"x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "10s"}, 100.0
    )
    assert limits.paused_until(100.0) == 100.0
    assert limits.take(1, 100.0) == 0.0
    assert limits.take(1, 101.0) == 0.0
    assert limits.paused_until(101.0) == pytest.approx(110.0)  # both used before the reset
    assert limits.take(1, 101.0) == pytest.approx(9.0)
    assert limits.paused_until(110.0) == 110.0


def test_reported_tokens_are_spent_locally_until_the_reset() -> None:
    limits = RateLimits()
    limits.observe_headers(
        {"x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "10s"}, 0.0
    )
    assert limits.take(600, 0.0) == 0.0
    assert limits.take(600, 1.0) == pytest.approx(9.0)
    assert limits.take(400, 1.0) == 0.0
    assert limits.paused_until(1.0) == pytest.approx(10.0)
    limits.reconcile(estimated=1000, actual=700, now=2.0)  # 300 back
    assert limits.take(300, 2.0) == 0.0
    assert limits.take(1, 2.0) == pytest.approx(8.0)


@pytest.mark.parametrize("absurd", [2**62, 10**30, float(2**80)])
def test_one_absurd_number_leaves_a_bucket_at_most_one_refill_in_debt(absurd: float) -> None:
    bucket = TokenBucket(rate_per_min=600)  # 10 a second, burst 600
    assert bucket.take(absurd, 0.0) == 0.0  # a full bucket lets it through once...
    assert bucket.available(0.0) == -600  # ...and the debt stops at -capacity
    assert bucket.take(1, 0.0) == pytest.approx(60.1)
    bucket.adjust(-absurd, 200.0)
    assert bucket.available(200.0) == -600


def test_rate_limits_refund_gives_back_what_take_took() -> None:
    limits = RateLimits(rpm=2, tpm=1000)
    assert limits.take(900, 0.0) == 0.0
    limits.refund(900, 0.0)  # the call never went upstream
    assert limits.take(1000, 0.0) == 0.0
    limits.refund(1000, 0.0, request=False)  # it went, but used nothing
    assert limits.take(1, 0.0) == 0.0  # the second request of two a minute
    assert limits.take(1, 0.0) == pytest.approx(30.0)
