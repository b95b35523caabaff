"""The long-lived objects of one running proxy, built from a Config in one place: the pure
engine, and around it the metrics, upstreams and timers of the aiohttp driver."""

from __future__ import annotations

import asyncio
import functools
import random
import zoneinfo
from collections.abc import Mapping

from ..config import Config
from ..core.breaker import State
from ..core.clock import Clock
from ..core.engine import Engine
from ..core.route import Deployment
from ..core.schedules import Schedule, active, next_change
from ..core.tokens import TokenCounter
from .admission import Admission
from .auth import Authenticator
from .live import LiveStats
from .metrics import Metrics
from .upstream import Upstream

BREAKER_GAUGE = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}


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
        self.upstreams = upstreams
        self.metrics = metrics or Metrics()
        self.live = LiveStats()
        self.auth = Authenticator(config.keys, config.auth_required)
        self.engine = Engine(
            scheduler=config.scheduler, classify=config.classify, providers=config.providers,
            models=config.models, principals=[k.principal for k in config.keys],
            retry=config.retry, estimate=config.estimate, rng=rng,
            on_transition=self._breaker_moved,
        )
        self.scheduler = self.engine.scheduler
        self.admission = Admission(self.scheduler, clock)
        self._schedule_timer: asyncio.TimerHandle | None = None
        self.schedule: Schedule | None = None
        for route in config.models.values():
            for deployment in route.candidates:
                self.metrics.breaker_state.get(deployment.provider, deployment.id).set(0)
        for index, tier in enumerate(config.tiers):
            self.metrics.queue_depth.get(tier.name).set_function(
                functools.partial(self.scheduler.depth, index))
        for name in config.providers:
            self.metrics.inflight.get(name).set_function(
                functools.partial(self.scheduler.inflight, name))
            self.metrics.limit.get(name).set_function(
                functools.partial(self.scheduler.capacity, name))

    def _breaker_moved(self, deployment: Deployment, old: State, new: State) -> None:
        self.metrics.breaker_state.get(deployment.provider, deployment.id).set(
            BREAKER_GAUGE[new])
        self.metrics.breaker_transitions.get(deployment.id, new.value).inc()

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
            self.scheduler.set_policy(
                None if schedule is None else {index[t]: w for t, w in schedule.weights.items()},
                None if schedule is None else {index[t]: r for t, r in schedule.reserves.items()},
                self.clock.now(),
            )
            self.admission.settle()
        delay = max(next_change(self.config.schedules, tz, wall) - wall, 1.0)
        self._schedule_timer = asyncio.get_running_loop().call_later(delay, self.apply_schedule)

    def status(self) -> dict[str, object]:
        now = self.clock.now()
        fleet = self.engine.fleet
        scheduler = self.scheduler.snapshot(now)
        providers = scheduler["providers"]
        assert isinstance(providers, dict)
        return {
            "schedule": None if self.schedule is None else self.schedule.name,
            "scheduler": scheduler,
            "breakers": {key: b.snapshot(now) for key, b in fleet.breakers.items()},
            "providers": {
                name: {
                    "kind": provider.kind,
                    "max_concurrency": provider.max_concurrency,
                    "limit": self.scheduler.capacity(name),
                    "inflight": self.scheduler.inflight(name),
                    "paused_for_s": providers[name]["paused_for_s"],
                    "retry_budget": round(fleet.budgets[name].available(now), 2),
                }
                for name, provider in self.config.providers.items()
            },
            "models": {
                name: [d.id for d in route.candidates]
                for name, route in self.config.models.items()
            },
        }

    async def close(self) -> None:
        if self._schedule_timer is not None:
            self._schedule_timer.cancel()
        self.admission.close()
        for upstream in self.upstreams.values():
            await upstream.close()
