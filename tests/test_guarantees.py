"""The scheduling guarantees docs/policy.md states, each checked as a property over random
workloads replayed through the pure scheduler on a virtual clock (``tests/replay.py``),
side by side with FCFS on the same calls.

Each property draws a seed and the workload's shape; the draws are derandomized so the
suite is repeatable. ``tests/test_scheduler_props.py`` proves the structural invariants
(no slot leaked or idle without a stated hold, concurrency within limits, exact
deadlines under re-tries, pauses and breakers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.trace import SHIPPED_TRACE, read_trace
from proxy.core.scheduling.scheduler import SchedulerSettings
from tests.replay import SHIPPED_TIERS, Job, fcfs, pct, random_tiers, replay, trace_jobs

SETTINGS = SchedulerSettings(tiers=SHIPPED_TIERS)
CHECK = settings(max_examples=30, deadline=None, derandomize=True)


def workload(seed: int, slots: int, n: int, load: Sequence[float], mean_s: float = 2.0,
             longest_s: float = 30.0) -> list[Job]:
    """``n`` calls arriving as a Poisson stream; ``load[t]`` is tier t's offered load in
    busy slots per slot of capacity (their sum above 1 is an overload); service times
    lognormal around ``mean_s``, at most ``longest_s``."""
    rng = random.Random(seed)
    services = [min(rng.lognormvariate(math.log(mean_s) - 0.5, 1.0), longest_s)
                for _ in range(n)]
    total = sum(load)
    rate = total * slots / (sum(services) / n)
    shares = [x / total for x in load]
    at = 0.0
    jobs = []
    for service in services:
        at += rng.expovariate(rate)
        jobs.append(Job(at, rng.choices(range(len(load)), shares)[0], service))
    return jobs


def tier_waits(jobs: Sequence[Job], tier: int) -> list[float]:
    return [j.wait for j in jobs if j.tier == tier]


def test_on_the_real_trace_urgent_calls_go_first() -> None:
    """Ten minutes of the shipped Azure trace (offered load about 34 busy slots) on 28
    slots, tiers drawn 10/20/40/30 %: the two urgent tiers wait (p99) under 0.15x FCFS's,
    and every call is either served or refused with a code."""
    rows = read_trace(SHIPPED_TRACE, 60, 600)
    assert len(rows) > 2500
    tiers = random_tiers(len(rows))
    proxy, baseline = replay(SETTINGS, {"p": 28}, trace_jobs(rows, tiers)), fcfs(
        trace_jobs(rows, tiers), 28)
    for tier in (0, 1):
        assert (pct(tier_waits(proxy.jobs, tier), 0.99)
                <= 0.15 * pct(tier_waits(baseline.jobs, tier), 0.99))
    assert all(math.isfinite(j.start) != (j.code is not None) for j in proxy.jobs)


@CHECK
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([1, 2, 4, 8, 16]),
       overload=st.floats(1.2, 2.0), urgent=st.floats(0.05, 0.3))
def test_urgent_calls_go_first(seed: int, slots: int, overload: float, urgent: float) -> None:
    """Under overload, the most urgent tier's p99 wait is at most 0.15x FCFS's."""
    rest = overload - urgent
    jobs = workload(seed, slots, 400, (urgent, 0.2 * rest, 0.5 * rest, 0.3 * rest))
    proxy, baseline = replay(SETTINGS, {"p": slots}, jobs), fcfs(jobs, slots)
    assert pct(tier_waits(proxy.jobs, 0), 0.99) <= 0.15 * pct(tier_waits(baseline.jobs, 0), 0.99)


@CHECK
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([2, 4, 8, 16]),
       urgent=st.floats(0.1, 0.5), middle=st.floats(0.3, 0.8), rest=st.floats(0.3, 1.0))
def test_a_tier_that_fits_waits_no_longer_than_under_fcfs(
    seed: int, slots: int, urgent: float, middle: float, rest: float
) -> None:
    """A tier whose load, with the more urgent tiers', fits in 90 % of the capacity waits
    (p99) no longer than under FCFS plus one longest call, however overloaded the less
    urgent tiers are: they lend it their turns while it needs them more."""
    middle = min(middle, 0.9 - urgent)
    jobs = workload(seed, slots, 500, (urgent, middle, 0.6 * rest, 0.4 * rest))
    proxy, baseline = replay(SETTINGS, {"p": slots}, jobs), fcfs(jobs, slots)
    longest = max(j.service_s for j in jobs)
    for tier in (0, 1):
        assert (pct(tier_waits(proxy.jobs, tier), 0.99)
                <= pct(tier_waits(baseline.jobs, tier), 0.99) + longest)


@CHECK
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([1, 2, 4]),
       overload=st.floats(1.0, 2.5), tier=st.integers(0, 3))
def test_overtaking_inside_a_tier_is_bounded(seed: int, slots: int, overload: float,
                                            tier: int) -> None:
    """Once a call has used more than 1 - rescue_fraction of its max_wait_s, no call of its
    tier with a later deadline starts before it."""
    settings_ = SchedulerSettings(tiers=SHIPPED_TIERS, tier_promote_after_s=None)
    load = [overload / 4] * 4
    jobs = workload(seed, slots, 400, load)
    replay(settings_, {"p": slots}, jobs)
    max_wait = SHIPPED_TIERS[tier].max_wait_s
    mine = sorted((j for j in jobs if j.tier == tier), key=lambda j: j.at)
    for i, early in enumerate(mine):
        deadline = early.at + max_wait
        at_risk_from = deadline - SETTINGS.rescue_fraction * max_wait
        started = early.start if early.code is None else early.at + early.wait
        for late in mine[i + 1:]:
            if late.code is None and at_risk_from < late.start < started:
                raise AssertionError(f"{late} started before {early}, which was at risk")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([2, 4]),
       urgent=st.floats(1.0, 1.5), low=st.floats(0.02, 0.06))
def test_a_tier_within_its_weighted_share_never_starves(seed: int, slots: int, urgent: float,
                                                       low: float) -> None:
    """The least urgent tier (weight 1 of 15) offers at most its share while the most
    urgent one overloads the provider for longer than the least urgent tier's max_wait_s:
    none of its calls times out."""
    calls = int(1.5 * SHIPPED_TIERS[3].max_wait_s * slots * (urgent + low))  # ~1.5 x 900 s
    jobs = workload(seed, slots, calls, (urgent, 0.0, 0.0, low), mean_s=1.0, longest_s=10.0)
    assert jobs[-1].at > SHIPPED_TIERS[3].max_wait_s
    proxy = replay(SETTINGS, {"p": slots}, jobs)
    assert [j for j in proxy.jobs if j.tier == 3 and j.code] == []


@CHECK
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([1, 4]), overload=st.floats(1.5, 3.0))
def test_deadlines_are_exact(seed: int, slots: int, overload: float) -> None:
    """A call is refused exactly at its tier's max_wait_s, never served after it."""
    jobs = workload(seed, slots, 300, [overload / 4] * 4)
    replay(SETTINGS, {"p": slots}, jobs)
    for job in jobs:
        max_wait = SHIPPED_TIERS[job.tier].max_wait_s
        if job.code == "queue_timeout":
            assert math.isclose(job.wait, max_wait, abs_tol=1e-6)
        else:
            assert job.code is None and job.wait <= max_wait + 1e-9


@CHECK
@given(seed=st.integers(0, 2**16), liar=st.integers(0, 199), claim=st.floats(1e3, 1e9))
def test_a_lying_estimate_moves_only_its_own_call(seed: int, liar: int, claim: float) -> None:
    """One call claims to take ``claim`` seconds. Until its slot comes back it is charged
    at most CLAIM_FACTOR times the provider's mean (the longest level's bound before a
    mean is known), then what it really took: every tier's p50 and p99 wait, the liar
    aside, moves by less than two mean service times (its charge moves the floors and the
    headroom while it runs, and the same calls in another order shift a tail call by
    about a completion)."""
    honest = workload(seed, 4, 200, (0.3, 0.3, 0.4, 0.3))
    lying = [Job(j.at, j.tier, j.service_s, size_s=j.service_s,
                 est_s=claim if i == liar else None) for i, j in enumerate(honest)]
    truthful = [Job(j.at, j.tier, j.service_s, size_s=j.service_s) for j in honest]
    replay(SETTINGS, {"p": 4}, truthful)
    replay(SETTINGS, {"p": 4}, lying)
    mean = sum(j.service_s for j in honest) / len(honest)
    for tier in range(4):
        before = [j.wait for i, j in enumerate(truthful) if j.tier == tier and i != liar]
        after = [j.wait for i, j in enumerate(lying) if j.tier == tier and i != liar]
        for q in (0.5, 0.99):
            assert abs(pct(after, q) - pct(before, q)) < 2.0 * mean
