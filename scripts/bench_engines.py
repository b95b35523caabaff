"""The scoreboard's self-hosted scenarios beside two routing tables that do not read the
servers: ``max_concurrency`` set to each server's real slots (what an operator who knew
them would write) and guessed at 16 (what one who did not might). Same calls, same
simulator (``proxy.sim``): the critical tier's p99 wait, calls that waited inside a server,
and the slot-seconds the servers spent serving.

    .venv/bin/python scripts/bench_engines.py
"""

from __future__ import annotations

import dataclasses

from proxy.config import parse_config
from proxy.core.quantile import percentile
from proxy.sim import scenarios, workloads
from proxy.sim.disciplines import slots_of
from proxy.sim.results import Simulation
from proxy.sim.run import simulate

NAMES = ("engine-slots", "engine-unequal", "engine-slows")
HIDDEN = ("slots", "slows_past")  # what the server is, whatever the table says


def variant(scenario: workloads.Scenario, limit: dict[str, int] | int) -> dict[str, object]:
    """The scenario's table with ``max_concurrency`` set and no engine nor ``auto``."""
    providers = scenario.table["providers"]
    assert isinstance(providers, list)
    return workloads.self_hosted({
        p["name"]: {"max_concurrency": limit if isinstance(limit, int) else limit[p["name"]],
                    **{k: v for k, v in p["simulate"].items() if k in HIDDEN}}
        for p in providers})


def line(label: str, sim: Simulation) -> str:
    waits = sorted(o.wait_s for o in sim.outcomes if o.tier == "critical")
    inside = sum(o.inside_s > 0 for o in sim.outcomes)
    return (f"  {label:36s} critical p99 {percentile(waits, 0.99):6.2f} s   "
            f"waited inside {inside:4d} of {len(sim.outcomes):4d}   "
            f"slot-s served {sum(sim.busy_s.values()):7.0f}")


def main() -> None:
    for name in NAMES:
        scenario = scenarios.scenario(name)
        print(f"{name}: {scenario.about}")
        print(line("learned (engine; auto: latency)",
                   simulate(scenario.config, scenario.calls)))
        known = dataclasses.replace(scenario, table=variant(scenario, slots_of(scenario.config)))
        print(line("max_concurrency = the real slots", simulate(known.config, known.calls)))
        guessed = parse_config(variant(scenario, 16), {})
        print(line("max_concurrency guessed: 16", simulate(guessed, scenario.calls)))


if __name__ == "__main__":
    main()
