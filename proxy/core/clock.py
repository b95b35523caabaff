"""Time as an injected dependency, so the pure core never reads the wall clock itself."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (for time-of-day schedules only)."""
        ...


class SystemClock:
    # The builtins themselves, not methods that call them: a call reads the clock ~10 times.
    now = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


class FakeClock:
    """A clock that moves only when told to; for tests and the simulator."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._t = start
        self._wall_offset = wall_start - start

    def now(self) -> float:
        return self._t

    def wall(self) -> float:
        return self._t + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._t += seconds
