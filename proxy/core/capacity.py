"""What each provider can take right now: slots per pool, gates per deployment.

A *pool* is one provider's slots: ``limit`` calls at once, the effective limit an
adaptive-concurrency rule moves between 1 and ``max_concurrency``: halved by a 429 (one
cut per ``hold_s``), +1 after ``limit`` successes, and +1 every ``grow_every_s`` without
a cut, so a provider that went quiet after a cut is probed again with traffic it no
longer gets. A pool may be *paused* (its own rate limit or quota is spent) until a time.

A *deployment* (``provider/model``) has a gate: *paused* until a time (a 429 with
``retry-after``, the provider's quota headers), *down* until a time (its breaker is open:
queued calls that have no other candidate are refused), and at most ``probes`` calls at
once while its breaker is half-open.

Everything here is state driven by ``now``; ``proxy.core.scheduler`` is its only user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Adaptive concurrency: one cut per this many seconds (a burst of 429s from calls already
# in flight is one signal), and how often the limit grows back by one without a cut.
HOLD_S = 1.0
GROW_EVERY_S = 5.0


@dataclass
class Pool:
    name: str
    max_concurrency: int
    limit: int = 0
    inflight: int = 0
    paused_until: float = -math.inf
    running: list[int] = field(default_factory=list)  # calls in flight, per tier
    deployments: list[Gate] = field(default_factory=list)
    _successes: int = 0
    _cut_at: float = -math.inf
    _grow_at: float = math.inf

    def __post_init__(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError("max_concurrency must not be negative")
        self.limit = self.max_concurrency

    def free(self, now: float) -> int:
        """Slots that may be handed out at ``now``."""
        if now < self.paused_until:
            return 0
        self._grow(now)
        return max(0, self.limit - self.inflight)

    def cut(self, now: float) -> None:
        """A 429: halve the limit (floor 1), at most once per ``HOLD_S``."""
        self._grow(now)
        if now - self._cut_at < HOLD_S:
            return
        self.limit = max(min(1, self.limit), self.limit // 2)
        self._successes = 0
        self._cut_at = now
        self._grow_at = now + GROW_EVERY_S if self.limit < self.max_concurrency else math.inf

    def succeed(self, now: float) -> None:
        """A call went through: +1 after ``limit`` of them (none counted just after a cut)."""
        self._grow(now)
        if now - self._cut_at < HOLD_S or self.limit >= self.max_concurrency:
            return
        self._successes += 1
        if self._successes >= self.limit:
            self._raise(now)

    def set_max(self, max_concurrency: int, now: float) -> None:
        """A new configured maximum: the limit follows it unless a 429 cut it, in which
        case it keeps growing back, now towards the new maximum."""
        self._grow(now)
        was_full = self.limit >= self.max_concurrency
        self.max_concurrency = max_concurrency
        if was_full:
            self.limit = max_concurrency
        self.limit = min(max(self.limit, 1 if max_concurrency else 0), max_concurrency)
        if self.limit >= max_concurrency:
            self._grow_at = math.inf
        elif not math.isfinite(self._grow_at):
            self._grow_at = now + GROW_EVERY_S

    def next_change(self, now: float) -> float:
        """When ``free`` may next grow by time alone (pause ends, limit grows back)."""
        if now < self.paused_until:
            return self.paused_until
        self._grow(now)
        return self._grow_at

    def _grow(self, now: float) -> None:
        while now >= self._grow_at:
            self._raise(self._grow_at)

    def _raise(self, at: float) -> None:
        self.limit = min(self.limit + 1, self.max_concurrency)
        self._successes = 0
        self._grow_at = at + GROW_EVERY_S if self.limit < self.max_concurrency else math.inf


@dataclass
class Gate:
    """One deployment's own availability, inside its pool's."""

    id: str
    pool: Pool
    inflight: int = 0
    paused_until: float = -math.inf
    down_until: float = -math.inf
    probes: int | None = None  # concurrent calls allowed once down_until passes (half-open)

    def open(self, now: float) -> bool:
        """Whether a call may be sent through this gate at ``now`` (slots aside)."""
        if now < self.paused_until or now < self.down_until:
            return False
        return self.probes is None or self.inflight < self.probes

    def down(self, now: float) -> bool:
        return now < self.down_until

    def next_change(self, now: float) -> float:
        """When ``open`` may turn true by time alone (inf: not by time)."""
        until = max(self.paused_until, self.down_until)
        return until if until > now else math.inf
