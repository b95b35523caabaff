"""What a simulation says: waits per tier, refusals, cost, provider utilisation."""

from __future__ import annotations

import math

from ..config import Config
from ..core.quantile import percentile
from .run import Outcome, Simulation

MAX_KEYS = 20  # keys reported by name, the busiest first; the rest as one "(others)"
OTHERS = "(others)"
TITLES = {"fcfs": "first come first served", "priority": "strict priority",
          "wfq": "weighted fair queueing", "static": "static slots per tier"}


def summary(config: Config, simulation: Simulation) -> dict[str, object]:
    """The contract's JSON shape: ``calls``, ``makespan_s``, per tier ``n``, ``mean``,
    ``p50``, ``p99``, ``max`` (queue waits, refused calls' waits until refused included),
    ``timeouts``, ``evicted``, ``refused`` (any other code) and ``cost_usd``; per provider
    ``utilisation`` (slot-seconds served / (slots * makespan)); per key (the busiest
    ``MAX_KEYS``, the rest as ``(others)``) ``n``, ``share`` of the slot-seconds served,
    ``mean`` and ``p90`` wait."""
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
        "keys": _keys(simulation.outcomes),
        "providers": {
            name: {"utilisation": round(simulation.busy_s.get(name, 0.0)
                                        / (p.max_concurrency * span), 4)
                   if span > 0 and p.max_concurrency else 0.0}
            for name, p in config.providers.items()
        },
    }


def _keys(outcomes: list[Outcome]) -> dict[str, dict[str, float]]:
    by_key: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_key.setdefault(outcome.key or "", []).append(outcome)
    named = sorted(by_key, key=lambda k: -len(by_key[k]))
    if len(named) > MAX_KEYS:
        by_key[OTHERS] = [o for k in named[MAX_KEYS - 1:] for o in by_key.pop(k)]
        named = [*named[:MAX_KEYS - 1], OTHERS]
    served = sum(o.service_s for o in outcomes) or 1.0
    out = {}
    for key in named:
        mine = by_key[key]
        waits = sorted(o.wait_s for o in mine if not math.isnan(o.wait_s))
        out[key or "(none)"] = {
            "n": len(mine), "share": round(sum(o.service_s for o in mine) / served, 4),
            "mean": round(sum(waits) / len(waits), 4) if waits else 0.0,
            "p90": round(percentile(waits, 0.9), 4),
        }
    return out


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


def compare_table(reports: dict[str, dict[str, object]]) -> str:
    """The same calls under several disciplines, side by side: per tier mean / p99 / max
    wait and deadline misses, the makespan, and each key's share and p90 wait."""
    names = list(reports)
    first = reports[names[0]]
    tiers = first["tiers"]
    assert isinstance(tiers, dict)
    width = 36
    lines = [f"  {'':<16}" + "".join(f"{n:>{width}}" for n in names),
             f"  {'tier (n)':<16}" + f"{'mean / p99 / max  miss':>{width}}" * len(names)]
    for tier, row in tiers.items():
        if not row["n"]:
            continue
        cells = []
        for name in names:
            t = reports[name]["tiers"][tier]  # type: ignore[index]
            cells.append(f"{_seconds(t['mean'])} / {_seconds(t['p99'])} / "
                         f"{_seconds(t['max'])} {t['timeouts']:>5}")
        label = f"{tier} ({row['n']})"
        lines.append(f"  {label:<16}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append(f"  {'makespan':<16}" + "".join(
        f"{float(reports[n]['makespan_s']):>{width - 2}.1f} s" for n in names))  # type: ignore[arg-type]
    keys = first.get("keys")
    if isinstance(keys, dict) and len(keys) > 1:
        lines.append(f"  {'key: share, p90':<16}")
        for key in keys:
            cells = []
            for name in names:
                found = reports[name].get("keys")
                k = found.get(key) if isinstance(found, dict) else None
                cells.append("-" if k is None else f"{k['share'] * 100:.0f}% {_seconds(k['p90'])}")
            lines.append(f"  {key[:16]:<16}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)
