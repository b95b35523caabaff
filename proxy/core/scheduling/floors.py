"""Floors: each tier's guaranteed share of every provider's slot-seconds.

A tier of weight ``w`` is guaranteed ``w / W`` (``W`` the sum of every tier's weight) of
the slot-seconds a provider serves while the tier has calls waiting for it. Each provider
keeps a *credit* per tier, in slot-seconds: whenever the provider starts a call, every tier
with calls waiting for it earns its share of that call's charge, and the tier of the call
pays the whole charge (corrected by what the call really took when its slot comes back).
The credit never falls below zero and drops to zero when the tier stops waiting, so it is
the largest shortfall of any window that ends now and in which the tier waited throughout:
being served above the floor by urgency, or idling, banks nothing.

A tier is *owed* once its credit, less what its running calls claimed beyond the charge
they were capped at (``Policy.uncharged``), reaches one of its longest calls (the longest
recent service time of its calls on the provider; a call cannot be served in parts, so a
floor is kept call by call); the policy then
gives it the next free slot before urgency decides (``policy``), paced against
the most urgent waiting tier by their shares. So in any
window in which a tier waits throughout, it is served at least its share of what was
served there, less about two longest calls (one to become owed, one for a slot to free).
Time alone changes no credit, so floors never need a wake-up.
"""

from __future__ import annotations

from collections.abc import Sequence

# Credit is kept below this many of the provider's longest calls (a tier that cannot be
# served for a while must not then take every slot for a long time).
CAP_CALLS = 2.0


class Floors:
    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self._credit: dict[str, list[float]] = {}

    @property
    def weights(self) -> list[float]:
        return self._weights

    @weights.setter
    def weights(self, weights: Sequence[float]) -> None:
        total = sum(weights)
        self._weights = list(weights)
        self.shares = [w / total if total else 0.0 for w in weights]

    def _row(self, pool: str) -> list[float]:
        found = self._credit.get(pool)
        if found is None:
            found = self._credit[pool] = [0.0] * len(self._weights)
        return found

    def serve(self, pool: str, tier: int, seconds: float, waiting: Sequence[int],
              cap: float, refund: float = 0.0) -> float:
        """``pool`` served ``seconds`` (negative: gave them back) to ``tier`` while the tiers
        with a nonzero ``waiting`` count waited for it; no credit grows past ``cap``.
        Returns what ``tier``'s credit paid for it. Seconds given back return to ``tier``
        at most the ``refund`` it paid for them, so a charge the floor at zero absorbed is
        not paid back as credit nobody earned."""
        credit = self._row(pool)
        shares = self.shares
        paid = 0.0
        for t, count in enumerate(waiting):
            share = shares[t]
            if not share:
                continue
            value = credit[t]
            if count:
                value += share * seconds
            else:
                value = 0.0  # it stopped waiting: no banked credit
            if t == tier:
                if seconds >= 0.0:
                    paid = value if value < seconds else seconds
                    value -= seconds
                else:
                    value += refund if refund < -seconds else -seconds
            credit[t] = cap if value > cap else 0.0 if value < 0.0 else value
        return paid

    def credits(self, pool: str) -> list[float] | None:
        """Each tier's credit on ``pool`` (None: no tier has had any)."""
        return self._credit.get(pool)

    def snapshot(self, pool: str) -> list[float]:
        return [round(c, 3) for c in self._credit.get(pool, [0.0] * len(self._weights))]
