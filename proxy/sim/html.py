"""A simulation as one self-contained HTML page: inline SVG charts, no script, no CDN.

Queue depth per tier and slots in use per provider over time, and each tier's wait
distribution (the proxy's, and FCFS's dashed when it was compared), then the report tables.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from ..config import Config
from .report import TITLES
from .results import Simulation

COLORS = ("#d1495b", "#edae49", "#00798c", "#30638e", "#7a5195", "#66a182", "#8d96a3")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 220, 56, 12, 10, 28
MAX_POINTS = 600


def _nice(top: float) -> float:
    if not top > 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(top))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if top <= m * power)


def _label(value: float, unit: str) -> str:
    if unit == "s":
        if 0 < value < 1:
            return f"{value * 1000:.0f} ms"
        return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
    return f"{value:g}"


def _chart(title: str, lines: Sequence[tuple[str, str, Sequence[tuple[float, float]], bool]],
           x_unit: str, y_unit: str) -> str:
    """``lines``: (name, colour, points, dashed). A line chart in inline SVG."""
    xs = [x for _, _, points, _ in lines for x, _ in points]
    ys = [y for _, _, points, _ in lines for _, y in points]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    top = _nice(max(ys, default=0.0))
    span = (x1 - x0) or 1.0

    def at(x: float, y: float) -> str:
        return (f"{LEFT + (WIDTH - LEFT - RIGHT) * (x - x0) / span:.1f},"
                f"{TOP + (HEIGHT - TOP - BOTTOM) * (1 - y / top):.1f}")

    parts = []
    for f in (0.0, 0.5, 1.0):
        y = TOP + (HEIGHT - TOP - BOTTOM) * (1 - f)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'class="grid"/><text x="{LEFT - 5}" y="{y + 3:.1f}" class="y">'
                     f"{html.escape(_label(top * f, y_unit))}</text>")
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        x = LEFT + (WIDTH - LEFT - RIGHT) * f
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - 8}" class="x">'
                     f"{html.escape(_label(x0 + span * f, x_unit))}</text>")
    legend = []
    for name, colour, points, dashed in lines:
        if not points:
            continue
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        path = " ".join(at(x, y) for x, y in points)
        parts.append(f'<polyline points="{path}" stroke="{colour}"{dash} '
                     f'data-series="{html.escape(name)}"/>')
        legend.append(f'<span><i style="background:{colour}"></i>{html.escape(name)}</span>')
    return (f'<div class="panel"><h2>{html.escape(title)}</h2>'
            f'<svg viewBox="0 0 {WIDTH} {HEIGHT}">{"".join(parts)}</svg>'
            f'<div class="legend">{"".join(legend)}</div></div>')


def _thinned(times: Sequence[float], values: Sequence[int], end: float) -> list[tuple[float,
                                                                                     float]]:
    """At most MAX_POINTS points, each the largest value of its stretch (peaks survive)."""
    pairs = [(t, float(v)) for t, v in zip(times, values, strict=True) if t <= end]
    if len(pairs) <= MAX_POINTS:
        return pairs
    size = math.ceil(len(pairs) / MAX_POINTS)
    return [(pairs[i][0], max(v for _, v in pairs[i:i + size]))
            for i in range(0, len(pairs), size)]


def _cdf(waits: Sequence[float]) -> list[tuple[float, float]]:
    ordered = sorted(w for w in waits if not math.isnan(w))
    if not ordered:
        return []
    step = max(1, len(ordered) // MAX_POINTS)
    points = [(ordered[i], (i + 1) / len(ordered)) for i in range(0, len(ordered), step)]
    return [*points, (ordered[-1], 1.0)]


def _table(title: str, report: dict[str, object]) -> str:
    tiers = report["tiers"]
    assert isinstance(tiers, dict)
    head = ("tier", "n", "mean", "p50", "p99", "max", "timeouts", "evicted", "refused",
            "cost $")
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            name, t["n"], *(_label(float(t[q]), "s") for q in ("mean", "p50", "p99", "max")),
            t["timeouts"], t["evicted"], t["refused"], f"{t['cost_usd']:.4f}")) + "</tr>"
        for name, t in tiers.items())
    return (f'<div class="panel"><h2>{html.escape(title)}: {report["calls"]} calls, '
            f'makespan {float(report["makespan_s"]):.0f} s, '  # type: ignore[arg-type]
            f'{report["inversions"]} priority inversions'
            f'</h2><table><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>{rows}</table>'
            f"</div>")


def page(config: Config, simulation: Simulation, report: dict[str, object],
         baseline: Simulation | None = None) -> str:
    series = simulation.series
    charts = []
    if series is not None and series.times:
        start = series.times[0]
        end = start + simulation.makespan_s + series.step_s
        times = [t - start for t in series.times]
        charts.append(_chart("Queue depth per tier", [
            (tier, COLORS[i % len(COLORS)], _thinned(times, series.depth[tier], end - start),
             False) for i, tier in enumerate(config.tier_names)], "s", ""))
        charts.append(_chart("Slots in use per provider", [
            (f"{name} (of {config.providers[name].max_concurrency})",
             COLORS[(i + 2) % len(COLORS)], _thinned(times, series.inflight[name],
                                                      end - start), False)
            for i, name in enumerate(config.providers)], "s", ""))
    lines = []
    for i, tier in enumerate(config.tier_names):
        colour = COLORS[i % len(COLORS)]
        lines.append((tier, colour, _cdf([o.wait_s for o in simulation.outcomes
                                          if o.tier == tier]), False))
        if baseline is not None:
            lines.append((f"{tier} (FCFS)", colour, _cdf([o.wait_s for o in baseline.outcomes
                                                          if o.tier == tier]), True))
    charts.append(_chart("Queue wait, share of calls at or below (CDF)",
                         [(n, c, [(x, y) for x, y in p], d) for n, c, p, d in lines], "s", ""))
    tables = [_table("triage-proxy", report)]
    for discipline, title in TITLES.items():
        if discipline in report:
            tables.append(_table(title, report[discipline]))  # type: ignore[arg-type]
    if "against" in report:
        tables.append(_table("the second config", report["against"]))  # type: ignore[arg-type]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>triage-proxy simulation</title>
<style>
body{{margin:0;padding:16px 20px;background:#f5f6f8;color:#1d2330;
  font:13px/1.35 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}}
h1{{font-size:18px;margin:0 0 12px}}
h2{{font-size:13px;margin:0 0 6px;color:#6b7385}}
.grid{{display:grid;grid-template-columns:repeat(auto-fit,minmax(480px,1fr));gap:10px;
  margin-bottom:10px}}
.panel{{background:#fff;border:1px solid #e3e6ec;border-radius:8px;padding:10px 12px;
  margin-bottom:10px}}
svg{{width:100%;height:auto;display:block}}
svg .grid{{stroke:#e3e6ec}} svg text{{font-size:10px;fill:#6b7385}}
svg .y{{text-anchor:end}} svg .x{{text-anchor:middle}}
polyline{{fill:none;stroke-width:1.6;stroke-linejoin:round}}
.legend{{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;margin-top:4px}}
.legend span{{display:inline-flex;align-items:center;gap:5px}}
.legend i{{width:10px;height:10px;border-radius:2px;display:inline-block}}
table{{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}}
th,td{{padding:3px 8px;border-bottom:1px solid #e3e6ec;text-align:right}}
th:first-child,td:first-child{{text-align:left}}
</style></head><body>
<h1>triage-proxy simulation</h1>
<div class="grid">{"".join(charts)}</div>
{"".join(tables)}
</body></html>
"""
