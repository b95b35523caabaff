"""The scoreboard over several seeds: each scenario's shape drawn again (seed 0 is the
scoreboard's own calls), every seed replayed as on the scoreboard, and the bounds judged
once on all of them together.

A bound on a p99 judged on one seed's calls turns on a handful of calls: one unlucky
arrival moves it past strict priority's by more than any policy change does. Pooled, each
seed's calls follow the last one's after everything of it ended, under every discipline
(so no wait, busy slot or window spans two seeds); the p99s, floors, idle time and key
shares are then those of all the calls, and the makespans add up (so does the makespan
bound's allowance of one longest call). A tier's load at its peak is the highest of any
seed's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from .disciplines import DISCIPLINES
from .results import Outcome, Simulation
from .scoreboard import Row, judged, peak_loads, replay
from .workloads import Scenario

GAP_S = 1.0  # between the end of one seed's calls and the next seed's first arrival


def pooled(build: Callable[[int], Scenario], seeds: int,
           disciplines: Sequence[str] = DISCIPLINES) -> Row:
    """The scenario ``build`` makes, over seeds 0 to ``seeds`` - 1, judged as one."""
    started = time.perf_counter()
    first = build(0)
    drawn = [first] + [build(seed) for seed in range(1, seeds)]
    if all(s.calls == first.calls for s in drawn):  # its calls are not random
        drawn = [first]
    runs = [replay(s, disciplines) for s in drawn]
    offsets = [0.0]
    for sims in runs[:-1]:
        offsets.append(offsets[-1] + max(_end(sim) for sim in sims.values()) + GAP_S)
    calls = tuple(dataclasses.replace(c, t=c.t + at) for s, at in zip(drawn, offsets, strict=True)
                  for c in s.calls)
    merged = {name: _merge([sims[name] for sims in runs], offsets) for name in runs[0]}
    about = first.about + (f" (seeds 0-{len(drawn) - 1})" if len(drawn) > 1 else "")
    peaks = [peak_loads(s) for s in drawn]
    loads = {tier: max(p[tier] for p in peaks) for tier in peaks[0]}
    row = judged(dataclasses.replace(first, about=about, calls=calls), merged, loads,
                 len(drawn))
    row.took_s = time.perf_counter() - started
    return row


def _end(sim: Simulation) -> float:
    """When the last of the simulation's calls was done with (served, refused or timed out),
    its first arrival at 0."""
    return max((o.done_at if not math.isnan(o.done_at) else o.arrived + (
        0.0 if math.isnan(o.wait_s) else o.wait_s)) for o in sim.outcomes)


def _merge(sims: Sequence[Simulation], offsets: Sequence[float]) -> Simulation:
    outcomes: list[Outcome] = []
    busy: dict[str, float] = {}
    for sim, at in zip(sims, offsets, strict=True):
        outcomes += [dataclasses.replace(o, arrived=o.arrived + at, done_at=o.done_at + at)
                     for o in sim.outcomes]
        for provider, seconds in sim.busy_s.items():
            busy[provider] = busy.get(provider, 0.0) + seconds
    return Simulation(outcomes, sum(s.makespan_s for s in sims), busy,
                      sum(s.inversions for s in sims))
