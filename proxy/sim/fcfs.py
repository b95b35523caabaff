"""The baseline: the same calls, first come first served, on the same providers.

One queue in arrival order; a free slot of any of a call's candidate providers (in the
model's order) takes the oldest call it can serve. A call still waiting when its tier's
``max_wait_s`` has passed gives up (``queue_timeout``), as a client with that timeout would.
Only slots and waits are modelled: no rpm/tpm limits, no queue bound, no faults.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from ..config import Config
from ..config.trace import TraceCall
from .run import Outcome, Simulation, Waiting, makespan, service_s


def fcfs(config: Config, calls: Sequence[TraceCall], tiers: Sequence[str],
         speed: float = 1.0) -> Simulation:
    """``tiers``: each call's tier as the proxy classified it (for its give-up time and the
    report)."""
    free = {name: p.max_concurrency for name, p in config.providers.items()}
    busy = dict.fromkeys(config.providers, 0.0)
    max_wait = {t.name: t.max_wait_s for t in config.tiers}
    first_model = next(iter(config.models))
    outcomes = [Outcome(c.t / speed, tier) for c, tier in zip(calls, tiers, strict=True)]
    waiting: list[int] = []  # in arrival order
    rank = {name: i for i, name in enumerate(config.tier_names)}
    counted = Waiting(len(rank))

    def pools(i: int) -> set[str]:
        route = config.models.get(calls[i].model or first_model)
        return set() if route is None else {d.provider for d in route.candidates}

    events: list[tuple[float, int, int, str | None]] = []  # (time, order, call, provider)
    order = itertools.count()
    for i, outcome in enumerate(outcomes):
        heapq.heappush(events, (outcome.arrived, next(order), i, None))
    while events:
        now, _, index, done = heapq.heappop(events)
        if done is not None:
            free[done] += 1
        else:
            waiting.append(index)
            counted.add(pools(index), rank.get(outcomes[index].tier, 0))
        kept: list[int] = []
        for position, i in enumerate(waiting):
            if not any(free.values()):
                kept += waiting[position:]
                break
            call, outcome = calls[i], outcomes[i]
            limit = max_wait.get(outcome.tier, math.inf)
            if now - outcome.arrived >= limit:  # gave up while it waited
                outcome.code, outcome.wait_s = "queue_timeout", limit
                counted.add(pools(i), rank.get(outcome.tier, 0), -1)
                continue
            route = config.models.get(call.model or first_model)
            if route is None or not route.candidates:
                outcome.code = "model_not_found" if route is None else "upstream_unavailable"
                outcome.wait_s = 0.0
                continue
            deployment = next((d for d in route.candidates if free[d.provider] > 0), None)
            if deployment is None:
                kept.append(i)
                continue
            output = min(call.output_tokens, call.max_tokens or call.output_tokens,
                         deployment.max_output_tokens)
            took = service_s(config, deployment, call.prompt_tokens, output)[1]
            counted.add(pools(i), rank.get(outcome.tier, 0), -1)
            counted.started(deployment.provider, rank.get(outcome.tier, 0))
            free[deployment.provider] -= 1
            busy[deployment.provider] += took
            outcome.wait_s, outcome.service_s = now - outcome.arrived, took
            outcome.provider = deployment.provider
            outcome.cost_usd = deployment.cost(call.prompt_tokens, output)
            outcome.done_at = now + took
            heapq.heappush(events, (now + took, next(order), i, deployment.provider))
        waiting = kept
    for i in waiting:  # still waiting at the end: they gave up
        outcome = outcomes[i]
        outcome.code = "queue_timeout"
        outcome.wait_s = max_wait.get(outcome.tier, math.inf)
    return Simulation(outcomes, makespan(outcomes), busy, counted.inversions)
