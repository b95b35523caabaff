"""Headroom: free slots per provider that less urgent tiers must leave to more urgent ones.

Calls cannot be preempted, so a short urgent call that arrives when every slot holds a long
job waits for the next one to finish. Keeping a few slots free avoids that.

- Adaptive (the default): the urgent tiers' recent offered load, an EWMA of arrivals x
  estimated service seconds, is the number of slots they keep busy; times ``scale`` it is
  what they should be able to hold. Slots they already run on count towards it, so only the
  rest is kept free. A tier that has been quiet for a few of its usual gaps between
  arrivals (at most a horizon) holds nothing: with no urgent work flowing, and as soon as
  a burst is over, the reservation costs nothing.
- Fixed: a tier's ``reserve`` is a plain count of free slots, replacing its adaptive value.

What is held against a tier is the largest hold of any more urgent tier, and never every
slot of a provider: each tier can always use one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Loads this far under a whole slot round down, so a trickle of urgent calls reserves nothing.
_ROUND_DOWN = 0.05
# Wake-ups are placed this much past the computed lapse so rounding cannot wake us early.
_LAPSE_MARGIN_S = 1e-6
# A tier is quiet after this many of its mean gaps between arrivals without one.
_QUIET_GAPS = 4.0


class Headroom:
    def __init__(self, tiers: int, scale: float, horizon_s: float) -> None:
        self._tiers = tiers
        self._scale = scale
        self._horizon = horizon_s
        self._load: dict[str, list[float]] = {}
        self._rate: dict[str, list[float]] = {}
        self._stamp: dict[str, list[float]] = {}
        self._quiet: dict[str, list[float]] = {}
        self._unheard = [-math.inf] * tiers  # a provider with no arrival yet: quiet

    def record(self, provider: str, tier: int, service_s: float, now: float) -> None:
        """A call of ``tier`` that will most likely run on ``provider`` arrived."""
        if provider not in self._load:
            self._load[provider] = [0.0] * self._tiers
            self._rate[provider] = [0.0] * self._tiers
            self._stamp[provider] = [-math.inf] * self._tiers
            self._quiet[provider] = [-math.inf] * self._tiers
        load, rate = self._load[provider], self._rate[provider]
        stamp, quiet = self._stamp[provider], self._quiet[provider]
        load[tier] = self._decayed(load[tier], stamp[tier], quiet[tier], now)
        rate[tier] = self._decayed(rate[tier], stamp[tier], quiet[tier], now)
        load[tier] += service_s / self._horizon
        rate[tier] += 1.0 / self._horizon
        stamp[tier] = now
        gap = _QUIET_GAPS / rate[tier]  # conditions, not min()/max(): 5x cheaper on 3.11
        quiet[tier] = now + (gap if gap < self._horizon else self._horizon)

    def correct(self, provider: str, tier: int, delta_s: float, since: float,
                now: float) -> None:
        """A call of ``tier`` recorded at ``since`` took ``delta_s`` more (or less) than its
        estimate: the offered load learns what the call really cost."""
        load = self._load.get(provider)
        if load is None:
            return
        stamp, quiet = self._stamp[provider][tier], self._quiet[provider][tier]
        current = self._decayed(load[tier], stamp, quiet, now)
        if current <= 0.0:
            return
        age = now - since
        weight = math.exp(-(0.0 if age < 0.0 else age) / self._horizon)
        corrected = current + delta_s * weight / self._horizon
        load[tier] = corrected if corrected > 0.0 else 0.0
        self._stamp[provider][tier] = now
        # The rate decays from the same stamp, so bring it along.
        rate = self._rate[provider]
        age = now - stamp
        rate[tier] = rate[tier] * math.exp(-(0.0 if age < 0.0 else age) / self._horizon)

    def rate(self, provider: str, tier: int, now: float) -> float:
        """Recent arrivals of ``tier`` at ``provider``, per second."""
        rate = self._rate.get(provider)
        if rate is None:
            return 0.0
        return self._decayed(rate[tier], self._stamp[provider][tier],
                             self._quiet[provider][tier], now)

    def offered(self, provider: str, tier: int, now: float) -> float:
        """Recent offered load of ``tier`` on ``provider``, in busy slots, as claimed."""
        load = self._load.get(provider)
        if load is None:
            return 0.0
        return self._decayed(load[tier], self._stamp[provider][tier],
                             self._quiet[provider][tier], now)

    def held(self, provider: str, now: float, fixed: Sequence[int | None],
             running: Sequence[int], capacity: int) -> list[int]:
        """Per tier, how many free slots of ``provider`` that tier must leave alone;
        ``running`` counts the provider's calls in flight per tier."""
        return [self.held_against(provider, tier, now, fixed, running, capacity)
                for tier in range(self._tiers)]

    def held_against(self, provider: str, tier: int, now: float, fixed: Sequence[int | None],
                     running: Sequence[int], capacity: int) -> int:
        """The free slots of ``provider`` that ``tier`` must leave alone: the largest hold
        of any more urgent tier, never every slot."""
        ceiling = capacity - 1
        if not tier or ceiling <= 0:
            return 0
        quiets = self._quiet.get(provider, self._unheard)
        loads, stamps = self._load.get(provider, quiets), self._stamp.get(provider, quiets)
        load = 0.0
        busy = 0
        held = 0
        for urgent in range(tier):
            if now < quiets[urgent]:  # as _decayed: a quiet tier's load is 0
                load += loads[urgent] * math.exp(-(now - stamps[urgent]) / self._horizon)
            busy += running[urgent]
            fixed_hold = fixed[urgent]
            if fixed_hold is not None:
                hold = fixed_hold
            elif load:  # no recent load holds nothing (_hold's own answer, sooner)
                hold = self._hold(None, load, busy)
            else:
                continue
            if hold > held:
                held = hold
        return ceiling if ceiling < held else held

    def lapse_time(self, provider: str, tier: int, target: int, now: float,
                   fixed: Sequence[int | None], running: Sequence[int],
                   capacity: int) -> float | None:
        """A time no later than when the slots held against ``tier`` fall to ``target`` or
        fewer, if nothing else changes (None: never, a fixed reserve holds them). Earlier is
        fine: the caller asks again then."""
        if max(capacity - 1, 0) <= target:
            return now
        latest = now
        load = 0.0
        busy = 0
        cutoff = math.inf
        for j in range(tier):
            own = self.offered(provider, j, now)
            load += own
            busy += running[j]
            if own > 0:
                cutoff = min(cutoff, self._quiet[provider][j])
            if self._hold(fixed[j], load, busy) <= target:
                continue
            if fixed[j] is not None:
                return None
            enough = (target + busy + _ROUND_DOWN) / self._scale
            decay = self._horizon * math.log(load / enough)
            latest = max(latest, min(now + decay + _LAPSE_MARGIN_S, cutoff))
        return latest

    def _hold(self, fixed: int | None, load: float, busy: int) -> int:
        if fixed is not None:
            return fixed
        return max(0, math.ceil(self._scale * load - _ROUND_DOWN) - busy)

    def _decayed(self, value: float, stamp: float, quiet: float, now: float) -> float:
        if now >= quiet:  # lapse_time wakes up at exactly this instant
            return 0.0
        return value * math.exp(-(now - stamp) / self._horizon)
