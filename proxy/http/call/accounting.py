"""After a call: the tokens, cost and estimation error it adds to the metrics."""

from __future__ import annotations

from ...core.call.estimate import relative_error
from ...core.call.plan import Plan
from ...core.call.route import Deployment
from ...core.engine import Usage
from ..base.metrics import Metrics


def record_usage(metrics: Metrics, plan: Plan, deployment: Deployment, usage: Usage,
                 predicted_s: float, took_s: float, service_tier: str | None = None) -> float:
    """``predicted_s``: the service time the scheduler was told; ``took_s``: the truth;
    ``service_tier``: the provider tier it was sent with, priced as such. Returns the
    call's cost in dollars (its key's budget settles it: ``budget.settle``)."""
    metrics.tokens.get(deployment.provider, "prompt").inc(usage.prompt_tokens)
    metrics.tokens.get(deployment.provider, "completion").inc(usage.completion_tokens)
    cost = deployment.cost(usage.prompt_tokens, usage.completion_tokens, service_tier)
    metrics.cost.get(plan.caller, plan.tier_name).inc(cost)
    metrics.key_served.get(plan.caller, plan.tier_name).inc(took_s)
    if plan.output_tokens and usage.reported:
        metrics.estimate_error.get("output_tokens").observe(
            abs(relative_error(plan.output_tokens, usage.completion_tokens)))
    metrics.estimate_error.get("service_seconds").observe(
        abs(relative_error(predicted_s, took_s, min_actual=0.01)))
    return cost
