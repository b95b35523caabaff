"""What a replay gives back, whichever discipline replayed the calls: each call's outcome,
the queue depths and calls in flight over time, and the priority inversions counted."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class Outcome:
    """What became of one call of the trace."""

    arrived: float
    tier: str = ""
    key: str | None = None  # the name of the call's key
    wait_s: float = math.nan  # queued time, every pass included
    code: str | None = None  # the error code of a refused call
    provider: str | None = None
    service_s: float = 0.0
    cost_usd: float = 0.0
    done_at: float = math.nan
    early: bool = False  # refused when it arrived: it could not start in time
    inside_s: float = 0.0  # waited inside a self-hosted server for one of its slots


MAX_SAMPLES = 4096  # per series, whatever the simulated span


@dataclass
class Series:
    """Queue depth per tier and calls in flight per provider, once per ``step_s`` of
    simulated time (the state in force at each step). The step starts at one second and
    doubles whenever the samples pass MAX_SAMPLES (each kept sample the larger of a pair,
    so peaks survive): memory is bounded whatever the trace's span."""

    step_s: float = 1.0
    times: list[float] = field(default_factory=list)
    depth: dict[str, list[int]] = field(default_factory=dict)
    inflight: dict[str, list[int]] = field(default_factory=dict)

    def add(self, t: float, depth: dict[str, int], inflight: dict[str, int]) -> None:
        self.times.append(t)
        for tier, count in depth.items():
            self.depth[tier].append(count)
        for provider, count in inflight.items():
            self.inflight[provider].append(count)
        if len(self.times) > MAX_SAMPLES:
            self.times = self.times[::2]
            for values in (*self.depth.values(), *self.inflight.values()):
                values[:] = [max(values[i:i + 2]) for i in range(0, len(values), 2)]
            self.step_s *= 2


@dataclass
class Simulation:
    outcomes: list[Outcome]
    makespan_s: float
    busy_s: dict[str, float]  # slot-seconds of service per provider
    # Starts of a call while a more urgent one that could use the same provider waited
    # (the fair share gives lower tiers their weighted turns: not all of these are wrong).
    inversions: int = 0
    series: Series | None = None


class Waiting:
    """Calls waiting, counted per provider and tier, for priority inversions."""

    def __init__(self, tiers: int) -> None:
        self._tiers = tiers
        self._counts: dict[str, list[int]] = {}
        self.inversions = 0

    def add(self, providers: Iterable[str], tier: int, delta: int = 1) -> None:
        for provider in providers:
            self._counts.setdefault(provider, [0] * self._tiers)[tier] += delta

    def started(self, provider: str, tier: int) -> None:
        """A call of ``tier`` (no longer counted as waiting) started on ``provider``."""
        if any(self._counts.get(provider, [0] * self._tiers)[:tier]):
            self.inversions += 1


def makespan(outcomes: Sequence[Outcome]) -> float:
    """From the first arrival to the last call's end (served, or refused)."""
    if not outcomes:
        return 0.0
    ends = [o.done_at if not math.isnan(o.done_at) else o.arrived + (
        0.0 if math.isnan(o.wait_s) else o.wait_s) for o in outcomes]
    return max(ends) - min(o.arrived for o in outcomes)
