"""The long-lived objects of one running proxy, built from a Config in one place."""

from __future__ import annotations

import asyncio
import functools
import random
import zoneinfo
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..config import Config, Provider
from ..core.breaker import Breaker, State
from ..core.clock import Clock
from ..core.estimate import LatencyModel, OutputEstimator
from ..core.limits import AdaptiveConcurrency, ProviderLimits
from ..core.retry import RetryBudget
from ..core.route import Deployment, DeploymentStats
from ..core.scheduler import Scheduler
from ..core.schedules import Schedule, active, next_change
from ..core.tokens import TokenCounter
from .admission import Admission
from .auth import Authenticator
from .metrics import Metrics
from .upstream import Upstream

BREAKER_GAUGE = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}


@dataclass
class ProviderRuntime:
    config: Provider
    upstream: Upstream
    concurrency: AdaptiveConcurrency
    budget: RetryBudget
    limits: ProviderLimits


class Service:
    def __init__(
        self,
        config: Config,
        upstreams: Mapping[str, Upstream],
        clock: Clock,
        counter: TokenCounter,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.counter = counter
        self.metrics = metrics or Metrics()
        self.rng = rng or random.Random()
        self.auth = Authenticator(config.keys, config.auth_required)
        self.key_limits = {
            key.name: ProviderLimits(key.principal.rpm, key.principal.tpm)
            for key in config.keys
            if key.principal.rpm is not None or key.principal.tpm is not None
        }
        self.providers = {
            name: ProviderRuntime(
                config=provider,
                upstream=upstreams[name],
                concurrency=AdaptiveConcurrency(provider.max_concurrency),
                budget=RetryBudget(ratio=config.retry.budget),
                limits=ProviderLimits(provider.rpm, provider.tpm),
            )
            for name, provider in config.providers.items()
        }
        self.scheduler = Scheduler(
            config.scheduler, {name: p.max_concurrency for name, p in config.providers.items()}
        )
        self.admission = Admission(self.scheduler, clock)
        self.breakers: dict[str, Breaker] = {}
        for route in config.models.values():
            for deployment in route.candidates:
                if deployment.id not in self.breakers:
                    self.breakers[deployment.id] = self._breaker(deployment.provider,
                                                                  deployment.id)
        self._resume: dict[str, asyncio.TimerHandle] = {}
        self._schedule_timer: asyncio.TimerHandle | None = None
        self.schedule: Schedule | None = None
        priors = config.estimate
        self.outputs = OutputEstimator(prior=priors.output_tokens)
        self.latency = LatencyModel(
            ttft_prior_s=priors.ttft_s,
            seconds_per_token_prior=priors.seconds_per_token,
            prefill_seconds_per_token=priors.prefill_seconds_per_token,
        )
        for name, provider in config.providers.items():
            self.metrics.limit.get(name).set(provider.max_concurrency)
        for index, tier in enumerate(config.tiers):
            self.metrics.queue_depth.get(tier.name).set_function(
                functools.partial(self.scheduler.depth, index)
            )
        for name in config.providers:
            self.metrics.inflight.get(name).set_function(
                functools.partial(self.scheduler.inflight, name)
            )

    def _breaker(self, provider: str, key: str) -> Breaker:
        gauge = self.metrics.breaker_state.get(provider, key)
        transitions = self.metrics.breaker_transitions

        def on_transition(old: State, new: State) -> None:
            gauge.set(BREAKER_GAUGE[new])
            transitions.get(key, new.value).inc()

        gauge.set(0)
        return Breaker(self.config.providers[provider].breaker, self.rng, on_transition)

    def deployment_stats(
        self, deployments: Iterable[Deployment], now: float
    ) -> dict[str, DeploymentStats]:
        stats: dict[str, DeploymentStats] = {}
        for deployment in deployments:
            key, provider = deployment.id, deployment.provider
            breaker = self.breakers[key]
            stats[key] = DeploymentStats(
                available=breaker.available(now),
                inflight=self.scheduler.inflight(provider),
                limit=self.scheduler.capacity(provider),
                ttft_s=self.latency.expect_ttft_s(key),
                retry_at=breaker.retry_at(now),
            )
        return stats

    def expected_wait_s(self, deployment: Deployment, tier: int, service_s: float) -> float:
        """A rough queue wait for a new call of ``tier`` on ``deployment``'s provider: the
        calls queued at that tier or more urgent ones, each about ``service_s`` long, shared
        by the provider's slots."""
        provider = deployment.provider
        capacity = max(self.scheduler.capacity(provider), 1)
        ahead = sum(self.scheduler.depth(t) for t in range(tier + 1))
        if not ahead and self.scheduler.inflight(provider) < capacity:
            return 0.0
        return (ahead + 1) * service_s / capacity

    def set_limit(self, provider: str, limit: int) -> None:
        self.metrics.limit.get(provider).set(limit)
        self.admission.set_capacity(provider, limit)

    def pause(self, provider: str, seconds: float) -> None:
        """Dispatch nothing to ``provider`` for ``seconds`` (rate limits, quota resets)."""
        loop = asyncio.get_running_loop()
        current = self._resume.get(provider)
        if current is not None:
            if current.when() >= loop.time() + seconds:
                return
            current.cancel()
        self.admission.set_available(provider, False)
        self._resume[provider] = loop.call_later(seconds, self._unpause, provider)

    def _unpause(self, provider: str) -> None:
        del self._resume[provider]
        self.admission.set_available(provider, True)

    def apply_schedule(self) -> None:
        """Apply the time-of-day window in force now and arm one timer for the next change."""
        if not self.config.schedules:
            return
        tz = zoneinfo.ZoneInfo(self.config.timezone)
        wall = self.clock.wall()
        schedule = active(self.config.schedules, tz, wall)
        if schedule != self.schedule:
            self.schedule = schedule
            index = {name: i for i, name in enumerate(self.config.tier_names)}
            self.admission.set_policy(
                None if schedule is None else {index[t]: w for t, w in schedule.weights.items()},
                None if schedule is None else {index[t]: r for t, r in schedule.reserves.items()},
            )
        delay = max(next_change(self.config.schedules, tz, wall) - wall, 1.0)
        self._schedule_timer = asyncio.get_running_loop().call_later(delay, self.apply_schedule)

    def status(self) -> dict[str, object]:
        now = self.clock.now()
        return {
            "schedule": None if self.schedule is None else self.schedule.name,
            "scheduler": self.scheduler.snapshot(now),
            "breakers": {key: b.snapshot(now) for key, b in self.breakers.items()},
            "providers": {
                name: {
                    "kind": p.config.kind,
                    "max_concurrency": p.config.max_concurrency,
                    "limit": p.concurrency.limit,
                    "inflight": self.scheduler.inflight(name),
                    "paused": name in self._resume,
                }
                for name, p in self.providers.items()
            },
            "models": {
                name: [d.id for d in route.candidates]
                for name, route in self.config.models.items()
            },
        }

    async def close(self) -> None:
        if self._schedule_timer is not None:
            self._schedule_timer.cancel()
        for handle in self._resume.values():
            handle.cancel()
        self._resume.clear()
        self.admission.close()
        for provider in self.providers.values():
            await provider.upstream.close()
