"""Headroom: slots per provider that less urgent tiers may not take from more urgent ones.

Calls cannot be preempted, so a short urgent call that arrives when every slot holds a long
job waits for the next one to finish. Holding back a few free slots avoids that, and the
right number follows the urgent tiers' recent offered load: an EWMA of arrivals x estimated
service seconds is the number of slots they keep busy. A tier that has not seen an arrival
for a whole horizon holds nothing, so the reservation costs nothing when no urgent work
flows. A fixed per-tier reserve replaces the adaptive value for that tier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Loads this far under a whole slot round down, so a trickle of urgent calls reserves nothing.
_ROUND_DOWN = 0.05
# Wake-ups are placed this much past the computed lapse so rounding cannot wake us early.
_LAPSE_MARGIN_S = 1e-6


class Headroom:
    def __init__(self, tiers: int, scale: float, horizon_s: float) -> None:
        self._tiers = tiers
        self._scale = scale
        self._horizon = horizon_s
        self._load: dict[str, list[float]] = {}
        self._stamp: dict[str, list[float]] = {}

    def record(self, provider: str, tier: int, service_s: float, now: float) -> None:
        """A call of ``tier`` that will most likely run on ``provider`` arrived."""
        load = self._load.setdefault(provider, [0.0] * self._tiers)
        stamp = self._stamp.setdefault(provider, [-math.inf] * self._tiers)
        load[tier] = self._decayed(load[tier], stamp[tier], now) + service_s / self._horizon
        stamp[tier] = now

    def offered(self, provider: str, tier: int, now: float) -> float:
        """Recent offered load of ``tier`` on ``provider``, in busy slots."""
        load = self._load.get(provider)
        if load is None:
            return 0.0
        return self._decayed(load[tier], self._stamp[provider][tier], now)

    def held(self, provider: str, now: float, fixed: Sequence[int | None],
             capacity: int) -> list[int]:
        """Per tier, how many free slots of ``provider`` that tier must leave alone."""
        ceiling = max(capacity - 1, 0)
        out = [0] * self._tiers
        load = 0.0
        held = 0
        for tier in range(self._tiers):
            out[tier] = min(held, ceiling)
            load += self.offered(provider, tier, now)
            held = max(held, self._hold(fixed[tier], load))
        return out

    def lapse_time(self, provider: str, tier: int, target: int, now: float,
                   fixed: Sequence[int | None], capacity: int) -> float | None:
        """A time no later than when the slots held against ``tier`` fall to ``target`` or
        fewer (None: never, a fixed reserve holds them). Earlier is fine: the caller asks
        again then."""
        if max(capacity - 1, 0) <= target:
            return now
        latest = now
        load = 0.0
        cutoff = math.inf
        for j in range(tier):
            own = self.offered(provider, j, now)
            load += own
            if own > 0:
                cutoff = min(cutoff, self._stamp[provider][j] + self._horizon)
            if self._hold(fixed[j], load) <= target:
                continue
            if fixed[j] is not None:
                return None
            decay = self._horizon * math.log(self._scale * load / (target + _ROUND_DOWN))
            latest = max(latest, min(now + decay + _LAPSE_MARGIN_S, cutoff))
        return latest

    def _hold(self, fixed: int | None, load: float) -> int:
        if fixed is not None:
            return fixed
        return max(0, math.ceil(self._scale * load - _ROUND_DOWN))

    def _decayed(self, value: float, stamp: float, now: float) -> float:
        if now >= stamp + self._horizon:  # the very expression lapse_time wakes up at
            return 0.0
        return value * math.exp(-(now - stamp) / self._horizon)
