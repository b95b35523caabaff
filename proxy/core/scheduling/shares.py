"""Fairness among keys inside a tier: start-time fair queueing of slot-seconds.

Each tier has a virtual time; each (tier, key) a virtual finish. A call arriving from a key
starts at the later of the two, and moves the key's finish on by its estimated seconds
over the key's weight; the queue serves, within a tier and level, the call with the
earliest start. So a key that sends a burst queues behind itself, a key that sends a call
now and then finds it near the front, and two keys that both keep calls waiting are
served slot-seconds in proportion to their weights. The tier's virtual time is the start
of the last call it dispatched, so a key that was quiet banks nothing. A key's finish is
corrected by what its calls really took when their slots come back, so a key whose calls
claim less than they take pays for what they took.

With one key (no keys configured: every call is of one), the order is arrival order.
"""

from __future__ import annotations

import math

# Keys remembered per tier (past it, the older half is forgotten: a key forgotten simply
# starts afresh at the tier's virtual time).
MAX_KEYS = 100_000
# What /admin/status shows of the keys' shares: slot-seconds served, an EWMA over this long,
# and at most this many keys per tier (the busiest).
SHARE_HORIZON_S = 60.0
SHOWN_KEYS = 50


class KeyTags:
    def __init__(self, tiers: int) -> None:
        self.virtual = [0.0] * tiers
        self._finish: list[dict[str, float]] = [{} for _ in range(tiers)]

    def arrive(self, tier: int, key: str, weight: float, seconds: float) -> float:
        """The virtual start of a new call of ``key`` in ``tier`` claiming ``seconds``."""
        finish = self._finish[tier]
        start = finish.get(key)
        now = self.virtual[tier]
        if start is None:
            start = now
            if len(finish) >= MAX_KEYS:  # forget the older half (in arrival order)
                self._finish[tier] = finish = dict(list(finish.items())[MAX_KEYS // 2:])
        elif start < now:
            start = now
        finish[key] = start + seconds / weight
        return start

    def started(self, tier: int, tag: float) -> None:
        """A call of ``tier`` with virtual start ``tag`` got a slot."""
        if tag > self.virtual[tier]:
            self.virtual[tier] = tag

    def correct(self, tier: int, key: str, weight: float, delta_s: float) -> None:
        """A call of ``key`` took ``delta_s`` more (or less) than it claimed."""
        finish = self._finish[tier]
        found = finish.get(key)
        if found is not None:
            finish[key] = found + delta_s / weight


class KeyStats:
    """Per (tier, key): calls queued, slot-seconds served lately (an EWMA over
    ``SHARE_HORIZON_S``) and the mean wait of its calls lately, for ``/admin/status``."""

    def __init__(self, tiers: int) -> None:
        self._tiers = tiers
        self._stats: dict[tuple[int, str], list[float]] = {}  # [s, stamp, n, wait]

    def _get(self, tier: int, key: str) -> list[float]:
        found = self._stats.get((tier, key))
        if found is None:
            if len(self._stats) >= MAX_KEYS:  # forget the older half with nothing queued
                kept = list(self._stats.items())
                self._stats = {k: v for i, (k, v) in enumerate(kept)
                               if v[2] or i >= MAX_KEYS // 2}
            found = self._stats[(tier, key)] = [0.0, -math.inf, 0.0, 0.0]
        return found

    def queued(self, tier: int, key: str, delta: int) -> None:
        found = self._stats.get((tier, key))
        (self._get(tier, key) if found is None else found)[2] += delta

    def served(self, tier: int, key: str, seconds: float, now: float,
               wait_s: float | None = None) -> None:
        stats = self._get(tier, key)
        served = _decayed(stats, now) + seconds
        stats[0] = served if served > 0.0 else 0.0
        stats[1] = now
        if wait_s is not None:
            stats[3] += 0.1 * (wait_s - stats[3]) if stats[3] else wait_s

    def snapshot(self, now: float) -> list[dict[str, dict[str, object]]]:
        """Per tier, its keys (the busiest ``SHOWN_KEYS``): ``queued``, ``share`` of the
        tier's recent slot-seconds, ``served_s`` and ``mean_wait_s`` (``status``
        adds ``starts_in_s``)."""
        tiers: list[list[tuple[str, list[float], float]]] = [[] for _ in range(self._tiers)]
        for (tier, key), stats in list(self._stats.items()):
            if tier < self._tiers:
                tiers[tier].append((key, stats, _decayed(stats, now)))
        out: list[dict[str, dict[str, object]]] = []
        for keys in tiers:
            total = sum(served for _, _, served in keys) or 1.0
            busiest = sorted(keys, key=lambda k: (-k[2], -k[1][2]))[:SHOWN_KEYS]
            out.append({key or "(none)": {
                "queued": int(stats[2]), "served_s": round(served, 3),
                "share": round(served / total, 4), "mean_wait_s": round(stats[3], 3)}
                for key, stats, served in busiest if served > 1e-9 or stats[2]})
        return out


def _decayed(stats: list[float], now: float) -> float:
    age = now - stats[1]
    return stats[0] * math.exp(-age / SHARE_HORIZON_S) if age > 0.0 else stats[0]
