"""``python -m proxy simulate``: read the trace, replay it, print the report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..config import Config, ConfigError
from ..config.trace import read_calls
from .fcfs import fcfs
from .html import page
from .report import summary, table
from .run import simulate


def simulate_command(config: Config, trace: str, speed: float, compare: str | None,
                     as_json: bool, other: Config | None = None, out: str | None = None) -> int:
    """``other``: a second routing table, replayed on the same trace as ``against``;
    ``out``: where to write the HTML report."""
    if not speed > 0:
        print("--speed must be a positive number", file=sys.stderr)
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
    if compare == "fcfs":
        baseline = fcfs(config, calls, [o.tier for o in result.outcomes], speed)
        report["fcfs"] = summary(config, baseline)
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
    if "fcfs" in report:
        print(table(report["fcfs"], "first come first served"))  # type: ignore[arg-type]
    if "against" in report:
        print(table(report["against"], "the second config"))  # type: ignore[arg-type]
    print(f"simulated in {report['took_s']} s" + (f"; report: {out}" if out else ""))
    return 0
