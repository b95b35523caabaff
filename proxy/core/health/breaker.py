"""Circuit breaker per deployment: a pure state machine driven by ``now`` (monotonic seconds).

CLOSED ──(N consecutive failures, or error rate over the window)──▶ OPEN
OPEN ──(cooldown ends; checked lazily on every call)──▶ HALF_OPEN
HALF_OPEN ──(``half_open_probes`` probes all succeed)──▶ CLOSED
HALF_OPEN ──(a probe fails)──▶ OPEN, with a longer cooldown

A 429 is throttling, not sickness: ``on_throttle`` counts no failure (pausing the
deployment is the scheduler's business, ``proxy.core.scheduling.capacity``). Verdicts that
arrive while OPEN, or in HALF_OPEN with no probe outstanding, come from calls started
before the breaker opened and are ignored; pass ``started`` (the call's ``now`` at
``acquire``) and every verdict of a call started before the current state began is
ignored, so a slow stale call can never pass for a probe.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .limits import RollingCounts


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The members under plain names, for the hot paths (why: see scheduling/tickets.py).
CLOSED: Final = BreakerState.CLOSED
OPEN: Final = BreakerState.OPEN
HALF_OPEN: Final = BreakerState.HALF_OPEN


@dataclass(frozen=True)
class BreakerSettings:
    consecutive_failures: int = 5
    error_rate: float = 0.5
    window_s: float = 30.0
    min_calls: int = 20
    cooldown_s: float = 5.0
    cooldown_max_s: float = 60.0
    jitter: float = 0.2
    half_open_probes: int = 1

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or self.min_calls < 1 or self.half_open_probes < 1:
            raise ValueError("consecutive_failures, min_calls, half_open_probes must be >= 1")
        if self.window_s <= 0 or self.cooldown_s <= 0 or self.cooldown_max_s <= 0:
            raise ValueError("window_s, cooldown_s and cooldown_max_s must be positive")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")


class Breaker:
    """One deployment's health. ``acquire`` before a call; exactly one of ``on_success``,
    ``on_failure``, ``on_throttle`` or ``on_abandon`` after it (in a ``finally``).

    Cooldowns double with each opening (capped at ``cooldown_max_s``, then jittered by
    ±``jitter`` and capped again); the doubling starts over once the breaker has stayed
    closed for ``cooldown_max_s``.
    """

    def __init__(
        self,
        settings: BreakerSettings,
        rng: random.Random,
        on_transition: Callable[[BreakerState, BreakerState, float], None] | None = None,
    ) -> None:
        self.settings = settings
        self._rng = rng
        self._on_transition = on_transition
        self._state = CLOSED
        self._window = RollingCounts(settings.window_s)
        self._consecutive = 0
        self._open_until = -math.inf
        self._probes_left = 0
        self._probes_out = 0
        self._probe_successes = 0
        self._streak = 0
        self._closed_at = -math.inf
        self._since = -math.inf
        self.opened_count = 0

    def retune(self, settings: BreakerSettings) -> None:
        """New settings (a reload): the state is kept; a new window length starts the
        window's counts over."""
        if settings.window_s != self.settings.window_s:
            self._window = RollingCounts(settings.window_s)
        self.settings = settings

    def state(self, now: float) -> BreakerState:
        if self._state is OPEN and now >= self._open_until:
            self._probes_left = self.settings.half_open_probes
            self._probes_out = 0
            self._probe_successes = 0
            self._move(HALF_OPEN, self._open_until)
        return self._state

    @property
    def open_until(self) -> float:
        """When the current (or last) opening ends."""
        return self._open_until

    def down(self, now: float) -> bool:
        """Open: no call may start (half-open lets probes through)."""
        return self.state(now) is OPEN

    def available(self, now: float) -> bool:
        """A call may start now: closed, or half-open with a probe left."""
        state = self.state(now)
        return state is CLOSED or (state is HALF_OPEN and self._probes_left > 0)

    def acquire(self, now: float) -> bool:
        if not self.available(now):
            return False
        if self._state is HALF_OPEN:
            self._probes_left -= 1
            self._probes_out += 1
        return True

    def trip(self, until: float, now: float) -> None:
        """Open until ``until`` because another replica opened it (its cooldown, not a
        new one of this breaker's own); nothing if it is open already."""
        if until <= now or self.state(now) is OPEN:
            return
        self._open_until = until
        self.opened_count += 1
        self._probes_left = 0
        self._probes_out = 0
        self._move(OPEN, now)

    def on_success(self, now: float, started: float | None = None) -> None:
        state = self.state(now)
        if self._stale(started):
            return
        if state is CLOSED:
            self._consecutive = 0
            self._window.add("calls", now)
        elif state is HALF_OPEN and self._probes_out > 0:
            self._probes_out -= 1
            self._probe_successes += 1
            if self._probe_successes >= self.settings.half_open_probes:
                self._close(now)

    def on_failure(self, now: float, started: float | None = None) -> None:
        state = self.state(now)
        if self._stale(started):
            return
        if state is CLOSED:
            self._consecutive += 1
            self._window.add("calls", now)
            self._window.add("failures", now)
            if self._should_open(now):
                self._open(now)
        elif state is HALF_OPEN and self._probes_out > 0:
            self._open(now)

    def on_throttle(self, now: float, started: float | None = None) -> None:
        """A 429: no verdict on health; a probe's permit comes back."""
        self.on_abandon(now, started)

    def on_abandon(self, now: float, started: float | None = None) -> None:
        state = self.state(now)
        if state is HALF_OPEN and self._probes_out > 0 and not self._stale(started):
            self._probes_out -= 1
            self._probes_left += 1

    def retry_at(self, now: float) -> float:
        """When a call could next be started: ``now`` if available. While every probe is
        out, there is no schedule; one base cooldown is the estimate."""
        if self.available(now):
            return now
        if self._state is OPEN:
            return self._open_until
        return now + self.settings.cooldown_s

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "state": self.state(now).value,
            "available": self.available(now),
            "consecutive_failures": self._consecutive,
            "window_calls": self._window.total("calls", now),
            "window_failures": self._window.total("failures", now),
            "opened_count": self.opened_count,
            "probes_in_flight": self._probes_out,
            "retry_at": self.retry_at(now),
            "retry_in_s": self.retry_at(now) - now,
        }

    def _should_open(self, now: float) -> bool:
        settings = self.settings
        if self._consecutive >= settings.consecutive_failures:
            return True
        calls = self._window.total("calls", now)
        failures = self._window.total("failures", now)
        return calls >= settings.min_calls and failures >= settings.error_rate * calls

    def _open(self, now: float) -> None:
        settings = self.settings
        if now - self._closed_at >= settings.cooldown_max_s and self._state is CLOSED:
            self._streak = 0
        base = min(settings.cooldown_max_s, settings.cooldown_s * 2.0 ** min(self._streak, 60))
        jittered = base * (1.0 + self._rng.uniform(-settings.jitter, settings.jitter))
        self._open_until = now + min(settings.cooldown_max_s, jittered)
        self._streak += 1
        self.opened_count += 1
        self._probes_left = 0
        self._probes_out = 0
        self._move(OPEN, now)

    def _close(self, now: float) -> None:
        self._consecutive = 0
        self._window.clear()
        self._closed_at = now
        self._move(CLOSED, now)

    def _stale(self, started: float | None) -> bool:
        return started is not None and started < self._since

    def _move(self, new: BreakerState, since: float) -> None:
        old, self._state = self._state, new
        self._since = since
        if self._on_transition is not None:
            self._on_transition(old, new, since)
