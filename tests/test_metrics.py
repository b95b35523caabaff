"""The children that skip prometheus-client's checks count exactly as its own metrics do."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from proxy.http.base.metrics import SHARED_BUCKETS, ChildCounter, ChildHistogram

BUCKETS = (0.005, 0.1, 1, 2.5, 60)
amounts = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, 0.005, 0.1, 1.0, 2.5, 60.0, math.inf, -math.inf]))


def samples(metric: Counter | Histogram) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in metric.collect() for s in family.samples
            if not s.name.endswith("_created")]


def same(a: list[tuple[str, dict[str, str], float]],
         b: list[tuple[str, dict[str, str], float]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True))


@given(st.lists(amounts, max_size=30))
def test_child_histogram_buckets_and_sum_as_prometheus_does(values: list[float]) -> None:
    ours = ChildHistogram("h", "h", ["tier"], buckets=BUCKETS, registry=CollectorRegistry())
    theirs = Histogram("h", "h", ["tier"], buckets=BUCKETS, registry=CollectorRegistry())
    for value in values:
        ours.labels("a").observe(value)
        theirs.labels("a").observe(value)
    assert same(samples(ours), samples(theirs))


@given(st.lists(st.floats(min_value=0, allow_infinity=True), max_size=30))
def test_child_counter_counts_as_prometheus_does(values: list[float]) -> None:
    ours = ChildCounter("c", "c", ["tier"], registry=CollectorRegistry())
    theirs = Counter("c", "c", ["tier"], registry=CollectorRegistry())
    for value in values:
        ours.labels("a").inc(value)
        theirs.labels("a").inc(value)
    assert same(samples(ours), samples(theirs))


def test_a_parent_a_negative_amount_and_an_exemplar_are_still_checked() -> None:
    counter = ChildCounter("c", "c", ["tier"], registry=CollectorRegistry())
    histogram = ChildHistogram("h", "h", ["tier"], buckets=BUCKETS, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="missing label values"):
        counter.inc()
    with pytest.raises(ValueError, match="missing label values"):
        histogram.observe(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("a").inc(-1)
    histogram.labels("a").observe(0.05, {"trace_id": "abc"})
    exemplars = [s.exemplar for family in histogram.collect() for s in family.samples
                 if s.exemplar is not None]
    assert [e.labels for e in exemplars] == [{"trace_id": "abc"}]


def test_the_admission_histogram_can_tell_a_p99_within_1_ms() -> None:
    """``proxy_shared_admission_seconds`` answers the goal (p99 within 1 ms through Redis):
    1 ms is a bound, none up to 5 ms is more than twice the one below (a quantile read off
    it is off by less than that), a hand-over (no round trip) falls below the first, and
    the whole stays small (one series a bound)."""
    fine = [bound for bound in SHARED_BUCKETS if bound <= 0.005]
    assert 0.001 in SHARED_BUCKETS and SHARED_BUCKETS[0] <= 0.0001
    assert all(high <= 2 * low for low, high in itertools.pairwise(fine))
    assert list(SHARED_BUCKETS) == sorted(SHARED_BUCKETS) and len(SHARED_BUCKETS) <= 16
