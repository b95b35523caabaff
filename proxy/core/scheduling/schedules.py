"""Time-of-day schedules that override tier weights and reserves.

Hours are local to the configured timezone and follow its daylight-saving changes: a
schedule from 22 to 6 runs from 22:00 to 06:00 local time whatever the UTC offset. A
window that wraps past midnight belongs to the day it starts on, so ``days=(5,)`` with
22 to 6 means Friday night, ending Saturday 06:00.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo

# Every UTC offset in use today is a whole number of quarter hours, so local hour
# boundaries fall on UTC quarter hours.
_STEP_S = 900
# One week covers every combination of hour and weekday; one extra day covers a window
# that starts on the last day checked.
_HORIZON_S = 8 * 24 * 3600


@dataclass(frozen=True)
class Schedule:
    name: str
    start_hour: int
    end_hour: int
    days: tuple[int, ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)
    reserves: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.start_hour <= 23:
            raise ValueError(f"schedule {self.name!r}: start_hour must be 0..23")
        if not 0 <= self.end_hour <= 24:
            raise ValueError(f"schedule {self.name!r}: end_hour must be 0..24")
        if self.start_hour == self.end_hour:
            raise ValueError(
                f"schedule {self.name!r}: start_hour equals end_hour; use 0 to 24 for all day"
            )
        if any(not 1 <= day <= 7 for day in self.days):
            raise ValueError(f"schedule {self.name!r}: days are ISO weekdays 1 (Mon) to 7")
        if any(not weight > 0 for weight in self.weights.values()):
            raise ValueError(f"schedule {self.name!r}: weights must be positive")
        if any(reserve < 0 for reserve in self.reserves.values()):
            raise ValueError(f"schedule {self.name!r}: reserves must not be negative")

    def covers(self, hour: int, iso_weekday: int) -> bool:
        """Whether the schedule is on at this local hour and weekday."""
        if self.start_hour < self.end_hour:
            return self.start_hour <= hour < self.end_hour and self._on_day(iso_weekday)
        if hour >= self.start_hour:
            return self._on_day(iso_weekday)
        if hour < self.end_hour:
            previous_day = (iso_weekday - 2) % 7 + 1
            return self._on_day(previous_day)
        return False

    def _on_day(self, iso_weekday: int) -> bool:
        return not self.days or iso_weekday in self.days


def active(schedules: Sequence[Schedule], tz: ZoneInfo, wall: float) -> Schedule | None:
    """The first schedule on at wall time ``wall`` (epoch seconds), or None."""
    local = datetime.fromtimestamp(wall, tz)
    hour, weekday = local.hour, local.isoweekday()
    for schedule in schedules:
        if schedule.covers(hour, weekday):
            return schedule
    return None


def next_change(schedules: Sequence[Schedule], tz: ZoneInfo, wall: float) -> float:
    """The wall time of the next local hour boundary at which ``active`` changes.

    With nothing to change within a week, a boundary a week or so ahead: a harmless
    re-check that keeps the caller's timer logic free of infinities.
    """
    current = active(schedules, tz, wall)
    limit = wall + _HORIZON_S
    last_hour = datetime.fromtimestamp(wall, tz).hour
    candidate = float(wall // _STEP_S * _STEP_S + _STEP_S)
    while candidate < limit:
        local = datetime.fromtimestamp(candidate, tz)
        if local.hour != last_hour:
            last_hour = local.hour
            if active(schedules, tz, candidate) != current:
                return candidate
        candidate += _STEP_S
    return candidate
