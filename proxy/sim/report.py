"""What a simulation says: waits per tier, refusals, cost, provider utilisation."""

from __future__ import annotations

import math

from ..config import Config
from ..core.quantile import percentile
from .run import Simulation


def summary(config: Config, simulation: Simulation) -> dict[str, object]:
    """The contract's JSON shape: ``calls``, ``makespan_s``, per tier ``n``, ``mean``,
    ``p50``, ``p99``, ``max`` (queue waits, refused calls' waits until refused included),
    ``timeouts``, ``evicted``, ``refused`` (any other code) and ``cost_usd``; per provider
    ``utilisation`` (slot-seconds served / (slots * makespan))."""
    tiers: dict[str, object] = {}
    for name in config.tier_names:
        mine = [o for o in simulation.outcomes if o.tier == name]
        waits = sorted(o.wait_s for o in mine if not math.isnan(o.wait_s))
        codes = [o.code for o in mine if o.code is not None]
        tiers[name] = {
            "n": len(mine),
            "mean": round(sum(waits) / len(waits), 4) if waits else 0.0,
            "p50": round(percentile(waits, 0.5), 4), "p99": round(percentile(waits, 0.99), 4),
            "max": round(waits[-1], 4) if waits else 0.0,
            "timeouts": codes.count("queue_timeout"), "evicted": codes.count("evicted"),
            "refused": sum(1 for c in codes if c not in ("queue_timeout", "evicted")),
            "cost_usd": round(sum(o.cost_usd for o in mine), 6),
        }
    unclassified = [o for o in simulation.outcomes if not o.tier]
    span = simulation.makespan_s
    return {
        "calls": len(simulation.outcomes),
        "unclassified": len(unclassified),
        "makespan_s": round(span, 3),
        "inversions": simulation.inversions,
        "tiers": tiers,
        "providers": {
            name: {"utilisation": round(simulation.busy_s.get(name, 0.0)
                                        / (p.max_concurrency * span), 4)
                   if span > 0 and p.max_concurrency else 0.0}
            for name, p in config.providers.items()
        },
    }


def _seconds(value: object) -> str:
    v = float(value)  # type: ignore[arg-type]
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def table(report: dict[str, object], title: str) -> str:
    tiers = report["tiers"]
    providers = report["providers"]
    assert isinstance(tiers, dict) and isinstance(providers, dict)
    lines = [f"{title}: {report['calls']} calls, makespan {float(report['makespan_s']):.1f} s, "  # type: ignore[arg-type]
             f"{report['inversions']} priority inversions",
             f"  {'tier':<12}{'n':>7}{'mean':>10}{'p50':>10}{'p99':>10}{'max':>10}"
             f"{'timeouts':>10}{'evicted':>9}{'refused':>9}{'cost $':>11}"]
    for name, t in tiers.items():
        lines.append(
            f"  {name:<12}{t['n']:>7}{_seconds(t['mean']):>10}{_seconds(t['p50']):>10}"
            f"{_seconds(t['p99']):>10}{_seconds(t['max']):>10}{t['timeouts']:>10}"
            f"{t['evicted']:>9}{t['refused']:>9}{t['cost_usd']:>11.4f}")
    if report.get("unclassified"):
        lines.append(f"  + {report['unclassified']} refused before a tier (unknown model)")
    lines.append("  utilisation: " + ", ".join(
        f"{name} {p['utilisation'] * 100:.0f}%" for name, p in providers.items()))
    return "\n".join(lines)
