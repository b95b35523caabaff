"""What a simulation says: waits per tier, refusals, cost, provider utilisation."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..config import Config
from ..core.quantile import percentile
from .results import Outcome, Simulation

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


GAP = "  "  # between two columns however wide their cells: figures never run together


def aligned(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Rows of cells as lines: the first column left-aligned, the others right-aligned,
    each as wide as its widest cell. A row may stop short of the last columns."""
    widths = [max(len(row[i]) for row in rows if i < len(row))
              for i in range(max(len(row) for row in rows))]
    return [(indent + row[0].ljust(widths[0]) + "".join(
        GAP + cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=False))
             ).rstrip() for row in rows]


def table(report: dict[str, object], title: str) -> str:
    tiers = report["tiers"]
    providers = report["providers"]
    assert isinstance(tiers, dict) and isinstance(providers, dict)
    rows = [["tier", "n", "mean", "p50", "p99", "max", "timeouts", "evicted", "refused",
             "cost $"]]
    rows += [[name, str(t["n"]), _seconds(t["mean"]), _seconds(t["p50"]), _seconds(t["p99"]),
              _seconds(t["max"]), str(t["timeouts"]), str(t["evicted"]), str(t["refused"]),
              f"{t['cost_usd']:.4f}"] for name, t in tiers.items()]
    lines = [f"{title}: {report['calls']} calls, makespan {float(report['makespan_s']):.1f} s, "  # type: ignore[arg-type]
             f"{report['inversions']} priority inversions", *aligned(rows)]
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
    shown = [tier for tier, row in tiers.items() if row["n"]]
    # A discipline's column holds two of its own, waits and misses, aligned within it: its
    # tier rows are joined at those widths, so they line up however wide another column is.
    groups: dict[str, list[str]] = {}
    for name in names:
        found = reports[name]["tiers"]
        assert isinstance(found, dict)
        pairs = [("mean / p99 / max", "miss"), *(
            (f"{_seconds(found[t]['mean'])} / {_seconds(found[t]['p99'])} / "
             f"{_seconds(found[t]['max'])}", str(found[t]["timeouts"])) for t in shown)]
        wide, narrow = max(len(w) for w, _ in pairs), max(len(m) for _, m in pairs)
        groups[name] = [w.rjust(wide) + GAP + m.rjust(narrow) for w, m in pairs]
    rows = [["", *names], ["tier (n)", *(groups[n][0] for n in names)]]
    rows += [[f"{tier} ({tiers[tier]['n']})", *(groups[n][i] for n in names)]
             for i, tier in enumerate(shown, start=1)]
    rows.append(["makespan", *(f"{float(reports[n]['makespan_s']):.1f} s" for n in names)])  # type: ignore[arg-type]
    keys = first.get("keys")
    if isinstance(keys, dict) and len(keys) > 1:
        rows.append(["key: share, p90"])
        for key in keys:
            cells = []
            for name in names:
                found_keys = reports[name].get("keys")
                k = found_keys.get(key) if isinstance(found_keys, dict) else None
                cells.append("-" if k is None else f"{k['share'] * 100:.0f}% {_seconds(k['p90'])}")
            rows.append([key, *cells])
    return "\n".join(aligned(rows))
