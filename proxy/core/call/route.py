"""Routing policy: which deployments may serve a public model for a tier, best first.

Pure: the lead supplies a live ``DeploymentStats`` per deployment key and an injected
``random.Random``; nothing here reads the clock or does I/O.

``rank`` orders the candidates by the tier's strategy, applies the tier's ``max_cost``, and
moves unavailable deployments out. ``degrade`` then decides, from expected waits, whether to
wait for the preferred deployments, step down to allowed backups, or shed early.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..value import value

# Most models cap a reply at 4k-16k tokens; an estimate never counts on more than this unless
# the deployment says so, whatever a client puts in max_tokens.
DEFAULT_MAX_OUTPUT_TOKENS = 4096

STRATEGIES = ("ordered", "cheapest", "best_quality", "least_busy", "lowest_latency", "weighted")


@dataclass(frozen=True)
class Deployment:
    """One way to serve a public model: a provider and its model name, prices in dollars
    per million tokens, a quality score, a routing weight, and the most output tokens an
    estimate may count on (the upstream still decides what it produces)."""

    provider: str
    model: str
    input_cost: float = 0.0
    output_cost: float = 0.0
    quality: float = 0.5
    weight: float = 1.0
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    # The provider's ``service_tier`` a call of each proxy tier is sent with (proxy tier
    # name, provider tier), and the provider tiers' own prices (tier, input, output).
    service_tiers: tuple[tuple[str, str], ...] = ()
    tier_costs: tuple[tuple[str, float, float], ...] = ()
    # The ``priority`` a self-hosted server is sent for a call of each proxy tier (proxy
    # tier name, number), where the candidate says; otherwise derived from the tier order.
    priorities: tuple[tuple[str, int], ...] = ()
    # ``provider/model``: names the deployment in metrics, breakers and headers.
    id: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", f"{self.provider}/{self.model}")

    def service_tier(self, tier: str) -> str | None:
        """The provider tier a call of proxy tier ``tier`` is sent with (None: none)."""
        for name, provider_tier in self.service_tiers:
            if name == tier:
                return provider_tier
        return None

    def priority(self, tier: str, index: int, tiers: int, order: str) -> int:
        """The ``priority`` a call of proxy tier ``tier`` (``index`` of ``tiers``, most
        urgent first) is sent with, to a server that runs ``order`` ("lower" or
        "higher") numbers first: the candidate's own number for the tier, else the tier's
        place (vLLM: 0 for the most urgent; SGLang: the most urgent gets the highest)."""
        for name, number in self.priorities:
            if name == tier:
                return number
        return index if order == "lower" else tiers - 1 - index

    def cost(self, prompt_tokens: int, output_tokens: int,
             service_tier: str | None = None) -> float:
        """Dollars for a call sent with ``service_tier`` (its own price where one is set);
        prices are per million tokens."""
        input_cost, output_cost = self.input_cost, self.output_cost
        if service_tier is not None:
            for name, tier_input, tier_output in self.tier_costs:
                if name == service_tier:
                    input_cost, output_cost = tier_input, tier_output
        return (prompt_tokens * input_cost + output_tokens * output_cost) / 1_000_000

    def output_cap(self, tokens: int) -> int:
        """``tokens`` expected out, capped at what this deployment may produce."""
        cap = self.max_output_tokens
        return cap if cap < tokens else tokens  # a condition, not min(): runs per call


@dataclass(frozen=True)
class Degradation:
    """When a tier's preferred deployments would keep it waiting, serve or shed it instead.

    ``allow`` names the backup deployments by id (empty: every candidate after the first in the
    policy's order is a backup). ``tiers`` limits this to some tier names (empty: all).
    """

    max_wait_s: float
    allow: tuple[str, ...] = ()
    shed_wait_s: float | None = None
    tiers: tuple[str, ...] = ()

    def applies_to(self, tier: str) -> bool:
        return not self.tiers or tier in self.tiers


@dataclass(frozen=True)
class CacheSettings:
    """A model's response cache: answers kept ``ttl_s`` seconds, at most ``max_entries``."""

    ttl_s: float = 300.0
    max_entries: int = 10_000

    def __post_init__(self) -> None:
        if not (self.ttl_s > 0 and self.max_entries >= 1):
            raise ValueError("cache.ttl_s must be positive and cache.max_entries at least 1")


@dataclass(frozen=True)
class SemanticSettings:
    """A model's semantic cache: a call whose last user message is, by the embeddings of
    ``embedding_model``, at least ``threshold`` similar (cosine) to one answered within
    ``ttl_s`` gets that answer; at most ``max_entries`` answers per model."""

    embedding_model: str
    threshold: float = 0.95
    ttl_s: float = 86_400.0
    max_entries: int = 100_000

    def __post_init__(self) -> None:
        if not (0 < self.threshold <= 1 and self.ttl_s > 0 and self.max_entries >= 1):
            raise ValueError("semantic_cache: threshold must be in (0, 1], ttl_s positive "
                             "and max_entries at least 1")


@dataclass(frozen=True)
class ModelRoute:
    name: str
    candidates: tuple[Deployment, ...]
    strategy: str = "ordered"
    tier_strategies: Mapping[str, str] = field(default_factory=dict)
    max_cost: Mapping[str, float] = field(default_factory=dict)
    degradation: Degradation | None = None
    cache: CacheSettings | None = None
    semantic_cache: SemanticSettings | None = None

    def __post_init__(self) -> None:
        for strategy in (self.strategy, *self.tier_strategies.values()):
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")

    def strategy_for(self, tier: str) -> str:
        return self.tier_strategies.get(tier, self.strategy)


@value
class DeploymentStats:
    available: bool
    inflight: int
    limit: int
    ttft_s: float | None
    self_hosted: bool = False  # a server whose own figures set ``limit`` (``engine``)


# A deployment the lead has no stats for is treated as idle and available: unknown is not sick.
_NO_STATS = DeploymentStats(available=True, inflight=0, limit=1, ttft_s=None)


def rank(
    route: ModelRoute,
    tier: str,
    prompt_tokens: int,
    output_tokens: int,
    stats: Mapping[str, DeploymentStats],
    rng: random.Random,
) -> list[Deployment]:
    """The usable deployments for this call, best first.

    Order by the tier's strategy (ties keep the configured order), the emptiest first among
    neighbouring self-hosted candidates of equal standing (``_emptiest_first``); keep those
    within the tier's ``max_cost`` (if none is, keep the single cheapest, so a tight
    ``max_cost`` degrades the call rather than refusing it); then drop the unavailable ones.
    An empty list means every deployment the policy allows is unavailable.
    """
    ordered = _emptiest_first(_order(
        route.strategy_for(tier), route.candidates, stats, rng, prompt_tokens, output_tokens,
        tier), stats)
    max_cost = route.max_cost.get(tier)
    if max_cost is not None:
        def price(d: Deployment) -> float:
            return d.cost(prompt_tokens, output_tokens, d.service_tier(tier))

        affordable = [d for d in ordered if price(d) <= max_cost]
        ordered = affordable if affordable or not ordered else [min(ordered, key=price)]
    return [d for d in ordered if stats.get(d.id, _NO_STATS).available]


def _order(
    strategy: str,
    candidates: Sequence[Deployment],
    stats: Mapping[str, DeploymentStats],
    rng: random.Random,
    prompt_tokens: int,
    output_tokens: int,
    tier: str = "",
) -> list[Deployment]:
    if strategy == "ordered":
        return list(candidates)
    if strategy == "weighted":
        return _weighted_order(candidates, rng)
    if strategy == "cheapest":
        return sorted(candidates, key=lambda d: d.cost(prompt_tokens, output_tokens,
                                                       d.service_tier(tier)))
    if strategy == "best_quality":
        return sorted(candidates, key=lambda d: -d.quality)
    if strategy == "least_busy":
        return sorted(candidates, key=lambda d: _utilisation(stats.get(d.id, _NO_STATS)))
    if strategy == "lowest_latency":
        # Unmeasured first: one call measures it, otherwise it would never get traffic.
        return sorted(candidates, key=lambda d: _latency(stats.get(d.id, _NO_STATS)))
    raise ValueError(f"unknown strategy {strategy!r}")


def _emptiest_first(ordered: list[Deployment],
                    stats: Mapping[str, DeploymentStats]) -> list[Deployment]:
    """Neighbours in ``ordered`` on self-hosted servers, of equal standing (prices and
    quality), sorted by the slots free on their servers by the servers' own figures, most
    first (ties keep their order): load goes where there is room, not in turn."""
    def free(deployment: Deployment) -> int:
        found = stats.get(deployment.id, _NO_STATS)
        return found.limit - found.inflight

    def standing(deployment: Deployment) -> tuple[float, float, float] | None:
        if not stats.get(deployment.id, _NO_STATS).self_hosted:
            return None
        return deployment.input_cost, deployment.output_cost, deployment.quality

    start = 0
    while start < len(ordered):
        end, own = start + 1, standing(ordered[start])
        while own is not None and end < len(ordered) and standing(ordered[end]) == own:
            end += 1
        if end - start > 1:
            ordered[start:end] = sorted(ordered[start:end], key=lambda d: -free(d))
        start = end
    return ordered


def _utilisation(stats: DeploymentStats) -> float:
    return stats.inflight / stats.limit if stats.limit > 0 else math.inf


def _latency(stats: DeploymentStats) -> float:
    return -math.inf if stats.ttft_s is None else stats.ttft_s


def _weighted_order(candidates: Sequence[Deployment], rng: random.Random) -> list[Deployment]:
    """Weighted random order without replacement (Efraimidis-Spirakis): the first pick is
    deployment i with probability weight_i / total; zero weights come last, in order."""

    def draw(deployment: Deployment) -> float:
        if deployment.weight <= 0:
            return math.inf
        # 1 - random() is in (0, 1], so the log is finite.
        return -math.log(1.0 - rng.random()) / deployment.weight

    draws = [(draw(d), index) for index, d in enumerate(candidates)]
    return [candidates[index] for _, index in sorted(draws)]


Action = Literal["wait", "degrade", "shed"]


@value
class Decision:
    """``action`` is "wait" (queue for ``deployments``), "degrade" (serve on the backups
    listed first, preferred ones after) or "shed" (503 now, ``retry_after_s`` later)."""

    action: Action
    deployments: tuple[Deployment, ...]
    retry_after_s: float | None = None


def degrade(
    route: ModelRoute,
    tier: str,
    ranked: Sequence[Deployment],
    expected_wait_s: Mapping[str, float],
) -> Decision:
    """Wait, degrade or shed, given ``rank``'s output and the expected queue wait per
    deployment key (missing: 0). Backups serve only when degrading:

    - no degradation for this model/tier: wait on all of ``ranked``;
    - the best preferred wait <= ``max_wait_s``: wait on the preferred deployments only;
    - the best wait anywhere > ``shed_wait_s``: shed, with that wait as ``retry_after_s``;
    - backups quicker than the best preferred one (always so when no preferred deployment
      is usable): degrade to them, quickest first, with the preferred ones after;
    - otherwise: wait on the preferred deployments.
    """
    policy = route.degradation
    if policy is None or not policy.applies_to(tier) or not ranked:
        return Decision("wait", tuple(ranked))
    waits = {d.id: max(0.0, expected_wait_s.get(d.id, 0.0)) for d in ranked}
    if policy.allow:
        preferred = [d for d in ranked if d.id not in policy.allow]
        backups = [d for d in ranked if d.id in policy.allow]
    else:
        preferred, backups = list(ranked[:1]), list(ranked[1:])
    preferred_wait = min((waits[d.id] for d in preferred), default=math.inf)
    if preferred_wait <= policy.max_wait_s:
        return Decision("wait", tuple(preferred))
    best_wait = min(waits.values())
    if policy.shed_wait_s is not None and best_wait > policy.shed_wait_s:
        return Decision("shed", (), retry_after_s=best_wait)
    quicker = sorted(
        (d for d in backups if waits[d.id] < preferred_wait), key=lambda d: waits[d.id]
    )
    if not quicker:
        return Decision("wait", tuple(preferred))
    return Decision("degrade", (*quicker, *preferred))
