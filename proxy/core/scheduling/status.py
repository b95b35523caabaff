"""What ``/admin/status`` shows of the scheduler: per tier its queue and its keys (when
their queued calls were foreseen to start among them), per provider its pool, the slots
held back, its floor credit and its mean service time."""

from __future__ import annotations

from collections.abc import Mapping

from .capacity import Pool
from .forecast import starts
from .parts import Parts


def status(parts: Parts, pools: Mapping[str, Pool], now: float) -> dict[str, object]:
    keys = parts.charges.stats.snapshot(now)
    for (tier, key), (soonest, latest) in starts(parts.queues, now).items():
        shown = keys[tier].get(key or "(none)")
        if shown is not None:
            shown["starts_in_s"] = {"soonest": round(soonest, 3), "latest": round(latest, 3)}
    tiers = [{"name": spec.name, "weight": parts.floors.weights[i],
              **parts.queues.snapshot(i, now), "keys": keys[i]}
             for i, spec in enumerate(parts.settings.tiers)]
    providers = {
        name: {**pool.snapshot(now), "held_back": parts.policy.held(pool, now),
               "floor_credit_s": parts.floors.snapshot(name),
               "mean_service_s": parts.policy.mean_service(name)}
        for name, pool in pools.items()
    }
    return {"queued": parts.queues.queued, "tiers": tiers, "providers": providers}
