"""``python -m proxy simulate``: read the trace, replay it, print the report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..config import Config, ConfigError
from ..config.trace import read_calls
from .boardtext import details, markdown
from .boardtext import table as board
from .disciplines import DISCIPLINES, reference
from .heldout import HELD_OUT
from .html import page
from .report import TITLES, compare_table, summary, table
from .run import simulate
from .scenarios import BUILDERS
from .scoreboard import run
from .seeds import pooled


def simulate_command(config: Config, trace: str, speed: float, compare: str | None,
                     as_json: bool, other: Config | None = None, out: str | None = None) -> int:
    """``compare``: reference disciplines to replay the same calls under, comma-separated
    (``proxy.sim.disciplines``); ``other``: a second routing table, replayed on the same
    trace as ``against``; ``out``: where to write the HTML report."""
    if not speed > 0:
        print("--speed must be a positive number", file=sys.stderr)
        return 2
    disciplines = [d.strip() for d in (compare or "").split(",") if d.strip()]
    unknown = [d for d in disciplines if d not in DISCIPLINES]
    if unknown:
        print(f"--compare: unknown discipline {unknown[0]!r} (choose from "
              f"{', '.join(DISCIPLINES)})", file=sys.stderr)
        return 2
    try:
        calls = read_calls(Path(trace))
    except ConfigError as exc:
        print(f"invalid trace: {exc}", file=sys.stderr)
        return 2
    if not calls:
        print(f"invalid trace: {trace}: no calls in it", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = simulate(config, calls, speed)
    report = summary(config, result)
    baseline = None
    tiers, keys = [o.tier for o in result.outcomes], [o.key for o in result.outcomes]
    for discipline in dict.fromkeys(disciplines):
        replayed = reference(config, calls, tiers, discipline, keys, speed)
        report[discipline] = summary(config, replayed)
        if discipline == "fcfs":
            baseline = replayed
    if other is not None:
        report["against"] = summary(other, simulate(other, calls, speed))
    report["took_s"] = round(time.perf_counter() - started, 3)
    if out is not None:
        try:
            Path(out).write_text(page(config, result, report, baseline), encoding="utf-8")
        except OSError as exc:
            print(f"cannot write {out}: {exc.strerror}", file=sys.stderr)
            return 2
    if as_json:
        print(json.dumps(report))
        return 0
    print(table(report, "triage-proxy"))
    for discipline in dict.fromkeys(disciplines):
        print(table(report[discipline], TITLES[discipline]))  # type: ignore[arg-type]
    if disciplines:
        print("side by side:")
        print(compare_table({"triage-proxy": report, **{
            d: report[d] for d in dict.fromkeys(disciplines)}}))  # type: ignore[misc]
    if "against" in report:
        print(table(report["against"], "the second config"))  # type: ignore[arg-type]
    print(f"simulated in {report['took_s']} s" + (f"; report: {out}" if out else ""))
    return 0


def scoreboard_command(only: str | None, detailed: bool, as_json: bool,
                       as_markdown: bool = False, seeds: int = 1,
                       held_out: bool = False) -> int:
    """Every scenario (or ``only`` these) under the proxy and the reference disciplines,
    over ``seeds`` seeds judged together (``proxy.sim.seeds``); ``held_out``: the workloads
    the policy was not tuned on (``proxy.sim.heldout``) instead. Exit status 1 when a bound
    fails."""
    if seeds < 1:
        print("--seeds: must be at least 1", file=sys.stderr)
        return 2
    builders = HELD_OUT if held_out else BUILDERS
    names = [n.strip() for n in (only or "").split(",") if n.strip()] or list(builders)
    unknown = [n for n in names if n not in builders]
    if unknown:
        print(f"--only: unknown scenario {unknown[0]!r} (one of {', '.join(builders)})",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = []
    for name in names:
        row = run(builders[name](0)) if seeds == 1 else pooled(builders[name], seeds)
        rows.append(row)
        if detailed and not as_json:
            print(details(row))
            print(compare_table(row.reports))
    took = time.perf_counter() - started
    if as_json:
        print(json.dumps({"took_s": round(took, 3), "scenarios": {
            row.scenario.name: {"about": row.scenario.about, "ok": row.ok,
                                "checks": [vars(c) for c in row.checks],
                                "disciplines": row.reports} for row in rows}}))
    else:
        print(markdown(rows) if as_markdown else board(rows))
        failed = [c.name for row in rows for c in row.checks if not c.ok and c.required]
        beyond = [c.name for row in rows for c in row.checks if not c.ok and not c.required]
        print(f"{len(rows)} scenarios in {took:.1f} s; "
              + (f"{len(failed)} bounds fail" if failed else "every bound holds")
              + (f" ({len(beyond)} shown beyond their condition)" if beyond else ""))
    return 0 if all(row.ok for row in rows) else 1
