"""What one running proxy knows and decides, pure: scheduler, provider health, estimators
and the policy that turns a parsed call into a plan. The HTTP driver and the simulator both
drive it."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping

from cachetools import LRUCache

from .call.classify import ClassifySettings, Principal, RequestFacts, clamp_tier, classify
from .call.estimate import EstimateSettings, LatencyModel, OutputEstimator
from .call.plan import Plan
from .call.retry import RetrySettings
from .call.route import Deployment, DeploymentStats, ModelRoute
from .errors import InvalidRequest, ModelNotFound
from .formats.request import Call
from .formats.wires import speaks
from .health.fleet import Fleet, TransitionHook
from .health.provider import Provider
from .scheduling.scheduler import Scheduler, SchedulerSettings
from .value import value

# Usage an upstream reports is believed only within these bounds: a prompt at most this
# many times the proxy's own count (plus a margin for images and other tokenizers), and no
# reply longer than this, whatever the call asked for.
PROMPT_PLAUSIBLE_FACTOR = 4
PROMPT_PLAUSIBLE_MARGIN = 10_000
COMPLETION_PLAUSIBLE_MAX = 1_000_000
# Responses API answers remembered with the deployment that holds them, most recent first.
AFFINITY_ENTRIES = 100_000


@value
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reported: bool  # the completion count came from the call, plausibly; else an estimate

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Engine:
    def __init__(
        self,
        *,
        scheduler: SchedulerSettings,
        classify: ClassifySettings,
        providers: Mapping[str, Provider],
        models: Mapping[str, ModelRoute],
        principals: Iterable[Principal] = (),
        retry: RetrySettings | None = None,
        estimate: EstimateSettings | None = None,
        rng: random.Random | None = None,
        on_transition: TransitionHook | None = None,
    ) -> None:
        self.settings = scheduler
        self.classify = classify
        self.providers = providers
        self.models = models
        self.retry = retry or RetrySettings()
        self.estimate = estimate or EstimateSettings()
        self.rng = rng or random.Random()
        # Slots are leased across replicas too (the driver's shared state says so).
        self.across_replicas = False
        deployments = [d for route in models.values() for d in route.candidates]
        self._output_caps = self._caps(models)
        self.scheduler = Scheduler(
            scheduler, {name: p.max_concurrency for name, p in providers.items()},
            {d.id: d.provider for d in deployments},
        )
        self.fleet = Fleet(self.scheduler, providers, deployments, principals,
                           self.retry.budget, self.rng, on_transition)
        priors = self.estimate
        self.outputs = OutputEstimator(prior=priors.output_tokens)
        self._homes: LRUCache[str, Deployment] = LRUCache(maxsize=AFFINITY_ENTRIES)
        self.latency = LatencyModel(
            ttft_prior_s=priors.ttft_s,
            seconds_per_token_prior=priors.seconds_per_token,
            prefill_seconds_per_token=priors.prefill_seconds_per_token,
        )

    def reconfigure(
        self,
        *,
        scheduler: SchedulerSettings,
        classify: ClassifySettings,
        providers: Mapping[str, Provider],
        models: Mapping[str, ModelRoute],
        principals: Iterable[Principal],
        retry: RetrySettings,
        estimate: EstimateSettings,
        now: float,
    ) -> None:
        """A new configuration for new calls (a reload); calls queued or running keep their
        plans. A queued or running call whose tier is gone moves to the new default tier.
        Providers, breakers, buckets, estimators and response homes are kept for whatever
        still exists; a provider that left stays known (``providers`` here may omit it)
        until nothing refers to it, so the calls still on it finish there."""
        self.providers = {**self.providers, **providers}
        tier_map = [classify.tier_names.index(name) if name in classify.tier_names
                    else classify.default_tier for name in self.tier_names]
        deployments = [d for route in models.values() for d in route.candidates]
        self.scheduler.reconfigure(
            scheduler, {name: p.max_concurrency for name, p in providers.items()},
            {d.id: d.provider for d in deployments}, tier_map, now)
        self.fleet.reconfigure(self.providers, deployments, principals, retry.budget)
        for name in providers:
            self.fleet.settle_room(name, now)
        self.settings, self.classify, self.models = scheduler, classify, models
        self.retry, self.estimate = retry, estimate
        self._output_caps = self._caps(models)

    @staticmethod
    def _caps(models: Mapping[str, ModelRoute]) -> dict[str, int]:
        return {name: max((d.max_output_tokens for d in route.candidates), default=0)
                for name, route in models.items()}

    @property
    def tier_names(self) -> tuple[str, ...]:
        return self.classify.tier_names

    def plan(self, call: Call, facts: RequestFacts, principal: Principal, now: float) -> Plan:
        """Classify and size a parsed call; raises ModelNotFound."""
        route = self.models.get(call.model)
        if route is None:
            raise ModelNotFound(
                f"The model '{call.model}' does not exist on this proxy.", param="model")
        route = self._route_to_home(self._speaking(route, call), call, now)
        tier = classify(facts, principal, self.classify).tier
        output = (self.outputs.expect(principal.name, call.model, call.max_tokens)
                  if call.generates else 0)
        cap = self._output_caps[call.model]
        return Plan(
            call=call, route=route, tier=tier, tier_name=self.tier_names[tier],
            ceiling=clamp_tier(principal.max_tier, tier),
            prompt_tokens=facts.prompt_tokens, output_tokens=cap if cap < output else output,
            caller=principal.name, caller_weight=principal.weight, arrived=now,
            deadline=now + self.settings.tiers[tier].max_wait_s, budget=principal.budget,
        )

    def remember_response(self, response_id: str, deployment: Deployment) -> None:
        """``deployment`` answered with the stored response ``response_id``."""
        self._homes[response_id] = deployment

    def home(self, response_id: str) -> Deployment | None:
        """The deployment remembered for ``response_id``, if any."""
        return self._homes.get(response_id)

    def _speaking(self, route: ModelRoute, call: Call) -> ModelRoute:
        """The candidates a call of its endpoint can go to (``wires.speaks``); an
        ``InvalidRequest`` where there is none."""
        providers = self.providers
        kept = tuple(d for d in route.candidates
                     if speaks(providers[d.provider].kind, call.kind))
        if len(kept) == len(route.candidates):
            return route
        if not kept:
            raise InvalidRequest(f"The model '{call.model}' is served only by providers that "
                                 f"do not take this endpoint's calls.", param="model")
        return dataclasses.replace(route, candidates=kept)

    def _route_to_home(self, route: ModelRoute, call: Call, now: float) -> ModelRoute:
        """A call that continues a stored response (``previous_response_id``) can only be
        served where that response lives: there alone, while it is available."""
        if call.previous_response_id is None:
            return route
        home = self._homes.get(call.previous_response_id)
        if home is None or home not in route.candidates or self.fleet.breakers[home.id].down(
                now):
            return route
        return dataclasses.replace(route, candidates=(home,), degradation=None)

    def service_s(self, plan: Plan, deployment: Deployment) -> tuple[float, float]:
        """(expected service seconds on ``deployment``, the call's stable size in seconds)."""
        output = deployment.output_cap(plan.output_tokens)
        return (self.latency.expect_service_s(deployment.id, plan.prompt_tokens, output),
                self.estimate.size_s(plan.prompt_tokens, output))

    def stats(self, deployments: Iterable[Deployment], now: float) -> dict[str, DeploymentStats]:
        stats: dict[str, DeploymentStats] = {}
        for deployment in deployments:
            breaker = self.fleet.breakers[deployment.id]
            stats[deployment.id] = DeploymentStats(
                available=not breaker.down(now),
                inflight=self.scheduler.inflight(deployment.provider),
                limit=self.scheduler.capacity(deployment.provider),
                ttft_s=self.latency.expect_ttft_s(deployment.id),
                self_hosted=deployment.provider in self.fleet.engines,
            )
        return stats

    def usage(self, plan: Plan, deployment: Deployment, prompt: object,
              completion: object) -> Usage:
        """What a call used: the upstream's report where it is plausible, else estimates."""
        prompt_ok = (isinstance(prompt, int) and not isinstance(prompt, bool)
                     and 0 <= prompt <= plan.prompt_tokens * PROMPT_PLAUSIBLE_FACTOR
                     + PROMPT_PLAUSIBLE_MARGIN)
        asked = plan.call.max_tokens
        choices = plan.call.choices
        limit = (COMPLETION_PLAUSIBLE_MAX if asked is None
                 or asked * choices > COMPLETION_PLAUSIBLE_MAX else asked * choices)
        completion_ok = (isinstance(completion, int) and not isinstance(completion, bool)
                         and 0 <= completion <= limit)
        output = deployment.output_cap(plan.output_tokens)
        return Usage(
            prompt if prompt_ok else plan.prompt_tokens,  # type: ignore[arg-type]
            completion if completion_ok else output * choices,  # type: ignore[arg-type]
            completion_ok,
        )

    def learn(self, plan: Plan, deployment: Deployment, usage: Usage, ttft_s: float | None,
              total_s: float) -> None:
        """A call completed: the estimators learn from it (only from reported usage)."""
        if not usage.reported:
            return
        # ``n`` completions are generated side by side: one of them is what a call takes.
        per_choice = usage.completion_tokens // plan.call.choices
        self.outputs.observe(plan.caller, plan.call.model, per_choice)
        self.latency.observe(deployment.id, ttft_s, per_choice, total_s, usage.prompt_tokens)
