"""The scoreboard's rows as text: a verdict per bound, each bound's figures, and Markdown."""

from __future__ import annotations

from collections.abc import Sequence

from .scoreboard import Row


def table(rows: Sequence[Row]) -> str:
    """One line a scenario: each bound's verdict, then the figures behind them."""
    names = ("urgent", "floors", "fits", "deadlines", "makespan", "idle", "keys", "within",
             "early")
    lines = [f"{'scenario':<22}" + "".join(f"{n[:9]:>10}" for n in names)]
    for row in rows:
        verdicts: dict[str, str] = {}
        for c in row.checks:
            mark = "ok" if c.ok else "FAIL" if c.required else "beyond"
            if verdicts.get(c.name) in (None, "ok") or mark == "FAIL":
                verdicts[c.name] = mark
        lines.append(f"{row.scenario.name:<22}" + "".join(
            f"{verdicts.get(n, '-'):>10}" for n in names))
    return "\n".join(lines)


def details(row: Row) -> str:
    out = [f"{row.scenario.name}: {row.scenario.about} ({len(row.scenario.calls)} calls, "
           f"{row.took_s:.2f} s)"]
    out += [f"  {'ok  ' if c.ok else 'FAIL' if c.required else '(no)'} {c.name}: {c.detail}"
            for c in row.checks]
    return "\n".join(out)


def markdown(rows: Sequence[Row]) -> str:
    """The scoreboard as a Markdown table: per scenario, the most urgent tier's p99 wait
    under the proxy, strict priority and FCFS; timeouts under the proxy, WFQ and strict
    priority; the makespan against FCFS's; and the bounds that hold (beyond their
    condition in brackets)."""
    lines = ["| scenario | most urgent p99: proxy / priority / FCFS | timeouts: proxy / wfq "
             "/ priority | makespan / FCFS | bounds |", "|---|---|---|---|---|"]
    for row in rows:
        reports = row.reports
        tiers = reports["proxy"]["tiers"]
        assert isinstance(tiers, dict)
        top = next((t for t, v in tiers.items() if v["n"]), None)
        span = float(reports["fcfs"]["makespan_s"])  # type: ignore[arg-type]
        ratio = float(reports["proxy"]["makespan_s"]) / span if span else 1.0  # type: ignore[arg-type]
        held = sorted({c.name for c in row.checks if c.ok})
        beyond = sorted({c.name for c in row.checks if not c.ok and not c.required})
        failed = sorted({c.name for c in row.checks if not c.ok and c.required})
        verdict = ", ".join(held) + (f" ({', '.join(beyond)} beyond)" if beyond else "") + (
            f"; FAILS {', '.join(failed)}" if failed else "")
        lines.append(f"| {row.scenario.name} | {top}: {_p99(reports, 'proxy', top)} / "
                     f"{_p99(reports, 'priority', top)} / {_p99(reports, 'fcfs', top)} s | "
                     f"{_timeouts_of(reports, 'proxy')} / {_timeouts_of(reports, 'wfq')} / "
                     f"{_timeouts_of(reports, 'priority')} | {ratio:.3f} | {verdict} |")
    return "\n".join(lines)


def _p99(reports: dict[str, dict[str, object]], name: str, tier: str | None) -> str:
    found = reports[name]["tiers"]
    assert isinstance(found, dict)
    return "-" if tier is None else f"{found[tier]['p99']:.2f}"


def _timeouts_of(reports: dict[str, dict[str, object]], name: str) -> int:
    found = reports[name]["tiers"]
    assert isinstance(found, dict)
    return sum(int(t["timeouts"]) for t in found.values())
