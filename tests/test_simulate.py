"""``python -m proxy simulate``: traces in both forms, the real core replayed on a virtual
clock (every call ends served or refused, keys clamp tiers, priorities beat FCFS), and the
command line."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError, parse_config
from proxy.config.trace import SHIPPED_TRACE, TraceCall, read_calls
from proxy.core.call.estimate import LatencyModel
from proxy.core.scheduling.scheduler import Scheduler
from proxy.sim import workloads
from proxy.sim.disciplines import reference
from proxy.sim.report import compare_table, summary, table
from proxy.sim.run import simulate

ROOT = Path(__file__).resolve().parents[1]
CONFIG: dict[str, Any] = {
    "tiers": [{"name": "critical", "max_wait_s": 60}, {"name": "normal", "max_wait_s": 600},
              {"name": "low", "max_wait_s": 3600}],
    "classify": {"default_tier": "normal", "keys": [
        {"name": "app", "key": "a", "tier": "normal", "max_tier": "critical"},
        {"name": "batch", "key": "b", "tier": "low"}]},
    "providers": [{"name": "sim", "kind": "simulated", "max_concurrency": 2,
                   "simulate": {"ttft_s": 0.1, "tokens_per_s": 100}}],
    "models": {"m": [{"provider": "sim", "model": "s", "input_cost": 1, "output_cost": 2}]},
}


def test_traces_are_read_in_both_forms(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,tier,key,model,max_tokens,stream\n"
                   "2023-11-16 18:15:46.6805900,374,44,critical,app,m,100,false\n"
                   "2023-11-16 18:15:46.1805900,10,5,,,,,\n")
    assert read_calls(csv) == [TraceCall(-0.5, 10, 5), TraceCall(0.0, 374, 44, "critical",
                                                                 "app", "m", 100, False)]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 1.5, "prompt_tokens": 3, "output_tokens": 4, "tier": "low"}\n\n'
                     '{"t": 0, "prompt_tokens": 1, "output_tokens": 2, "max_tokens": 9, '
                     '"stream": false}\n')
    assert read_calls(jsonl) == [TraceCall(0.0, 1, 2, max_tokens=9, stream=False),
                                 TraceCall(1.5, 3, 4, tier="low")]
    assert len(read_calls(SHIPPED_TRACE)) == 3168


def test_trace_forms_from_the_field(tmp_path: Path) -> None:
    """An Excel BOM, mixed time zones, a serve log's 'listening' line."""
    csv = tmp_path / "t.csv"
    csv.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,1,2\n2023-11-16T19:15:47.68059+01:00,3,4\n")
    assert [c.t for c in read_calls(csv)] == [0.0, 1.0]
    log = tmp_path / "access.log"
    log.write_text("listening on http://127.0.0.1:8080\n" + json.dumps(
        {"ts": "2026-11-30T10:00:00.000Z", "path": "/v1/chat/completions", "tier": "low",
         "key": "batch", "model": "m", "prompt_tokens": 3, "completion_tokens": 4}) + "\n")
    assert read_calls(log) == [TraceCall(0.0, 3, 4, "low", "batch", "m", stream=False)]


def test_the_time_series_stays_bounded_whatever_the_span() -> None:
    config = parse_config(CONFIG, {})
    result = simulate(config, [TraceCall(0.0, 10, 10), TraceCall(1e8, 10, 10)])
    assert result.series is not None and len(result.series.times) <= 4096
    assert result.makespan_s > 1e8 - 1


@pytest.mark.parametrize(("name", "text", "message"), [
    ("t.jsonl", '{"t": -1}\n', "t.jsonl:1: t must be a number of seconds"),
    ("t.jsonl", '{"t": Infinity}\n', "t.jsonl:1: t must be a number of seconds"),
    ("t.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n",
     "t.csv:1: missing column GeneratedTokens"),
    ("t.jsonl", '{"t": 0}\n[1]\n', "t.jsonl:2: not a JSON object"),
    ("t.jsonl", '{"t": 0, "prompt_tokens": "x"}\n', "t.jsonl:1: prompt_tokens must be a whole"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnope,1,2\n", "t.csv:2: TIMESTAMP"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,-1,2\n",
     "t.csv:2: ContextTokens must not be negative"),
    ("t.jsonl", '{"t": 0, "stream": "sometimes"}\n', "t.jsonl:1: stream must be true or false"),
])
def test_a_bad_row_is_named(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_calls(path)
    assert message in str(info.value)


def workload() -> list[TraceCall]:
    """A burst of batch work, and urgent calls arriving through it."""
    calls = [TraceCall(i * 0.05, 100, 200, key="batch") for i in range(200)]
    calls += [TraceCall(1.0 + i * 0.5, 50, 50, tier="critical", key="app") for i in range(30)]
    calls += [TraceCall(2.0 + i * 0.7, 50, 100, key="app") for i in range(20)]
    return sorted(calls, key=lambda c: c.t)


def test_every_call_ends_and_priorities_beat_fcfs() -> None:
    config = parse_config(CONFIG, {})
    calls = workload()
    result = simulate(config, calls)
    assert len(result.outcomes) == len(calls)
    assert all(o.code is not None or o.done_at >= o.arrived for o in result.outcomes)
    report = summary(config, result)
    baseline = summary(config, reference(config, calls, [o.tier for o in result.outcomes], "fcfs"))
    tiers, fifo = report["tiers"], baseline["tiers"]
    assert isinstance(tiers, dict) and isinstance(fifo, dict)
    assert {name: t["n"] for name, t in tiers.items()} == {"critical": 30, "normal": 20,
                                                            "low": 200}
    assert tiers["critical"]["p99"] < 3.0 < fifo["critical"]["p99"]
    assert tiers["normal"]["mean"] < fifo["normal"]["mean"]
    # About the same work takes about as long (FCFS drops the urgent calls it kept waiting).
    assert report["calls"] == baseline["calls"] == 250
    assert fifo["critical"]["timeouts"] > 0 == tiers["critical"]["timeouts"]
    span, fifo_span = float(report["makespan_s"]), float(baseline["makespan_s"])  # type: ignore[arg-type]
    assert abs(span - fifo_span) < 0.1 * fifo_span
    providers = report["providers"]
    assert isinstance(providers, dict) and providers["sim"]["utilisation"] > 0.9
    # FCFS starts batch calls while urgent ones wait, over and over; the proxy only as the
    # fair share lends lower tiers their weighted turns.
    assert int(report["inversions"]) * 3 < int(baseline["inversions"])  # type: ignore[call-overload]


def test_keys_clamp_the_trace_tier_and_unknown_models_are_refused() -> None:
    config = parse_config(CONFIG, {})
    calls = [TraceCall(0, 10, 10, tier="critical", key="batch"),
             TraceCall(0, 10, 10, tier="critical", key="app"),
             TraceCall(0, 10, 10, model="nope")]
    result = simulate(config, calls)
    outcomes = result.outcomes
    assert [o.tier for o in outcomes[:2]] == ["low", "critical"]
    assert outcomes[2].code == "model_not_found"
    report = summary(config, result)
    assert report["unclassified"] == 1
    assert "1 refused before a tier" in table(report, "x")


def test_speed_compresses_arrivals() -> None:
    config = parse_config(CONFIG, {})
    calls = [TraceCall(i * 10.0, 10, 10) for i in range(10)]
    slow, fast = simulate(config, calls), simulate(config, calls, speed=10)
    assert slow.makespan_s > 90 and fast.makespan_s < 10
    with pytest.raises(ValueError):
        simulate(config, calls, speed=0)


@pytest.mark.e2e  # the command line, in a subprocess
def test_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(json.dumps(CONFIG))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"t": c.t, "prompt_tokens": c.prompt_tokens,
                                           "output_tokens": c.output_tokens, "tier": c.tier,
                                           "key": c.key}) for c in workload()))
    base = [sys.executable, "-m", "proxy", "simulate", "--config", str(config)]
    result = subprocess.run([*base, "--trace", str(trace), "--compare", "fcfs", "--json"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["calls"] == 250 and set(report["fcfs"]["tiers"]) == {"critical", "normal",
                                                                       "low"}
    assert set(report["tiers"]["critical"]) >= {"n", "mean", "p50", "p99", "max", "timeouts",
                                                "evicted"}
    # A second table on the same trace: two more slots.
    more = tmp_path / "more.yaml"
    more.write_text(json.dumps({**CONFIG, "providers": [
        {**CONFIG["providers"][0], "max_concurrency": 4}]}))
    text = subprocess.run([*base, "--config", str(more), "--trace", str(trace)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=True).stdout
    assert "critical" in text and "utilisation: sim" in text and "the second config" in text
    both = json.loads(subprocess.run(
        [*base, "--config", str(more), "--trace", str(trace), "--json"], capture_output=True,
        text=True, timeout=60, cwd=ROOT, check=True).stdout.strip().splitlines()[-1])
    assert both["against"]["tiers"]["low"]["mean"] < both["tiers"]["low"]["mean"]
    out = tmp_path / "report.html"
    subprocess.run([*base, "--trace", str(trace), "--compare", "fcfs", "--out", str(out)],
                   capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    page = out.read_text()
    for series in ('data-series="critical"', 'data-series="low (FCFS)"', "sim (of 2)"):
        assert series in page
    assert "<script" not in page and "http" not in page  # self-contained
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for extra, message in ((["--trace", str(tmp_path / "missing.csv")], "cannot read"),
                           (["--trace", str(empty)], "no calls in it"),
                           (["--trace", str(trace), "--speed", "0"], "--speed")):
        bad = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60,
                             cwd=ROOT, check=False)
        assert bad.returncode == 2 and message in bad.stderr


def test_the_shipped_trace_simulates_in_well_under_a_few_seconds() -> None:
    config = parse_config(CONFIG, {})
    calls = read_calls(SHIPPED_TRACE)
    started = time.perf_counter()
    result = simulate(config, calls)
    took = time.perf_counter() - started
    assert len(result.outcomes) == 3168 and took < 5.0


async def test_observe_then_replay(aiohttp_client: Any, counter: Any, tmp_path: Path) -> None:
    """The proxy's own JSON access log is a trace, and fits the latency model."""
    from aiohttp.test_utils import TestClient

    from proxy.http.server.app import build_app
    from proxy.sim.fit import fit

    config = parse_config({**CONFIG, "providers": [
        {"name": "sim", "kind": "simulated", "max_concurrency": 4,
         "simulate": {"ttft_s": 0.05, "tokens_per_s": 100}}], "access_log": {}}, {})
    log = io.StringIO()
    client: TestClient[Any, Any] = await aiohttp_client(build_app(
        config, counter=counter, access_stream=log))
    for i in range(8):
        key, stream = ("a", True) if i % 2 else ("b", i % 4 == 0)
        resp = await client.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}", "X-Priority": "critical"}, json={
            "model": "m", "max_tokens": 20, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]})
        await resp.read()
    await client.post("/v1/chat/completions", json={"model": "m"})  # refused: not replayed
    path = tmp_path / "access.log"
    path.write_text(log.getvalue())
    calls = read_calls(path)
    assert len(calls) == 8 and calls[0].t == 0.0 and calls[-1].t > 0
    assert {(c.key, c.tier) for c in calls} == {("app", "critical"), ("batch", "low")}
    assert all(c.output_tokens == 20 and c.model == "m" for c in calls)
    assert [c.stream for c in calls] == [i % 2 == 1 or i % 4 == 0 for i in range(8)]
    model = fit(path.read_text().splitlines())["sim"]
    assert model["calls"] == 8
    assert 0.04 <= model["ttft_s"] <= 0.1 and 60 <= model["tokens_per_s"] <= 120
    outcomes = simulate(config, calls).outcomes
    assert [o.tier for o in outcomes].count("critical") == 4
    result = subprocess.run([sys.executable, "-m", "proxy", "fit", "--log", str(path)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    assert "- name: sim\n  simulate: {ttft_s: " in result.stdout


SHARES = (("app", 0.3), ("other", 0.3), ("batch", 0.4))


def keyed_slice(start_s: float, length_s: float) -> list[TraceCall]:
    """A slice of the shipped trace, its calls spread over three keys (so three tiers)."""
    calls = []
    for i, call in enumerate(c for c in read_calls(SHIPPED_TRACE)
                             if start_s <= c.t < start_s + length_s):
        share, key = (i * 0.618034) % 1.0, "batch"
        if share < 0.3:
            key = "app"
        elif share < 0.6:
            key = "other"
        calls.append(TraceCall(call.t - start_s, call.prompt_tokens,
                               max(1, call.output_tokens), key=key,
                               max_tokens=max(1, call.output_tokens)))
    return calls


@pytest.mark.parametrize("start_s", [0.0, 200.0, 450.0])
def test_the_readme_guarantees_hold_on_real_arrivals(start_s: float) -> None:
    """Real arrivals past the provider's capacity: the urgent tier is served at once while
    FCFS lets it time out, no call is lost, and priorities cost no throughput."""
    config = parse_config({
        **CONFIG, "tiers": [{"name": "critical", "max_wait_s": 10},
                            {"name": "high", "max_wait_s": 30},
                            {"name": "normal", "max_wait_s": 120},
                            {"name": "low", "max_wait_s": 900}],
        "classify": {"default_tier": "normal", "keys": [
            {"name": "app", "key": "a", "tier": "high"},
            {"name": "other", "key": "o", "tier": "normal"},
            {"name": "batch", "key": "b", "tier": "low"}]},
        "providers": [{"name": "sim", "kind": "simulated", "max_concurrency": 4,
                       "simulate": {"ttft_s": 0.2, "tokens_per_s": 150}}],
    }, {})
    calls = keyed_slice(start_s, 120.0)
    result = simulate(config, calls)
    baseline = reference(config, calls, [o.tier for o in result.outcomes], "fcfs")
    ours, theirs = summary(config, result), summary(config, baseline)
    tiers, fifo = ours["tiers"], theirs["tiers"]
    assert isinstance(tiers, dict) and isinstance(fifo, dict)
    assert sum(t["n"] for t in tiers.values()) == len(calls) > 300
    assert all(o.code is not None or not math.isnan(o.done_at) for o in result.outcomes)
    high = tiers["high"]
    assert high["timeouts"] == 0 and high["p99"] < 0.3 * fifo["high"]["p99"]
    # Work-conserving: the provider is as busy as under FCFS, and more calls are served.
    served = sum(1 for o in result.outcomes if o.code is None)
    assert served >= sum(1 for o in baseline.outcomes if o.code is None)
    ours_util = ours["providers"]["sim"]["utilisation"]  # type: ignore[index]
    assert ours_util >= theirs["providers"]["sim"]["utilisation"] - 0.03  # type: ignore[index]
    assert int(ours["inversions"]) < int(theirs["inversions"])  # type: ignore[call-overload]


def test_provider_faults_are_replayed_as_live() -> None:
    """429s past a provider's real capacity are absorbed (the adaptive limit learns it);
    a failing provider trips its breaker and the calls are refused, never hung."""
    calls = [TraceCall(i * 0.1, 10, 50, key="app") for i in range(100)]
    throttling = parse_config({**CONFIG, "providers": [
        {"name": "sim", "kind": "simulated", "max_concurrency": 6,
         "simulate": {"ttft_s": 0.1, "tokens_per_s": 100, "capacity": 2}}]}, {})
    result = simulate(throttling, calls)
    assert all(o.code is None for o in result.outcomes)  # no 429 reached a client
    assert result.makespan_s < 100 * 0.6 / 2 + 30  # about two at a time, as it allows
    broken = parse_config({**CONFIG, "providers": [
        {"name": "sim", "kind": "simulated", "max_concurrency": 6,
         "breaker": {"consecutive_failures": 3, "cooldown_s": 5},
         "simulate": {"ttft_s": 0.1, "tokens_per_s": 100, "error_rate": 1.0}}]}, {})
    codes = {o.code for o in simulate(broken, calls).outcomes}
    assert None not in codes and codes <= {"upstream_error", "upstream_unavailable"}
    assert "upstream_unavailable" in codes  # the breaker opened


def wide(mean: float, timeouts: int, makespan: float) -> dict[str, object]:
    """A report whose figures are wider than the columns they used to be given."""
    tier = {"n": 3168, "mean": mean, "p50": 119.65, "p99": 120.0, "max": 123456.0,
            "timeouts": timeouts, "evicted": 0, "refused": 1234567, "cost_usd": 123456.5}
    return {"calls": 3168, "unclassified": 0, "makespan_s": makespan, "inversions": 0,
            "tiers": {"a-long-tier-name-of-a-table": tier},
            "keys": {"support-chat": {"n": 1, "share": 0.5, "p90": 102345.0},
                     "nightly-batch": {"n": 1, "share": 0.5, "p90": 0.5}},
            "providers": {"sim": {"utilisation": 0.96}}}


def cells(line: str) -> list[str]:
    """A line's cells: the columns are two spaces apart, and no cell holds two spaces."""
    return re.split(r" {2,}", line.strip())


def test_the_side_by_side_table_keeps_every_column_apart() -> None:
    # A miss count of 902 beside 102.33 s read "902102.33 s" in the fixed-width table.
    text = compare_table({"triage-proxy": wide(102.3, 902, 790.0),
                          "fcfs": wide(102.33, 1234930, 123456.9)})
    head, titles, row, span, _, chat, batch = text.splitlines()
    assert cells(row) == ["a-long-tier-name-of-a-table (3168)",
                          "102.30 s / 120.00 s / 123456.00 s", "902",
                          "102.33 s / 120.00 s / 123456.00 s", "1234930"]
    assert cells(span) == ["makespan", "790.0 s", "123456.9 s"]
    assert cells(chat) == ["support-chat", "50% 102345.00 s", "50% 102345.00 s"]
    assert cells(batch) == ["nightly-batch", "50% 500 ms", "50% 500 ms"]
    # Right-aligned: each figure ends where its heading does.
    for above, heading, line, figure in ((head, "triage-proxy", span, "790.0 s"),
                                         (head, "fcfs", span, "123456.9 s"),
                                         (titles, "miss", row, " 902 "),
                                         (head, "fcfs", row, "1234930")):
        figure = figure.rstrip()
        assert above.index(heading) + len(heading) == line.index(figure) + len(figure)


def test_the_tier_table_keeps_every_column_apart() -> None:
    lines = table(wide(102.3, 902, 790.0), "x").splitlines()
    assert cells(lines[1]) == ["tier", "n", "mean", "p50", "p99", "max", "timeouts",
                               "evicted", "refused", "cost $"]
    assert cells(lines[2]) == ["a-long-tier-name-of-a-table", "3168", "102.30 s", "119.65 s",
                               "120.00 s", "123456.00 s", "902", "0", "1234567", "123456.5000"]
    assert all(len(line) == len(lines[1]) for line in lines[1:3])


def test_a_wake_up_runs_a_pass_only_while_the_scheduler_still_asks_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Live keeps one timer and re-arms it whenever the scheduler's next wake-up changes
    (``Admission._rearm``), so a wake-up it no longer asks for never fires. The simulator
    must not run a pass there either: a pass books the headroom's idle time, so an extra
    one resizes holds (it made the simulator hand held slots to the low tier that live
    kept for high, the normal tier's p99 2.56 s against 1.97 s live)."""
    asked: list[float | None] = []
    fired: list[tuple[float, float | None]] = []
    next_wakeup, advance = Scheduler.next_wakeup, Scheduler.advance

    def asking(scheduler: Scheduler, now: float) -> float | None:
        asked.append(next_wakeup(scheduler, now))
        return asked[-1]

    def firing(scheduler: Scheduler, now: float) -> None:
        fired.append((now, asked[-1] if asked else None))
        advance(scheduler, now)

    monkeypatch.setattr(Scheduler, "next_wakeup", asking)
    monkeypatch.setattr(Scheduler, "advance", firing)
    config = parse_config({**CONFIG, "classify": {"default_tier": "normal", "keys": [
        {"name": "app", "key": "a", "tier": "critical"},
        {"name": "other", "key": "o", "tier": "normal"},
        {"name": "batch", "key": "b", "tier": "low"}]}, "providers": [
        {"name": "sim", "kind": "simulated", "max_concurrency": 6,
         "simulate": {"ttft_s": 0.2, "tokens_per_s": 250}}]}, {})
    simulate(config, keyed_slice(0.0, 60.0))
    assert len(fired) > 5
    stale = [(now, wanted) for now, wanted in fired
             if wanted is None or not wanted <= now <= wanted + 1e-6]
    assert not stale


def test_the_latency_model_learns_a_time_to_first_token_only_from_streams(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Live sees a call's time to first token only when it streams; the simulator's
    estimator learns as live's does (learning it from calls sent whole made the estimates
    of a code trace's long-prompt calls twice live's)."""
    learned: list[tuple[bool, float | None]] = []
    observe = LatencyModel.observe

    def observing(model: LatencyModel, deployment: str, ttft_s: float | None,
                  *args: Any) -> None:
        learned.append((ttft_s is not None, ttft_s))
        observe(model, deployment, ttft_s, *args)

    monkeypatch.setattr(LatencyModel, "observe", observing)
    calls = [TraceCall(i * 1.0, 100, 10, stream=i % 2 == 0) for i in range(6)]
    simulate(parse_config(CONFIG, {}), calls)
    assert [seen for seen, _ in learned] == [True, False] * 3
    assert all(ttft is not None and ttft > 0.09 for seen, ttft in learned if seen)



def test_the_simulator_replays_the_keys_budgets_as_live_keeps_them() -> None:
    """A key with $0.01 a day, calls of 100 output tokens at $10 a million ($0.001 each),
    four slots: it is served about ten calls' worth (each reserved at dispatch, settled at
    its cost), the rest refused ``budget_exceeded`` on arrival or at dispatch; a key
    without a budget is served every call."""
    data = workloads.table(4, keys=[{"name": "gold", "tier": "normal",
                                     "budget_usd": {"amount": 0.01, "period": "day"}},
                                    {"name": "free", "tier": "normal"}])
    data["models"]["m"][0].update({"input_cost": 0.0, "output_cost": 10.0})  # type: ignore[index]
    rows = [workloads.call(i * 0.5, 1.0, "normal", key) for i in range(30)
            for key in ("gold", "free")]
    sim = simulate(parse_config(data, {}), rows)
    gold = [o for o in sim.outcomes if o.key == "gold"]
    served = [o for o in gold if o.code is None]
    assert 9 <= len(served) <= 10
    assert {o.code for o in gold} == {None, "budget_exceeded"}
    assert sum(o.cost_usd for o in served) == pytest.approx(0.01, abs=0.0011)
    assert all(o.code is None for o in sim.outcomes if o.key == "free")
