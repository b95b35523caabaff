"""The scoreboard: every scenario under the proxy and the reference disciplines, and the
policy's bounds (``proxy.sim.scoreboard``) holding on each; and the reference disciplines
themselves on calls small enough to check by hand."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.config.trace import TraceCall
from proxy.core.quantile import percentile
from proxy.sim.disciplines import reference, slots_of, static_slots
from proxy.sim.heldout import HELD_OUT
from proxy.sim.run import simulate
from proxy.sim.scenarios import BUILDERS
from proxy.sim.scoreboard import Row, checks, idle_while_waiting, replay, run
from proxy.sim.seeds import pooled
from proxy.sim.workloads import Scenario, call, config

ROOT = Path(__file__).resolve().parents[1]


class Board(dict[str, Row]):
    """Each scenario's row, and the CPU time the whole board took."""

    cpu_s = 0.0


# The whole scoreboard, every workload through the simulator as `scripts/scoreboard` runs
# it, takes 20-40 s: the policy end to end, so its tests are e2e (tests/markers.py).
@pytest.fixture(scope="module")
def board() -> Board:
    started = time.process_time()
    rows = Board((name, run(build(0))) for name, build in BUILDERS.items())
    rows.cpu_s = time.process_time() - started
    return rows


def test_the_library_has_the_workloads_the_policy_is_judged_on() -> None:
    assert len(BUILDERS) >= 12
    for name in ("seed-peak", "critical-2x", "noisy-neighbour", "weighted-keys",
                 "empty-above", "throttled", "lying-estimates", "heavy-tail", "bursts"):
        assert name in BUILDERS


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_bound_holds(board: dict[str, Row], name: str) -> None:
    row = board[name]
    failed = [f"{c.name}: {c.detail}" for c in row.checks if c.required and not c.ok]
    assert not failed, failed


@pytest.mark.e2e
def test_the_bounds_the_issue_names_are_checked_where_they_apply(board: dict[str, Row]) -> None:
    """Each kind of bound is required on at least one scenario, so none can pass by never
    applying."""
    required = {c.name for row in board.values() for c in row.checks if c.required}
    assert required >= {"urgent", "floors", "fits", "deadlines", "makespan", "idle", "keys",
                        "within"}
    seed = {c.name: c for c in board["seed-peak"].checks}
    assert re.search(r"FCFS [0-9.]+ s \(0\.[01][0-9]x\)", seed["urgent"].detail)  # <= 0.15x
    light = next(c for c in board["noisy-neighbour"].checks if c.name == "keys")
    assert light.ok and light.required


@pytest.mark.e2e
def test_the_whole_scoreboard_takes_seconds(board: Board) -> None:
    # CPU time: a loaded machine stretched the wall clock's 20-40 s to 126 s once.
    assert board.cpu_s < 90.0


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_bound_holds_on_other_seeds_too(name: str) -> None:
    """The same shapes drawn again (seeds 0-2, judged together): a bound that held on seed
    0's calls by luck fails here."""
    row = pooled(BUILDERS[name], 3)
    failed = [f"{c.name}: {c.detail}" for c in row.checks if c.required and not c.ok]
    assert not failed, failed


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(HELD_OUT))
def test_every_bound_holds_on_workloads_the_policy_was_not_tuned_on(name: str) -> None:
    """Other rates of the peak on seeds the tuning never drew, and a real code trace where
    the scoreboard has a synthetic shape (``proxy.sim.heldout``), three draws judged
    together as above. One draw alone misses the urgent bound on some (docs/policy.md)."""
    row = pooled(HELD_OUT[name], 3)
    failed = [f"{c.name}: {c.detail}" for c in row.checks if c.required and not c.ok]
    assert not failed, failed


def with_settings(build: Callable[[int], Scenario], reserve: int | None = None,
                  **scheduler: object) -> Callable[[int], Scenario]:
    """``build``'s scenario with chat (``high``) given a fixed ``reserve``, or other
    scheduler settings."""
    def built(seed: int) -> Scenario:
        scenario = build(seed)
        table = copy.deepcopy(scenario.table)
        table["scheduler"].update(scheduler)  # type: ignore[attr-defined]
        for spec in table["tiers"]:  # type: ignore[attr-defined]
            if spec["name"] == "high" and reserve is not None:
                spec["reserve"] = reserve
        return dataclasses.replace(scenario, table=table)
    return built


def draws_of(build: Callable[[int], Scenario], seeds: int) -> dict[str, float]:
    """The proxy alone on seeds 0 to ``seeds`` - 1 of ``build``, pooled: each tier's p99
    wait, the makespans added up, and the share of the slot-time served that holds left
    idle while calls waited."""
    waits: dict[str, list[float]] = {}
    span = idle = served = 0.0
    for seed in range(seeds):
        scenario = build(seed)
        sim = simulate(scenario.config, scenario.calls)
        for o in sim.outcomes:
            waits.setdefault(o.tier, []).append(o.wait_s)
        span += sim.makespan_s
        gaps, work = idle_while_waiting(sim, sum(slots_of(scenario.config).values()))
        idle, served = idle + gaps, served + work
    out = {tier: percentile(sorted(w), 0.99) for tier, w in waits.items()}
    return {**out, "makespan": span, "idle": idle / served}


@pytest.mark.e2e
def test_the_seed_peak_beside_a_fixed_reserve() -> None:
    """The adaptive headroom against the hand-written `reserve: 2` on chat, 50 draws of the
    seed peak pooled (one draw's chat p99 turns on one episode of a few dozen calls). With
    the default budget (1.5 %): chat p99 0.95 s against 0.85 s, and better on analysis,
    brief, the makespan and idle time (8.9 / 28.1 s / 2,265 s / 1.6 % against 9.8 / 32.1 s /
    2,439 s / 7.3 %). Given `headroom_budget: 0.03` it beats it on all five (0.71 s, 9.5 /
    28.7 s / 2,289 s / 2.9 %)."""
    build = BUILDERS["seed-peak"]
    fixed = draws_of(with_settings(build, reserve=2), 50)
    adaptive = draws_of(build, 50)
    spent = draws_of(with_settings(build, headroom_budget=0.03), 50)
    for mine, chat in ((adaptive, 1.2), (spent, 0.9)):
        assert mine["high"] <= chat * fixed["high"]
        assert mine["normal"] <= fixed["normal"] and mine["low"] <= fixed["low"]
        assert mine["makespan"] <= fixed["makespan"]
        assert mine["idle"] <= 0.5 * fixed["idle"]
    assert adaptive["idle"] <= 0.25 * fixed["idle"]


def test_a_seed_draws_other_calls_of_the_same_shape() -> None:
    for name in ("seed-peak", "code-4-a", "heavy-tail"):
        build = BUILDERS[name]
        zero, one = build(0), build(1)
        assert zero.calls == build(0).calls and one.calls == build(1).calls
        assert zero.calls != one.calls and zero.table == one.table
    assert BUILDERS["critical-2x"](3).calls == BUILDERS["critical-2x"](0).calls  # not random


def test_seeds_are_pooled_one_after_the_other() -> None:
    build = BUILDERS["seed-peak"]
    alone = [run(build(seed)) for seed in range(3)]
    row = pooled(build, 3)
    assert len(row.scenario.calls) == sum(len(r.scenario.calls) for r in alone)
    for name in ("proxy", "fcfs", "priority"):
        spans = [r.reports[name]["makespan_s"] for r in alone]
        assert row.reports[name]["makespan_s"] == pytest.approx(sum(spans), abs=0.01)
        assert row.reports[name]["calls"] == sum(r.reports[name]["calls"] for r in alone)
    starts = sorted(c.t for c in row.scenario.calls)
    first = len(alone[0].scenario.calls)
    assert starts[first] > max(r.reports[n]["makespan_s"] for r in alone[:1]
                               for n in ("proxy", "fcfs", "priority", "wfq"))
    assert pooled(BUILDERS["critical-2x"], 3).reports == run(BUILDERS["critical-2x"](0)).reports


def test_the_makespan_bound_allows_one_longest_call_a_draw() -> None:
    """Pooled draws add their makespans up, so the bound's allowance of one longest call
    (a non-preemptive order may end one call later) adds up too: N draws that each hold
    the bound must not fail it together."""
    scenario = BUILDERS["code-28-a"](0)
    sims = replay(scenario)
    longest = max(o.service_s for o in sims["proxy"].outcomes)
    late = dataclasses.replace(sims["proxy"],
                               makespan_s=1.02 * sims["fcfs"].makespan_s + 2 * longest)

    def makespan(draws: int) -> bool:
        return next(c.ok for c in checks(scenario, {**sims, "proxy": late}, None, draws)
                    if c.name == "makespan")

    assert not makespan(1)
    assert makespan(3)


def two_tiers(slots: int = 1) -> object:
    return config(slots, [{"name": "high", "weight": 2, "max_wait_s": 100},
                          {"name": "low", "weight": 1, "max_wait_s": 100}])


def waits(calls: list[TraceCall], discipline: str, slots: int = 1) -> list[float]:
    cfg = two_tiers(slots)
    sim = reference(cfg, calls, [c.tier or "" for c in calls], discipline)  # type: ignore[arg-type]
    return [round(o.wait_s, 6) for o in sim.outcomes]


def test_fcfs_serves_in_arrival_order_and_priority_by_tier() -> None:
    calls = [call(0.0, 1.0, "low"), call(0.1, 1.0, "low"), call(0.2, 1.0, "high")]
    assert waits(calls, "fcfs") == [0.0, 0.9, 1.8]
    assert waits(calls, "priority") == [0.0, 1.9, 0.8]


def test_wfq_shares_slot_seconds_by_weight() -> None:
    """Both tiers backlogged with 1 s calls, weights 2:1: high is served two calls for each
    of low's."""
    calls = [call(0.0, 1.0, tier) for tier in ("high", "low") for _ in range(30)]
    cfg = two_tiers()
    sim = reference(cfg, calls, [c.tier or "" for c in calls], "wfq")  # type: ignore[arg-type]
    first = sorted((o.wait_s, o.tier) for o in sim.outcomes)[:30]
    assert [t for _, t in first].count("high") == 20


def test_a_call_gives_up_at_its_tiers_max_wait() -> None:
    calls = [call(0.0, 500.0, "low"), call(1.0, 1.0, "high")]
    cfg = two_tiers()
    sim = reference(cfg, calls, ["low", "high"], "fcfs")  # type: ignore[arg-type]
    assert sim.outcomes[1].code == "queue_timeout" and sim.outcomes[1].wait_s == 100.0


@pytest.mark.parametrize(("slots", "weights", "expected"), [
    (10, (4, 2, 1), [5, 3, 2]),          # one each, then the rest by weight
    (4, (8, 4, 2, 1), [1, 1, 1, 1]),
    (2, (8, 4, 2, 1), [1, 1, 0, 0]),
    (10, (1, 0), [10, 0]),               # background owns nothing
])
def test_static_slots_follow_the_weights(slots: int, weights: tuple[float, ...],
                                        expected: list[int]) -> None:
    assert static_slots(slots, weights) == expected


def test_static_slots_idle_while_another_tier_waits() -> None:
    calls = [call(0.0, 1.0, "low"), call(0.0, 1.0, "low")]
    assert waits(calls, "static", slots=3) == [0.0, 1.0]  # low owns one slot of three


@pytest.mark.e2e  # the command lines, in subprocesses
def test_the_command_lines(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 0.1, "prompt_tokens": 10,
                                         "output_tokens": 50, "tier": t}) + "\n"
                             for i, t in enumerate(["low", "normal", "critical"] * 20)))
    base = [sys.executable, "-m", "proxy", "simulate", "--config", str(ROOT / "routing.yaml"),
            "--trace", str(trace)]
    shown = subprocess.run([*base, "--compare", "fcfs,priority,wfq,static"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    assert "side by side:" in shown.stdout and "strict priority" in shown.stdout
    report = json.loads(subprocess.run(
        [*base, "--compare", "priority,wfq", "--json"], capture_output=True, text=True,
        timeout=60, cwd=ROOT, check=True).stdout.splitlines()[-1])
    assert set(report) >= {"priority", "wfq", "tiers", "keys"}
    bad = subprocess.run([*base, "--compare", "lifo"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "unknown discipline 'lifo'" in bad.stderr
    board = subprocess.run([sys.executable, "-m", "proxy", "scoreboard", "--only",
                            "critical-2x,noisy-neighbour", "--json"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert board.returncode == 0, board.stdout
    scored = json.loads(board.stdout.splitlines()[-1])["scenarios"]
    assert set(scored) == {"critical-2x", "noisy-neighbour"}
    assert all(s["ok"] for s in scored.values())
    unknown = subprocess.run([sys.executable, "-m", "proxy", "scoreboard", "--only", "nope"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert unknown.returncode == 2 and "unknown scenario 'nope'" in unknown.stderr
