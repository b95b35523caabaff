from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.route import (
    STRATEGIES,
    Decision,
    Degradation,
    Deployment,
    DeploymentStats,
    ModelRoute,
    degrade,
    rank,
)
from proxy.core.health.breaker import Breaker, BreakerSettings, BreakerState

PREMIUM = Deployment("premium", "big", input_cost=5.0, output_cost=15.0, quality=0.95)
MID = Deployment("mid", "medium", input_cost=1.0, output_cost=2.0, quality=0.80)
BUDGET = Deployment("budget", "small", input_cost=0.10, output_cost=0.40, quality=0.60)
FREE = Deployment("sim", "sim-small")  # no price, default quality 0.5
ALL = (PREMIUM, MID, BUDGET, FREE)


def stats(
    available: bool = True, inflight: int = 0, limit: int = 10, ttft_s: float | None = None
) -> DeploymentStats:
    return DeploymentStats(available, inflight, limit, ttft_s)


def keys(deployments: list[Deployment] | tuple[Deployment, ...]) -> list[str]:
    return [d.id for d in deployments]


def test_deployment_key_and_cost() -> None:
    assert PREMIUM.id == "premium/big"
    # 1,000 prompt tokens at $5/M + 500 output tokens at $15/M
    assert PREMIUM.cost(1000, 500) == pytest.approx(0.005 + 0.0075)
    assert FREE.cost(10**6, 10**6) == 0.0


RANKS = {
    "ordered keeps the configured order": ("ordered", {}, ALL),
    "cheapest by estimated cost": ("cheapest", {}, (FREE, BUDGET, MID, PREMIUM)),
    "best_quality": ("best_quality", {}, (PREMIUM, MID, BUDGET, FREE)),
    "least_busy by utilisation, not raw inflight": (
        "least_busy",
        {
            PREMIUM.id: stats(inflight=5, limit=10),  # 50 %
            MID.id: stats(inflight=1, limit=2),  # 50 %, later in the list
            BUDGET.id: stats(inflight=9, limit=100),  # 9 %
            FREE.id: stats(inflight=1, limit=1),  # 100 %
        },
        (BUDGET, PREMIUM, MID, FREE),
    ),
    "least_busy: zero limit last, no stats counts as idle": (
        "least_busy",
        {PREMIUM.id: stats(limit=0), MID.id: stats(inflight=3)},
        (BUDGET, FREE, MID, PREMIUM),
    ),
    "lowest_latency, unmeasured first to get measured": (
        "lowest_latency",
        {PREMIUM.id: stats(ttft_s=0.9), MID.id: stats(ttft_s=0.2), BUDGET.id: stats(ttft_s=0.5)},
        (FREE, MID, BUDGET, PREMIUM),
    ),
    "unavailable ones are moved out, whatever the strategy": (
        "cheapest",
        {FREE.id: stats(available=False), MID.id: stats(available=False)},
        (BUDGET, PREMIUM),
    ),
    "everything unavailable gives an empty list": (
        "best_quality",
        {d.id: stats(available=False) for d in ALL},
        (),
    ),
}


@pytest.mark.parametrize("strategy, live, expected", RANKS.values(), ids=RANKS.keys())
def test_rank_by_strategy(
    strategy: str, live: dict[str, DeploymentStats], expected: tuple[Deployment, ...]
) -> None:
    route = ModelRoute("chat", ALL, strategy=strategy)
    assert keys(rank(route, "normal", 1000, 500, live, random.Random(0))) == keys(expected)


def test_cheapest_depends_on_the_call_shape() -> None:
    # Cheap input, dear output versus the opposite: long prompts favour one, long answers the other.
    reader = Deployment("a", "reader", input_cost=0.1, output_cost=10.0)
    writer = Deployment("b", "writer", input_cost=10.0, output_cost=0.1)
    route = ModelRoute("m", (reader, writer), strategy="cheapest")
    assert keys(rank(route, "normal", 10_000, 10, {}, random.Random(0))) == keys([reader, writer])
    assert keys(rank(route, "normal", 10, 10_000, {}, random.Random(0))) == keys([writer, reader])


TIERED = ModelRoute(
    "chat",
    ALL,
    strategy="ordered",
    tier_strategies={"critical": "best_quality", "low": "cheapest"},
)


@pytest.mark.parametrize(
    "tier, first",
    [("critical", PREMIUM), ("high", PREMIUM), ("normal", PREMIUM), ("low", FREE)],
)
def test_per_tier_strategy_overrides(tier: str, first: Deployment) -> None:
    assert rank(TIERED, tier, 100, 100, {}, random.Random(0))[0] == first


def test_tier_override_ignores_the_default_for_that_tier_only() -> None:
    route = ModelRoute("m", ALL, strategy="cheapest", tier_strategies={"critical": "best_quality"})
    assert rank(route, "critical", 100, 100, {}, random.Random(0))[0] == PREMIUM
    assert rank(route, "normal", 100, 100, {}, random.Random(0))[0] == FREE


MAX_COST = {
    # 1,000 + 1,000 tokens: premium $0.02, mid $0.003, budget $0.0005, sim $0
    "the budget filters out dear deployments": (
        ("ordered", 0.003, {}),
        (MID, BUDGET, FREE),
    ),
    "no budget for this tier: no filter": (
        ("ordered", None, {}),
        ALL,
    ),
    "a budget does not resurrect unavailable deployments": (
        ("ordered", 0.003, {BUDGET.id: stats(available=False)}),
        (MID, FREE),
    ),
    "within budget but all down: empty, not a dearer one": (
        (
            "ordered",
            0.003,
            {k: stats(available=False) for k in (MID.id, BUDGET.id, FREE.id)},
        ),
        (),
    ),
}


@pytest.mark.parametrize("case, expected", MAX_COST.values(), ids=MAX_COST.keys())
def test_max_cost(
    case: tuple[str, float | None, dict[str, DeploymentStats]], expected: tuple[Deployment, ...]
) -> None:
    strategy, budget, live = case
    max_cost = {} if budget is None else {"low": budget}
    route = ModelRoute("m", ALL, strategy=strategy, max_cost=max_cost)
    assert keys(rank(route, "low", 1000, 1000, live, random.Random(0))) == keys(expected)


@pytest.mark.parametrize(
    "live, expected",
    [
        ({}, [BUDGET]),
        # The budget is policy, not availability: the cheapest stays the only choice.
        ({BUDGET.id: stats(available=False)}, []),
    ],
)
def test_nothing_within_budget_keeps_the_single_cheapest(
    live: dict[str, DeploymentStats], expected: list[Deployment]
) -> None:
    route = ModelRoute("m", (PREMIUM, MID, BUDGET), strategy="best_quality", max_cost={"low": 1e-4})
    assert rank(route, "low", 1000, 1000, live, random.Random(0)) == expected


def test_weighted_picks_first_in_proportion_to_weight() -> None:
    heavy = Deployment("a", "heavy", weight=3.0)
    light = Deployment("b", "light", weight=1.0)
    never = Deployment("c", "never", weight=0.0)
    route = ModelRoute("m", (never, light, heavy), strategy="weighted")
    rng = random.Random(42)
    firsts = Counter(rank(route, "normal", 1, 1, {}, rng)[0].id for _ in range(4000))
    assert firsts[never.id] == 0
    assert firsts[heavy.id] / 4000 == pytest.approx(0.75, abs=0.03)


def test_weighted_puts_zero_weights_last() -> None:
    route = ModelRoute(
        "m", (Deployment("a", "zero", weight=0.0), Deployment("b", "one")), strategy="weighted"
    )
    assert keys(rank(route, "normal", 1, 1, {}, random.Random(1))) == ["b/one", "a/zero"]


@settings(max_examples=200, deadline=None)
@given(
    strategy=st.sampled_from(STRATEGIES),
    down=st.sets(st.sampled_from([d.id for d in ALL])),
    budget=st.none() | st.floats(0.0, 0.05),
    seed=st.integers(0, 1000),
)
def test_rank_returns_available_candidates_without_duplicates(
    strategy: str, down: set[str], budget: float | None, seed: int
) -> None:
    route = ModelRoute(
        "m", ALL, strategy=strategy, max_cost={} if budget is None else {"normal": budget}
    )
    live = {d.id: stats(available=d.id not in down, ttft_s=0.1) for d in ALL}
    ranked = rank(route, "normal", 1000, 1000, live, random.Random(seed))
    assert len(set(keys(ranked))) == len(ranked)
    assert all(d in ALL and d.id not in down for d in ranked)
    if budget is None:
        assert len(ranked) == len(ALL) - len(down)


def test_unknown_strategy_is_rejected() -> None:
    with pytest.raises(ValueError, match="strategy"):
        ModelRoute("m", ALL, strategy="fastest")
    with pytest.raises(ValueError, match="strategy"):
        ModelRoute("m", ALL, tier_strategies={"low": "random"})


def test_a_model_with_no_enabled_candidates_ranks_empty() -> None:
    route = ModelRoute("m", (), max_cost={"low": 0.01})
    assert rank(route, "low", 1, 1, {}, random.Random(0)) == []


# Degradation: premium preferred; budget and sim are the allowed backups for normal/low.
POLICY = Degradation(
    max_wait_s=10.0, allow=(BUDGET.id, FREE.id), shed_wait_s=60.0, tiers=("normal", "low")
)
ROUTE = ModelRoute("m", (PREMIUM, BUDGET, FREE), degradation=POLICY)

DEGRADE = {
    "short preferred wait: wait on the preferred only": (
        "normal",
        {PREMIUM.id: 3.0, BUDGET.id: 0.0},
        Decision("wait", (PREMIUM,)),
    ),
    "long preferred wait, quick backup: degrade, quickest backup first": (
        "normal",
        {PREMIUM.id: 30.0, BUDGET.id: 5.0, FREE.id: 1.0},
        Decision("degrade", (FREE, BUDGET, PREMIUM)),
    ),
    "backups no quicker than the preferred: wait": (
        "normal",
        {PREMIUM.id: 30.0, BUDGET.id: 30.0, FREE.id: 40.0},
        Decision("wait", (PREMIUM,)),
    ),
    "only quicker backups are offered": (
        "low",
        {PREMIUM.id: 30.0, BUDGET.id: 50.0, FREE.id: 20.0},
        Decision("degrade", (FREE, PREMIUM)),
    ),
    "every wait beyond shed_wait_s: shed with the shortest wait as retry-after": (
        "normal",
        {PREMIUM.id: 300.0, BUDGET.id: 90.0, FREE.id: 120.0},
        Decision("shed", (), retry_after_s=90.0),
    ),
    "a tier the policy does not cover: wait on everything ranked": (
        "critical",
        {PREMIUM.id: 300.0, BUDGET.id: 90.0, FREE.id: 120.0},
        Decision("wait", (PREMIUM, BUDGET, FREE)),
    ),
    "missing waits count as zero": (
        "normal",
        {},
        Decision("wait", (PREMIUM,)),
    ),
}


@pytest.mark.parametrize("tier, waits, expected", DEGRADE.values(), ids=DEGRADE.keys())
def test_degrade(tier: str, waits: dict[str, float], expected: Decision) -> None:
    assert degrade(ROUTE, tier, list(ROUTE.candidates), waits) == expected


def test_degrade_when_the_preferred_deployment_is_down() -> None:
    ranked = rank(ROUTE, "normal", 10, 10, {PREMIUM.id: stats(available=False)}, random.Random(0))
    decision = degrade(ROUTE, "normal", ranked, {BUDGET.id: 2.0, FREE.id: 4.0})
    assert decision == Decision("degrade", (BUDGET, FREE))


def test_degrade_with_an_empty_allow_list_treats_the_rest_as_backups() -> None:
    route = ModelRoute(
        "m", (PREMIUM, MID, BUDGET), degradation=Degradation(max_wait_s=5.0, shed_wait_s=None)
    )
    ranked = list(route.candidates)
    assert degrade(route, "high", ranked, {PREMIUM.id: 1.0}) == Decision("wait", (PREMIUM,))
    assert degrade(route, "high", ranked, {PREMIUM.id: 9.0, MID.id: 20.0}) == Decision(
        "degrade", (BUDGET, PREMIUM)
    )
    assert degrade(route, "high", ranked, {k: 1e6 for k in keys(ranked)}) == Decision(
        "wait", (PREMIUM,)
    )


def test_degrade_without_a_policy_or_candidates_waits() -> None:
    plain = ModelRoute("m", ALL)
    assert degrade(plain, "low", list(ALL), {PREMIUM.id: 1e6}) == Decision("wait", ALL)
    assert degrade(ROUTE, "normal", [], {}) == Decision("wait", ())


@settings(max_examples=200, deadline=None)
@given(
    waits=st.dictionaries(
        st.sampled_from([PREMIUM.id, BUDGET.id, FREE.id]), st.floats(0.0, 500.0)
    ),
    tier=st.sampled_from(["critical", "normal", "low"]),
)
def test_degrade_never_offers_more_than_ranked_nor_sheds_what_could_go_soon(
    waits: dict[str, float], tier: str
) -> None:
    ranked = list(ROUTE.candidates)
    decision = degrade(ROUTE, tier, ranked, waits)
    assert set(decision.deployments) <= set(ranked)
    best = min(waits.get(d.id, 0.0) for d in ranked)
    if decision.action == "shed":
        assert best > 60.0 and decision.retry_after_s == best
    if best <= POLICY.max_wait_s:
        assert decision.action == "wait" or decision.deployments[0].id in POLICY.allow


@dataclass
class Run:
    primary_calls: list[float]
    failed_for_client: int
    primary_state: BreakerState


def route_around(dead_until: float, duration: float = 120.0) -> Run:
    """Calls every 0.1 s on an ordered (primary, backup) route; the primary refuses every
    connection until ``dead_until``. A refused call falls over to the next candidate at once.
    Breakers are the real ones with default settings."""
    primary = Deployment("primary", "m")
    backup = Deployment("backup", "m")
    route = ModelRoute("m", (primary, backup))
    rng = random.Random(3)
    breakers = {d.id: Breaker(BreakerSettings(), rng) for d in route.candidates}
    primary_calls: list[float] = []
    failed_for_client = 0
    now = 0.0
    while now < duration:
        live = {
            key: DeploymentStats(b.available(now), 0, 10, None)
            for key, b in breakers.items()
        }
        served = False
        for deployment in rank(route, "normal", 100, 100, live, rng):
            breaker = breakers[deployment.id]
            if not breaker.acquire(now):
                continue
            if deployment is primary:
                primary_calls.append(now)
                if now < dead_until:
                    breaker.on_failure(now, started=now)
                    continue
            breaker.on_success(now, started=now)
            served = True
            break
        failed_for_client += not served
        now = round(now + 0.1, 6)
    return Run(primary_calls, failed_for_client, breakers[primary.id].state(now))


def test_a_dead_primary_is_routed_around_within_five_calls() -> None:
    result = route_around(dead_until=math.inf)
    calls = result.primary_calls
    # Detected after 5 consecutive failures: 0.4 s at 10 calls a second.
    assert calls[:5] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    # Then single probes, one per cooldown: 5, 10, 20, 40 s, each jittered by ±20 % and
    # rounded up to the next 0.1 s tick; the next (60 s) would fall after the run.
    probes = calls[5:]
    gaps = [b - a for a, b in itertools.pairwise([calls[4], *probes])]
    assert len(gaps) == 4
    for gap, base in zip(gaps, [5.0, 10.0, 20.0, 40.0], strict=True):
        assert base * 0.8 <= gap <= base * 1.2 + 0.1
    assert result.failed_for_client == 0  # every call fell over to the backup in time


def test_a_recovered_primary_gets_its_traffic_back_at_the_next_probe() -> None:
    result = route_around(dead_until=30.0, duration=120.0)
    calls = result.primary_calls
    assert result.primary_state is BreakerState.CLOSED
    # Probes at about 5, 15, 35 s: traffic returns with the first probe after 30 s.
    back = next(t for t in calls if t >= 30.0)
    assert back <= 30.0 + 20.0 * 1.2
    assert all(b - a == pytest.approx(0.1) for a, b in itertools.pairwise(calls) if a > back)
    assert result.failed_for_client == 0
