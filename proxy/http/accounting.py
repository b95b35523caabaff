"""After a call: tokens, cost, and what the estimators learn from it."""

from __future__ import annotations

import orjson

from ..core.estimate import relative_error
from ..core.plan import Plan
from ..core.route import Deployment
from .service import Service


def account_json(
    service: Service, plan: Plan, deployment: Deployment, data: bytes, started: float
) -> None:
    try:
        usage = orjson.loads(data).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        usage = {}
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    account(service, plan, deployment, prompt,
             completion if isinstance(completion, int) else plan.output_tokens, None,
             service.clock.now() - started)


def account(
    service: Service,
    plan: Plan,
    deployment: Deployment,
    prompt: object,
    completion: int,
    ttft_s: float | None,
    total_s: float,
) -> None:
    # Usage comes from the provider: take only what is plausible.
    prompt_tokens = prompt if isinstance(prompt, int) and prompt >= 0 else plan.prompt_tokens
    completion = max(completion, 0)
    metrics = service.metrics
    metrics.tokens.get(deployment.provider, "prompt").inc(prompt_tokens)
    metrics.tokens.get(deployment.provider, "completion").inc(completion)
    metrics.cost.get(plan.caller, plan.tier_name).inc(deployment.cost(prompt_tokens, completion))
    if plan.output_tokens:
        metrics.estimate_error.get("output_tokens").observe(
            abs(relative_error(plan.output_tokens, completion))
        )
    predicted_s = service.latency.expect_service_s(deployment.id, prompt_tokens, completion)
    metrics.estimate_error.get("service_seconds").observe(
        abs(relative_error(predicted_s, total_s, floor=0.01))
    )
    service.outputs.observe(plan.caller, plan.call.model, completion)
    service.providers[deployment.provider].limits.reconcile(
        plan.prompt_tokens + plan.output_tokens, prompt_tokens + completion, service.clock.now()
    )
    service.latency.observe(deployment.id, ttft_s, completion, total_s, prompt_tokens)
