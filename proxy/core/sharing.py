"""Weighted fair sharing of slot-seconds across tiers.

Serving a call charges its tier ``seconds / weight`` of virtual time: the estimate when the
call starts, corrected by what it really took when its slot comes back, so a call that
lied about its size costs its tier what it used, not what it claimed. A tier that starts
waiting again is brought up to the *floor*, the virtual time of the most under-served
waiting tier, so idling banks no credit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class FairShare:
    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self.virtual = [0.0] * len(weights)
        self._active = [False] * len(weights)
        self.floor = 0.0

    def charge(self, tier: int, seconds: float) -> None:
        self.virtual[tier] += seconds / self.weights[tier]

    def sync(self, depth: Sequence[int]) -> float:
        """Bring tiers that start waiting up to the floor; returns the new floor."""
        lowest = math.inf
        for tier, active in enumerate(self._active):
            waiting = depth[tier] > 0
            if waiting and not active:
                self.virtual[tier] = max(self.virtual[tier], self.floor)
            self._active[tier] = waiting
            if waiting and self.virtual[tier] < lowest:
                lowest = self.virtual[tier]
        if lowest != math.inf:
            self.floor = max(self.floor, lowest)
        return self.floor
