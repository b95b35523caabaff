"""The soak's checks (scripts/soak.py), from what it recorded: each one ``passed`` (True,
False, or None when skipped) with the figures behind it.

- ``limits``: never above a provider's ``max_concurrency`` at the fake provider, outside
  the fallback windows. A window is a Redis fault from its start until every replica is in
  shared mode again, two heartbeats after Redis answered, plus one. docs/replicas.md
  ("Redis trouble"): each replica then uses ``max_concurrency // replicas`` (at least 1),
  and calls running when Redis went away finish, "so for as long as they run the provider
  may see up to one share more per other replica": ``limit + (replicas - 1) * share``.
- ``answered``: every call got a status, a whole answer, or (a stream) an error event;
  a connection error only on a replica generation SIGKILLed while the call ran; no hang;
  a bad body always 4xx; no 500; no interactive call served twice at the provider.
- ``batches``: each batch's output and error files answer every line once (a batch whose
  store went with a Redis restarted empty is counted apart, as ``lost``).
- ``budget``: what the provider served the budget key (one call at a time) cost at most its
  ``budget_usd`` plus one call's cost.
- ``leases``: no ``leases:*``, ``waiters:*`` or ``wexp:*`` member left in Redis once the
  load stopped (replicas running), nor after every replica drained.
- ``rss``: each replica generation still running at the end within 10 % of its highest
  RSS in its first ``--rss-window`` seconds (a generation younger than that is skipped).
- ``critical_wait``: the critical tier's p99 queue wait (``x-proxy-queue-ms``): under its
  ``max_wait_s`` over the whole run (faults included: a slow provider holds its slots, and
  nothing is pre-empted), and under ``--critical-p99-ms`` outside the faults (from a
  fault's start to 5 s after it ended).
- ``drains``: a SIGTERMed replica exits 0 within ``drain_timeout_s`` and a few seconds.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
from soak_batch import Batch
from soak_fleet import Generation
from soak_load import FAILING, Call

RSS_SLACK = 0.10
DRAIN_SLACK_S = 5.0


@dataclass
class Run:
    args: dict[str, Any]
    t0: float
    wall0: float  # time.time() at t0: the replicas' logs are on the wall clock
    load_end: float
    limits: dict[str, int]
    replicas: int
    beat_s: float
    budget_usd: float
    budget_call_usd: float
    max_call_usd: float
    prompt_tokens: int
    calls: list[Call]
    skipped: int
    faults: list[dict[str, Any]]
    generations: list[Generation]
    final_rss: dict[str, int | None]
    statuses: dict[str, dict[str, Any] | None]
    leases_running: dict[str, list[tuple[str, float]]]
    leases_drained: dict[str, list[tuple[str, float]]]
    upstream: dict[str, Any]
    batches: list[Batch]
    polls: list[tuple[float, str, str, int, int, int]]
    max_wait_s: dict[str, int]
    drain_timeout_s: float


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def _windows(run: Run) -> list[dict[str, Any]]:
    """The fallback windows, in seconds since the load began: each Redis fault's, and
    each stretch a replica's log says it was out of shared mode (one heartbeat after)."""
    windows = [{"fault": f["kind"], "start": f["start"] - run.t0,
                "end": f["settled"] - run.t0} for f in run.faults if f["settled"]]
    for gen in run.generations:
        for start, end, why in fallbacks(gen, run.wall0):
            windows.append({"fault": f"{gen.name} {why}", "start": start,
                            "end": (end if end is not None else run.load_end - run.t0 + 60)
                            + run.beat_s})
    return windows


LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING proxy\.state\.shared: "
                    r"shared state: (Redis unreachable \((.*?)\)|Redis is back)")


def fallbacks(gen: Generation, wall0: float) -> list[tuple[float, float | None, str]]:
    """(start, end or None, why), in seconds since the load began, of each stretch this
    generation's log says it was out of shared mode."""
    found: list[tuple[float, float | None, str]] = []
    if not gen.log.exists():
        return found
    opened: tuple[float, str] | None = None
    for line in gen.log.read_text(errors="replace").splitlines():
        match = LOGGED.match(line)
        if match is None:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall0
        if match.group(3) is not None:
            opened = opened or (at, match.group(3)[:80])
        elif opened is not None:
            found.append((opened[0], at, opened[1]))
            opened = None
    if opened is not None:
        found.append((opened[0], None, opened[1]))
    return found


def unplanned(run: Run) -> list[dict[str, Any]]:
    """Stretches out of shared mode that no Redis fault explains (a Redis command slower
    than the proxy's 0.5 s timeout, on a loaded machine)."""
    planned = [(f["start"] - run.t0, f["settled"] - run.t0) for f in run.faults
               if f["settled"]]
    out = []
    for gen in run.generations:
        for start, end, why in fallbacks(gen, run.wall0):
            if not any(a - 1 <= start <= b for a, b in planned):
                out.append({"replica": gen.name, "from_s": round(start, 2),
                            "to_s": None if end is None else round(end, 2), "why": why})
    return out


def _in(t: float, windows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((w for w in windows if w["start"] <= t <= w["end"]), None)


def _who(run: Run, call_id: str, running_s: float) -> str:
    """A call the provider was running: its number, kind, tier and replica generation."""
    if call_id.startswith("c") and call_id[1:].isdigit() and int(call_id[1:]) < len(run.calls):
        c = run.calls[int(call_id[1:])]
        return (f"{call_id} {c.kind} {c.tier} r{c.replica}.{c.gen} {c.outcome} "
                f"sent {c.start - run.t0:.2f} ended {c.end - run.t0:.2f} "
                f"running {running_s:.2f} s")
    return f"{call_id or '?'} running {running_s:.2f} s"


def limits(run: Run) -> dict[str, Any]:
    windows = _windows(run)
    providers = {}
    bad_all: list[dict[str, Any]] = []
    allowed_all: list[dict[str, Any]] = []
    for name, limit in run.limits.items():
        seen = run.upstream["providers"][name]
        share = max(limit // run.replicas, 1)
        allowed = limit + (run.replicas - 1) * share
        inside, outside, bad = 0, 0, []
        names = {g.replica_id: g.name for g in run.generations if g.replica_id}
        for t, level, running, in_redis in seen["violations"]:
            window = _in(t - run.t0, windows)
            if window is None:
                outside += 1
            else:
                inside += 1
            record = {"provider": name, "at_s": round(t - run.t0, 2), "level": level,
                      "limit": limit if window is None else allowed,
                      "window": window and window["fault"],
                      "running": [_who(run, i, s) for i, s in running],
                      "leases_in_redis": None if in_redis is None else [
                          (names.get(m.split("|")[0], m.split("|")[0]), ms)
                          for m, ms in in_redis]}
            (bad if window is None or level > allowed else allowed_all).append(record)
        per_window = []
        for w in windows:
            most = max((m for s, m in seen["per_second"]
                        if s + 1 > w["start"] + run.t0 and s < w["end"] + run.t0), default=0)
            per_window.append({**{k: round(v, 1) if isinstance(v, float) else v
                                  for k, v in w.items()}, "most": most, "allowed": allowed})
        most_outside = max((m for s, m in seen["per_second"]
                            if _in(s - run.t0, windows) is None
                            and _in(s + 1 - run.t0, windows) is None), default=0)
        providers[name] = {
            "limit": limit, "most": seen["most"], "most_outside_windows": most_outside,
            "window_allowance": allowed, "over_ceiling": seen["over_ceiling_429"],
            "over_inside_windows": inside, "over_outside_windows": outside,
            "transient": seen["transient"], "calls": seen["calls"], "ok": seen["ok"],
            "storm_429": seen["storm_429"], "cut_by_provider": seen["cut"],
            "windows": per_window}
        bad_all += bad
    return {"passed": not bad_all, "providers": providers, "violations": bad_all[:20],
            "inside_windows": allowed_all[:20],
            "unplanned_fallbacks": unplanned(run)}


def _access_lines(run: Run, calls: list[Call]) -> dict[str, dict[str, Any]]:
    """What the replicas' access logs say of these calls (status, code, queue_ms)."""
    wanted = {f"soak-c{c.n}": (c.replica, c.gen) for c in calls}
    found: dict[str, dict[str, Any]] = {}
    for gen in run.generations:
        if (gen.replica, gen.gen) not in wanted.values() or not gen.log.exists():
            continue
        for line in gen.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"request_id":"soak-c' in line:
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if entry.get("request_id") in wanted:
                    found[entry["request_id"]] = {k: entry.get(k) for k in (
                        "status", "code", "queue_ms", "upstream", "duration_ms")}
    return found


def answered(run: Run) -> dict[str, Any]:
    gens = {(g.replica, g.gen): g for g in run.generations}
    for call in run.calls:
        gen = gens[(call.replica, call.gen)]
        if call.outcome in ("conn_error", "cut") and gen.how == "killed" and \
                gen.ended is not None and call.start <= gen.ended <= call.end + 1:
            call.outcome, call.detail = "killed", f"{gen.name} SIGKILLed: {call.detail}"
        if call.outcome == "status" and call.status == 500:
            call.outcome, call.detail = "internal", f"500 {call.code}"
    outcomes = Counter(c.outcome for c in run.calls)
    failing = [c for c in run.calls if c.outcome in FAILING or c.outcome == "internal"
               or not c.outcome]
    logged = _access_lines(run, failing[:20])
    twice = [i for i in run.upstream["served_twice"] if i.startswith("c")]
    statuses = Counter(str(c.status) for c in run.calls if c.status is not None)
    codes = Counter(c.code for c in run.calls if c.outcome in ("status", "stream_error")
                    and c.kind != "bad")
    return {
        "passed": not failing and not twice, "calls": len(run.calls),
        "not_sent_no_replica_up": run.skipped, "outcomes": dict(outcomes.most_common()),
        "statuses": dict(statuses.most_common()), "error_codes": dict(codes.most_common()),
        "by_kind": dict(Counter(c.kind for c in run.calls).most_common()),
        "served_twice_upstream": twice[:20],
        "failures": [{"n": c.n, "kind": c.kind, "tier": c.tier, "replica": f"r{c.replica}.{c.gen}",
                      "at_s": round(c.start - run.t0, 2), "took_s": round(c.end - c.start, 2),
                      "outcome": c.outcome or "unfinished", "status": c.status,
                      "code": c.code, "detail": c.detail,
                      "proxy_logged": logged.get(f"soak-c{c.n}")} for c in failing[:20]],
        "failures_total": len(failing)}


def batches(run: Run) -> dict[str, Any]:
    results = Counter(b.result for b in run.batches)
    wrong = [b for b in run.batches if b.result not in ("whole", "lost")]
    return {"passed": not wrong and results["whole"] > 0, "batches": len(run.batches),
            "results": dict(results), "lines_each": run.args["batch_lines"],
            "lines_answered_whole": sum(b.lines for b in run.batches if b.result == "whole"),
            "lost_with_redis_data": results["lost"],
            "wrong": [{"n": b.n, "id": b.id, "status": b.status, "result": b.result,
                       "counts": b.counts, "detail": b.detail, "missing": b.missing[:10],
                       "twice": b.twice[:10]} for b in wrong]}


def budget(run: Run) -> dict[str, Any]:
    billed = run.upstream["billed_usd"].get("k-budget", 0.0)
    bound = run.budget_usd + run.budget_call_usd
    spent = {name: ((found or {}).get("budgets") or {}).get("k-budget", {}).get("spent_usd")
             for name, found in run.statuses.items()}
    calls = Counter(c.outcome if c.status != 429 else f"429 {c.code}"
                    for c in run.calls if c.kind == "budget")
    passed = billed <= bound + 1e-9
    return {"passed": None if run.args["no_budget_check"] else passed, "would_pass": passed,
            "budget_usd": run.budget_usd, "one_call_usd": run.budget_call_usd,
            "billed_usd": round(billed, 6), "bound_usd": round(bound, 6),
            "times_the_budget": round(billed / run.budget_usd, 2),
            "replicas_say_spent": spent, "calls": dict(calls)}


def leases(run: Run) -> dict[str, Any]:
    held = {name: {k: (s or {}).get("state", {}).get(k) for k in ("leases_held", "waiting")}
            for name, s in run.statuses.items()}
    busy = {n: h for n, h in held.items() if h["leases_held"] or h["waiting"]}
    return {"passed": not run.leases_running and not run.leases_drained and not busy,
            "after_load": {k: len(v) for k, v in run.leases_running.items()},
            "after_drain": {k: len(v) for k, v in run.leases_drained.items()},
            "members_after_drain": {k: v[:5] for k, v in run.leases_drained.items()},
            "replicas_holding_after_load": busy}


def rss(run: Run, window_s: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for gen in run.generations:
        if gen.name not in run.final_rss or gen.how not in ("", "at the end"):
            continue
        first = [kib for t, kib in gen.rss if t <= window_s]
        age = run.load_end - gen.started
        final = run.final_rss[gen.name]
        if age < window_s + 10 or not first or final is None:
            rows.append({"generation": gen.name, "skipped": f"ran {age:.0f} s of load"})
            continue
        ref = max(first)
        row = {"generation": gen.name, "first_window_mib": round(ref / 1024, 1),
               "final_mib": round(final / 1024, 1),
               "peak_mib": round(max(k for _, k in gen.rss) / 1024, 1),
               "ratio": round(final / ref, 3)}
        rows.append(row)
        if final > ref * (1 + RSS_SLACK):
            bad.append(row)
    return {"passed": not bad, "slack": RSS_SLACK, "window_s": window_s, "replicas": rows}


def critical_wait(run: Run, bound_ms: float) -> dict[str, Any]:
    faults = [(f["start"], max(f["end"], f["settled"]) + 5) for f in run.faults]
    waits = [c.queue_ms for c in run.calls if c.tier == "critical" and c.queue_ms is not None]
    calm = [c.queue_ms for c in run.calls if c.tier == "critical" and c.queue_ms is not None
            and not any(a <= c.start <= b for a, b in faults)]
    p99 = percentile(waits, 0.99)
    by_tier = {}
    for tier in run.max_wait_s:
        found = [c.queue_ms for c in run.calls if c.tier == tier and c.queue_ms is not None]
        by_tier[tier] = {"n": len(found), "p50_ms": percentile(found, 0.5),
                         "p99_ms": percentile(found, 0.99), "max_ms": max(found, default=None)}
    calm_p99 = percentile(calm, 0.99)
    ceiling_ms = run.max_wait_s["critical"] * 1000
    passed = (p99 is not None and p99 <= ceiling_ms and calm_p99 is not None
              and calm_p99 <= bound_ms)
    return {"passed": passed, "bound_ms": bound_ms, "max_wait_ms": ceiling_ms,
            "n": len(waits), "p50_ms": percentile(waits, 0.5), "p99_ms": p99,
            "max_ms": max(waits, default=None), "n_outside_faults": len(calm),
            "p99_outside_faults_ms": calm_p99, "by_tier": by_tier}


def drains(run: Run) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [{"generation": g.name, "why": g.how, "exit": g.exit_code,
                                   "drain_s": round(g.drain_s or 0.0, 2)}
                                  for g in run.generations
                                  if g.how in ("terminated", "at the end")]
    bad = [r for r in rows if r["exit"] != 0
           or r["drain_s"] > run.drain_timeout_s + DRAIN_SLACK_S]
    return {"passed": not bad, "drains": rows, "bad": bad}


def modes(run: Run) -> tuple[dict[str, float], list[tuple[float, str, str]]]:
    """How long each generation was seen out of shared mode, and when its mode changed
    (from the twice-a-second polls)."""
    out: dict[str, float] = {}
    changes: list[tuple[float, str, str]] = []
    last: dict[str, tuple[float, str]] = {}
    for t, name, mode, *_ in run.polls:
        if name in last and last[name][1] != "shared":
            out[name] = out.get(name, 0.0) + t - last[name][0]
        if last.get(name, (0.0, "shared"))[1] != mode:
            changes.append((round(t - run.t0, 1), name, mode))
        last[name] = (t, mode)
    return {name: round(s, 1) for name, s in out.items()}, changes


def evaluate(run: Run) -> dict[str, Any]:
    checks = {
        "limits": limits(run), "answered": answered(run), "batches": batches(run),
        "budget": budget(run), "leases": leases(run),
        "rss": rss(run, run.args["rss_window"]),
        "critical_wait": critical_wait(run, run.args["critical_p99_ms"]),
        "drains": drains(run),
    }
    faults = [{"kind": f["kind"], "at_s": round(f["start"] - run.t0, 1),
               "took_s": round(f["end"] - f["start"], 1), "target": f["target"],
               "detail": f["detail"].lstrip("; "),
               **({"window_end_s": round(f["settled"] - run.t0, 1)} if f["settled"] else {})}
              for f in run.faults]
    out, changes = modes(run)
    return {"passed": all(c["passed"] is not False for c in checks.values()),
            "seconds": round(run.load_end - run.t0, 1), "faults": faults,
            "out_of_shared_mode_s": out, "mode_changes": changes, "checks": checks}


def render(report: dict[str, Any]) -> str:
    c = report["checks"]
    mark = {True: "PASS", False: "FAIL", None: "skip"}
    lines = [f"soak: {report['seconds']:.0f} s of load, {len(report['faults'])} faults"]
    for f in report["faults"]:
        window = f" (fallback window to {f['window_end_s']} s)" if "window_end_s" in f else ""
        lines.append(f"  {f['at_s']:7.1f} s  {f['kind']:<20} {f['target']:<6} "
                     f"{f['took_s']:5.1f} s {f['detail']}{window}")
    if report["out_of_shared_mode_s"]:
        lines.append(f"  out of shared mode (s): {report['out_of_shared_mode_s']}; "
                     f"changes (s, replica, mode): {report['mode_changes']}")
    lim = c["limits"]
    lines.append(f"[{mark[lim['passed']]}] limits")
    for name, p in lim["providers"].items():
        lines.append(f"    {name}: limit {p['limit']}, most seen {p['most']} "
                     f"(outside windows {p['most_outside_windows']}), over the ceiling "
                     f"{p['over_outside_windows']}x outside windows, "
                     f"{p['over_inside_windows']}x inside (allowed {p['window_allowance']}), "
                     f"{p['transient']} transient; {p['calls']} calls, {p['storm_429']} storm "
                     f"429s, {p['cut_by_provider']} streams cut by it")
        for w in p["windows"]:
            lines.append(f"      window {w['fault']} {w['start']}-{w['end']} s: most {w['most']}")
    for v in lim["violations"][:10]:
        lines.append(f"    ! {v}")
    for u in lim["unplanned_fallbacks"]:
        lines.append(f"    out of shared mode with no Redis fault: {u}")
    ans = c["answered"]
    lines.append(f"[{mark[ans['passed']]}] answered: {ans['calls']} calls, outcomes "
                 f"{ans['outcomes']}; statuses {ans['statuses']}")
    lines.append(f"    error codes {ans['error_codes']}; kinds {ans['by_kind']}; "
                 f"{ans['not_sent_no_replica_up']} not sent")
    for f in ans["failures"][:10]:
        lines.append(f"    ! {f}")
    if ans["served_twice_upstream"]:
        lines.append(f"    ! served twice upstream: {ans['served_twice_upstream']}")
    b = c["batches"]
    lines.append(f"[{mark[b['passed']]}] batches: {b['batches']} of {b['lines_each']} lines, "
                 f"{b['results']}, {b['lines_answered_whole']} lines answered once, "
                 f"{b['lost_with_redis_data']} lost with Redis' data")
    for w in b["wrong"]:
        lines.append(f"    ! {w}")
    bu = c["budget"]
    lines.append(f"[{mark[bu['passed']]}] budget: billed ${bu['billed_usd']} on a "
                 f"${bu['budget_usd']} budget (bound ${bu['bound_usd']}, "
                 f"{bu['times_the_budget']}x); replicas say {bu['replicas_say_spent']}; "
                 f"calls {bu['calls']}" + ("" if bu["would_pass"] else "  (would fail)"))
    le = c["leases"]
    lines.append(f"[{mark[le['passed']]}] leases: after the load {le['after_load']}, after "
                 f"the drain {le['after_drain']}, replicas holding "
                 f"{le['replicas_holding_after_load']}")
    r = c["rss"]
    lines.append(f"[{mark[r['passed']]}] rss (final within {r['slack']:.0%} of the highest "
                 f"in the first {r['window_s']:.0f} s):")
    for row in r["replicas"]:
        lines.append(f"    {row}")
    cw = c["critical_wait"]
    lines.append(f"[{mark[cw['passed']]}] critical queue wait: n {cw['n']}, p50 "
                 f"{cw['p50_ms']} ms, p99 {cw['p99_ms']} ms (bound: its max_wait_s, "
                 f"{cw['max_wait_ms']:.0f}), max {cw['max_ms']} ms; outside faults n "
                 f"{cw['n_outside_faults']}, p99 {cw['p99_outside_faults_ms']} ms (bound "
                 f"{cw['bound_ms']:.0f})")
    for tier, t in cw["by_tier"].items():
        lines.append(f"    {tier}: {t}")
    d = c["drains"]
    lines.append(f"[{mark[d['passed']]}] drains: {d['drains']}")
    lines.append("soak: " + ("PASSED" if report["passed"] else "FAILED"))
    return "\n".join(lines)
