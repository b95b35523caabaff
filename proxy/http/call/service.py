"""The long-lived objects of one running proxy, built from a Config in one place: the pure
engine, and around it the metrics, upstreams and timers of the aiohttp driver."""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import random
import secrets
import zoneinfo
from collections.abc import Callable, Mapping

from aiohttp import web

from ...config import Config, Provider
from ...core.call.budgets import Budget
from ...core.call.route import Deployment
from ...core.call.tokens import TokenCounter
from ...core.clock import Clock
from ...core.engine import Engine
from ...core.health.breaker import BreakerState
from ...core.health.engines import Figures
from ...core.scheduling.schedules import Schedule, active, next_change
from ...state.base import State, open_state
from ..base.live import LiveStats
from ..base.metrics import Metrics
from ..upstream.engines import Readers
from ..upstream.upstream import Upstream
from .admission import Admission
from .auth import Authenticator
from .budget import BudgetGate
from .cache import ResponseCache
from .forward import Forwarder
from .homes import Homes
from .replicas import Replicas
from .semantic_cache import SemanticCache
from .tracing import Tracing

log = logging.getLogger(__name__)

LIMIT_SOURCES = ("configured", "429", "engine", "latency")
BREAKER_GAUGE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


def budgets_of(config: Config) -> dict[str, Budget]:
    return {k.name: k.principal.budget for k in config.keys if k.principal.budget is not None}


class Service:
    def __init__(
        self,
        config: Config,
        upstreams: Mapping[str, Upstream],
        clock: Clock,
        counter: TokenCounter,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
        make_upstream: Callable[[Provider], Upstream] | None = None,
        shared: State | None = None,
        internal_token: str | None = None,
    ) -> None:
        """``make_upstream``: builds the upstream of a provider a reload adds or changes;
        ``shared``: what replicas share (default: what ``config.state`` names; started by
        ``start``)."""
        self.config = config
        self.clock = clock
        self.counter = counter
        self.upstreams = dict(upstreams)
        self._make_upstream = make_upstream
        self._retiring: set[asyncio.Task[None]] = set()  # replaced upstreams, closing
        self.metrics = metrics or Metrics()
        self.tracing: Tracing | None = None  # set by the app when ``telemetry:`` asks
        self.live = LiveStats()
        self.loaded_at = clock.wall()
        self.last_error: str | None = None
        # What the proxy's own calls (batch lines, background responses) authenticate with.
        self.internal_token = internal_token or secrets.token_urlsafe(32)
        self.auth = Authenticator(config.keys, config.auth_required, self.internal_token)
        self.shared = shared or open_state(config.state)
        # The keys' spend budgets: this process's, or the fleet's through Redis.
        self.budgets = self.shared.budgets(budgets_of(config), config.timezone, clock.wall)
        answers = self.shared.answers
        if answers is not None:
            answers.on_error = lambda operation: self.metrics.cache_shared_errors.get(
                operation).inc()
        self.cache = ResponseCache(clock, answers)
        self.cache.configure(config.models)
        self.semantic = SemanticCache(clock, self.metrics, self.internal_token)
        self.semantic.configure(config.models)
        self.engine = Engine(
            scheduler=config.scheduler, classify=config.classify, providers=config.providers,
            models=config.models, principals=[k.principal for k in config.keys],
            retry=config.retry, estimate=config.estimate, rng=rng,
            on_transition=self._breaker_moved,
        )
        self.scheduler = self.engine.scheduler
        self.admission = Admission(self.scheduler, clock)
        self.engine.across_replicas = self.shared.across_replicas
        self.forwarder = Forwarder(
            clock=clock, counter=counter, auth=self.auth, limits=config.limits,
            engine=self.engine, admission=self.admission, cache=self.cache,
            semantic=self.semantic, budgets=BudgetGate(self.budgets, clock),
            replicas=Replicas(self.shared, self.engine, self.metrics, clock),
            homes=Homes(self.engine, self.shared.answers), metrics=self.metrics,
            upstreams=self.upstreams)
        # Self-hosted servers' own figures, read on timers once started.
        self.readers = Readers(self._engine_read, self._engine_failed)
        self.readers.configure(config.providers, self.upstreams)
        self.forwarder.answered = self.readers.nudge
        self._configure_shared()
        self._schedule_timer: asyncio.TimerHandle | None = None
        self.schedule: Schedule | None = None
        self._gauges()

    async def start(self) -> None:
        """Reach the shared state (a replica that cannot starts in its ``on_error`` mode)."""
        self.on_mode(self.shared.mode, 1)
        await self.shared.start(self)
        self.semantic.share(self.shared)
        self.readers.start()

    def _engine_read(self, provider: str, figures: Figures) -> None:
        self.engine.fleet.engine_read(provider, figures, self.clock.now())
        self.admission.act_on_decisions()

    def _engine_failed(self, provider: str, reason: str) -> None:
        fleet, now = self.engine.fleet, self.clock.now()
        view = fleet.engines.get(provider)
        was_readable = view is not None and view.readable(now)
        fleet.engine_failed(provider, reason, now)
        if was_readable and view is not None and not view.readable(now):
            log.warning("provider %s: its server cannot be read (%s); its limit falls back "
                        "to %s", provider, reason, self.scheduler.limit_source(provider))
        self.admission.act_on_decisions()

    def _configure_shared(self) -> None:
        self.shared.configure(
            {name: p.max_concurrency for name, p in self.config.providers.items()},
            [d.id for route in self.config.models.values() for d in route.candidates])

    def on_mode(self, mode: str, alive: int) -> None:
        """Shared state's mode changed: without Redis (``local``) each replica takes its
        share of every provider's slots; with it, the whole (the leases bound the sum)."""
        now = self.clock.now()
        share = max(alive, 1) if mode == "local" and self.shared.across_replicas else 1
        for name, provider in self.config.providers.items():
            limit = provider.max_concurrency
            self.scheduler.set_max(name, max(limit // share, 1) if limit else 0, now)
        for known in ("shared", "local", "reject"):
            self.metrics.shared_mode.get(known).set(1 if known == mode else 0)
        self.admission.act_on_decisions()

    def on_breakers(self, open_for_s: Mapping[str, float]) -> None:
        """Another replica opened these breakers: open them here too."""
        now = self.clock.now()
        for deployment, seconds in open_for_s.items():
            breaker = self.engine.fleet.breakers.get(deployment)
            if breaker is not None:
                breaker.trip(now + seconds, now)
        self.admission.act_on_decisions()

    def _gauges(self) -> None:
        """Gauges read from the scheduler, for the configured tiers and providers."""
        metrics, config, now = self.metrics, self.config, self.clock.now()
        for family in (metrics.queue_depth, metrics.inflight, metrics.limit,
                       metrics.limit_source, metrics.engine_readable, metrics.engine_waiting,
                       metrics.budget_spent, metrics.budget_amount, metrics.cache_entries,
                       metrics.semantic_entries,
                       metrics.breaker_state):
            family.clear()
        metrics.replicas.set_function(lambda: self.shared.alive)
        metrics.shared_errors.set_function(lambda: self.shared.errors)
        shared = self.shared.status()
        entered, rebuilt = shared.get("entered"), shared.get("rebuilt")
        if isinstance(entered, dict) and isinstance(rebuilt, dict):
            for mode in entered:
                metrics.shared_entered.get(mode).set_function(
                    functools.partial(self._entered, mode))
            metrics.shared_fallback.set_function(lambda: self._state_figure("fallback_s"))
            metrics.shared_rebuilds.set_function(lambda: self._state_figure("rebuilt", "times"))
        for name, route in config.models.items():
            if route.cache is not None:
                metrics.cache_entries.get(name).set_function(
                    functools.partial(self.cache.size, name))
            if route.semantic_cache is not None:
                metrics.semantic_entries.get(name).set_function(
                    functools.partial(self.semantic.size, name))
        for key, budget in self.budgets.budgets.items():
            metrics.budget_amount.get(key).set(budget.amount_usd)
            metrics.budget_spent.get(key).set_function(functools.partial(self._spent, key))
        for route in config.models.values():
            for deployment in route.candidates:
                state = self.engine.fleet.breakers[deployment.id].state(now)
                metrics.breaker_state.get(deployment.provider, deployment.id).set(
                    BREAKER_GAUGE[state])
        for index, tier in enumerate(config.tiers):
            metrics.queue_depth.get(tier.name).set_function(
                functools.partial(self.scheduler.depth, index))
        for name in config.providers:
            metrics.inflight.get(name).set_function(
                functools.partial(self.scheduler.inflight, name))
            metrics.limit.get(name).set_function(
                functools.partial(self.scheduler.capacity, name))
            for source in LIMIT_SOURCES:
                metrics.limit_source.get(name, source).set_function(
                    functools.partial(self._limit_from, name, source))
            if name in self.engine.fleet.engines:
                metrics.engine_readable.get(name).set_function(
                    functools.partial(self._engine_figure, name, "readable"))
                metrics.engine_waiting.get(name).set_function(
                    functools.partial(self._engine_figure, name, "waiting"))

    def _limit_from(self, provider: str, source: str) -> float:
        return 1.0 if self.scheduler.limit_source(provider) == source else 0.0

    def _engine_figure(self, provider: str, figure: str) -> float:
        view = self.engine.fleet.engines.get(provider)
        if view is None:
            return 0.0
        found = view.snapshot(self.clock.now()).get(figure)
        return float(found) if isinstance(found, int | float) else 0.0

    def _retire(self, upstream: Upstream) -> None:
        """A replaced upstream is closed at once: its idle connections go now, and a call
        still on it finishes (its connection is then closed, not kept)."""
        task = asyncio.get_running_loop().create_task(upstream.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _entered(self, mode: str) -> float:
        return self._state_figure("entered", mode)

    def _state_figure(self, *path: str) -> float:
        """A number from the shared state's status (0 where it has none)."""
        found: object = self.shared.status()
        for step in path:
            found = found.get(step, 0) if isinstance(found, dict) else 0
        return float(found) if isinstance(found, int | float) else 0.0

    def _spent(self, key: str) -> float:
        return self.budgets.spent(key, self.clock.wall())

    def reconfigure(self, config: Config) -> None:
        """Serve ``config`` from now on (a reload), without failing a queued or running
        call: they keep their plans, routes and deadlines (``Engine.reconfigure``). A
        provider whose settings changed gets a new upstream for the calls sent from now;
        one that left keeps its upstream for the calls still bound to it."""
        now = self.clock.now()
        old = self.engine.providers
        fresh: dict[str, Upstream] = {}
        try:
            for name, provider in config.providers.items():
                if old.get(name) != provider or name not in self.upstreams:
                    if self._make_upstream is None:
                        raise RuntimeError("this service cannot build upstreams")
                    fresh[name] = self._make_upstream(provider)
            self.engine.reconfigure(
                scheduler=config.scheduler, classify=config.classify,
                providers=config.providers, models=config.models,
                principals=[k.principal for k in config.keys], retry=config.retry,
                estimate=config.estimate, now=now)
        except BaseException:  # the old config keeps serving, on its own upstreams
            for upstream in fresh.values():
                self._retire(upstream)
            raise
        for name, upstream in fresh.items():  # swapped only once nothing can fail
            if name in self.upstreams:
                self._retire(self.upstreams[name])
            self.upstreams[name] = upstream
        self.config = config
        self.auth = Authenticator(config.keys, config.auth_required, self.internal_token)
        self.forwarder.reconfigure(self.auth, config.limits)
        self.budgets.configure(budgets_of(config), config.timezone)
        self.cache.configure(config.models)
        self.semantic.configure(config.models)
        self.readers.configure(config.providers, self.upstreams)
        self.loaded_at, self.last_error = self.clock.wall(), None
        self._configure_shared()
        if self.shared.mode == "local" and self.shared.across_replicas:
            self.on_mode("local", self.shared.alive)
        self._gauges()
        if self._schedule_timer is not None:
            self._schedule_timer.cancel()
            self._schedule_timer = None
        self.schedule = None
        self.apply_schedule()
        self.admission.act_on_decisions()

    def _breaker_moved(self, deployment: Deployment, old: BreakerState,
                       new: BreakerState) -> None:
        self.metrics.breaker_state.get(deployment.provider, deployment.id).set(
            BREAKER_GAUGE[new])
        if new is BreakerState.OPEN:
            now = self.clock.now()
            until = self.engine.fleet.breakers[deployment.id].open_until
            self.shared.breaker_opened(deployment.id, until - now)
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
            self.admission.act_on_decisions()
        delay = max(next_change(self.config.schedules, tz, wall) - wall, 1.0)
        self._schedule_timer = asyncio.get_running_loop().call_later(delay, self.apply_schedule)

    def status(self) -> dict[str, object]:
        now = self.clock.now()
        fleet = self.engine.fleet
        scheduler = self.scheduler.snapshot(now)
        providers = scheduler["providers"]
        assert isinstance(providers, dict)
        # What a reload removed is still known (calls may still use it); shown while used.
        scheduler["providers"] = {name: pool for name, pool in providers.items()
                                  if name in self.config.providers or pool["inflight"]}
        configured = {d.id for route in self.config.models.values() for d in route.candidates}
        return {
            "config": {
                "version": self.config.version,
                "loaded_at": datetime.datetime.fromtimestamp(
                    self.loaded_at, datetime.UTC).isoformat(timespec="seconds"),
                "last_error": self.last_error,
            },
            "schedule": None if self.schedule is None else self.schedule.name,
            "scheduler": scheduler,
            "breakers": {key: b.snapshot(now) for key, b in fleet.breakers.items()
                         if key in configured},
            "providers": {
                name: {
                    "kind": provider.kind,
                    "max_concurrency": provider.max_concurrency,
                    "limit": self.scheduler.capacity(name),
                    "limit_source": self.scheduler.limit_source(name),
                    **self._learned(name, provider, now),
                    "inflight": self.scheduler.inflight(name),
                    "paused_for_s": providers[name]["paused_for_s"],
                    "retry_budget": round(fleet.retry_allowances[name].available(now), 2),
                    "egress": provider.egress.display_url if provider.egress is not None else None,
                }
                for name, provider in self.config.providers.items()
            },
            "models": {
                name: [d.id for d in route.candidates]
                for name, route in self.config.models.items()
            },
            "budgets": self.budgets.snapshot(self.clock.wall()),
            "state": self.shared.status(),
        }

    def _learned(self, name: str, provider: Provider, now: float) -> dict[str, object]:
        """A self-hosted server's figures, a latency-learned limit, the priority sent."""
        fleet = self.engine.fleet
        shown: dict[str, object] = {}
        view = fleet.engines.get(name)
        if view is not None:
            shown["engine"] = {"name": provider.engine, **view.snapshot(now)}
        latency = fleet.latency.get(name)
        if latency is not None:
            shown["latency"] = latency.snapshot()
        if provider.priority_order is not None:
            shown["priority"] = ("refused by the server: not sent"
                                 if name in fleet.priority_refused
                                 else f"sent, {provider.priority_order} first")
        return shown

    async def close(self) -> None:
        if self._schedule_timer is not None:
            self._schedule_timer.cancel()
        self.admission.close()
        await self.readers.close()
        await self.shared.close()
        await self.semantic.close()
        for upstream in self.upstreams.values():
            await upstream.close()
        await asyncio.gather(*self._retiring)


SERVICE = web.AppKey("service", Service)
