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

With one key (no keys configured: every caller is one), the order is arrival order.
"""

from __future__ import annotations

from .lru import Lru

# Keys remembered per tier; one forgotten simply starts afresh at the tier's virtual time.
MAX_KEYS = 100_000


class KeyTags:
    def __init__(self, tiers: int) -> None:
        self.virtual = [0.0] * tiers
        self._finish: list[Lru[str, float]] = [Lru(MAX_KEYS) for _ in range(tiers)]

    def arrive(self, tier: int, key: str, weight: float, seconds: float) -> float:
        """The virtual start of a new call of ``key`` in ``tier`` claiming ``seconds``."""
        finish = self._finish[tier]
        start = finish.get(key)
        now = self.virtual[tier]
        if start is None or start < now:
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
