"""What the scoreboard's scenarios are built of: the ``Scenario`` itself, the routing table
(``table``, ``self_hosted``) and the seeded draws of calls (``call``, ``flows`` and the
sizes they draw), with the defaults ``scenarios`` describes.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import Config, parse_config
from ..config.trace import TraceCall

TOKENS_PER_S = 100.0
SHIPPED_TIERS: tuple[dict[str, object], ...] = (
    {"name": "critical", "weight": 8, "max_wait_s": 10},
    {"name": "high", "weight": 4, "max_wait_s": 30},
    {"name": "normal", "weight": 2, "max_wait_s": 120},
    {"name": "low", "weight": 1, "max_wait_s": 900},
)
# The benchmark's model of a hosted provider for the real traces: first token after
# 0.2 s, 10k prompt tokens and 40 output tokens a second.
TRACE_TIMING: dict[str, object] = {"ttft_s": 0.2, "prefill_tokens_per_s": 10_000,
                                   "tokens_per_s": 40}
TRACE_PRIORS: dict[str, object] = {"ttft_s": 0.2, "prefill_seconds_per_token": 0.0001,
                                   "seconds_per_token": 0.025}


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    table: dict[str, object]  # the routing table, as routing.yaml would hold it
    calls: tuple[TraceCall, ...]
    light_key: str | None = None  # its p90 wait is bounded beside another key's burst
    weighted_keys: tuple[str, str] | None = None  # (heavier, lighter): served 2-4x
    low_within: tuple[str, float] | None = None  # (tier, s): half its calls served by then
    notes: tuple[str, ...] = field(default=())

    @functools.cached_property
    def config(self) -> Config:
        return parse_config(self.table, {})


def config(slots: int | dict[str, int], tiers: Sequence[dict[str, object]] = SHIPPED_TIERS,
           keys: Sequence[Mapping[str, object]] = (), scheduler: dict[str, object] | None = None,
           timing: Mapping[str, object] | None = None,
           priors: Mapping[str, object] | None = None) -> Config:
    """``table(...)``, parsed."""
    return parse_config(table(slots, tiers, keys, scheduler, timing, priors), {})


def table(slots: int | dict[str, int], tiers: Sequence[dict[str, object]] = SHIPPED_TIERS,
          keys: Sequence[Mapping[str, object]] = (), scheduler: dict[str, object] | None = None,
          timing: Mapping[str, object] | None = None,
          priors: Mapping[str, object] | None = None) -> dict[str, object]:
    """A routing table with one model ``m`` whose candidates are the providers, in order;
    key ``k`` authenticates with ``secret-k``."""
    pools = slots if isinstance(slots, dict) else {"p": slots}
    simulate = timing or {"ttft_s": 0.0, "tokens_per_s": TOKENS_PER_S}
    data: dict[str, object] = {
        "tiers": list(tiers),
        "scheduler": {"max_queue": 100_000, **(scheduler or {})},
        "classify": {"default_tier": str(tiers[len(tiers) // 2]["name"]),
                     **({"keys": [{"key": f"secret-{k['name']}", **k} for k in keys]}
                        if keys else {})},
        "providers": [{"name": name, "kind": "simulated", "max_concurrency": limit,
                       "simulate": {"max_output_tokens": 1_000_000,
                                    **({k: v for k, v in simulate.items() if k != "capacity"}),
                                    **({"capacity": simulate["capacity"]}
                                       if "capacity" in simulate and name == "p" else {})}}
                      for name, limit in pools.items()],
        "models": {"m": [{"provider": name, "model": "x", "max_output_tokens": 1_000_000}
                         for name in pools]},
        "estimate": dict(priors) if priors else {
            "ttft_s": 0.0, "seconds_per_token": 1 / TOKENS_PER_S,
            "prefill_seconds_per_token": 0.0},
    }
    return data


def call(t: float, service_s: float, tier: str, key: str | None = None,
         claims_s: float | None = None) -> TraceCall:
    """A call of ``service_s`` on the default timing; ``claims_s``: what its max_tokens
    says it may take (default: the truth)."""
    tokens = max(1, round(service_s * TOKENS_PER_S))
    asked = tokens if claims_s is None else max(1, round(claims_s * TOKENS_PER_S))
    return TraceCall(t, 0, tokens, tier=tier, key=key, max_tokens=max(asked, tokens))


def draws(base: int, seed: int) -> random.Random:
    """The random draws of a scenario built on ``base``: seed 0 the scoreboard's own calls,
    any other seed other calls of the same shape."""
    return random.Random(base if not seed else f"{base}/{seed}")


def poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times: list[float] = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)


def flows(rng: random.Random, spec: Sequence[tuple[str, float, Callable[[], float]]],
          start: float, end: float, key: str | None = None) -> list[TraceCall]:
    """Poisson flows: (tier, calls per second, a draw of the service time)."""
    out = [call(t, size(), tier, key) for tier, rate, size in spec
           for t in poisson(rng, rate, start, end)]
    return sorted(out, key=lambda c: c.t)


def lognormal(rng: random.Random, mean: float, sigma: float, cap: float) -> Callable[[], float]:
    mu = math.log(mean) - sigma * sigma / 2
    return lambda: min(rng.lognormvariate(mu, sigma), cap)


def fixed(seconds: float) -> Callable[[], float]:
    return lambda: seconds


def self_hosted(pools: dict[str, dict[str, object]], **settings: object) -> dict[str, object]:
    """``table`` for self-hosted servers: each pool's provider gets ``pools[name]`` (its
    ``engine``, ``max_concurrency``, ``slots`` and ``slows_past``) in place of a number."""
    data = table(dict.fromkeys(pools, 1), **settings)  # type: ignore[arg-type]
    providers = data["providers"]
    assert isinstance(providers, list)
    for provider in providers:
        given = dict(pools[provider["name"]])
        provider.pop("max_concurrency")
        for key in ("slots", "slows_past"):
            if key in given:
                provider["simulate"][key] = given.pop(key)
        provider.update(given)
    return data
