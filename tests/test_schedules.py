from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.scheduling.schedules import Schedule, active, next_change

BERLIN = ZoneInfo("Europe/Berlin")
UTC_ZONE = ZoneInfo("UTC")
WEEK_S = 7 * 24 * 3600

MON, TUE, WED, THU, FRI, SAT, SUN = range(1, 8)


def at(
    year: int, month: int, day: int, hour: int, minute: int = 0, tz: ZoneInfo = BERLIN,
    fold: int = 0,
) -> float:
    return datetime(year, month, day, hour, minute, tzinfo=tz, fold=fold).timestamp()


def utc(year: int, month: int, day: int, hour: int, minute: int = 0) -> float:
    return datetime(year, month, day, hour, minute, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("start", "end", "days", "hour", "weekday", "expected"),
    [
        (9, 17, (), 9, MON, True),
        (9, 17, (), 16, MON, True),
        (9, 17, (), 17, MON, False),
        (9, 17, (), 8, MON, False),
        (0, 24, (), 0, SUN, True),
        (0, 24, (), 23, SUN, True),
        (22, 6, (), 22, MON, True),
        (22, 6, (), 23, MON, True),
        (22, 6, (), 0, TUE, True),
        (22, 6, (), 5, TUE, True),
        (22, 6, (), 6, TUE, False),
        (22, 6, (), 21, TUE, False),
        (23, 0, (), 23, WED, True),
        (23, 0, (), 0, THU, False),
        # Weekdays: a wrapping window belongs to the day it starts on.
        (9, 17, (MON, TUE, WED, THU, FRI), 10, SAT, False),
        (9, 17, (MON, TUE, WED, THU, FRI), 10, FRI, True),
        (22, 6, (FRI,), 23, FRI, True),
        (22, 6, (FRI,), 3, SAT, True),
        (22, 6, (FRI,), 3, FRI, False),
        (22, 6, (FRI,), 23, SAT, False),
        (22, 6, (SUN,), 2, MON, True),
        (22, 6, (MON,), 2, MON, False),
    ],
)
def test_covers(
    start: int, end: int, days: tuple[int, ...], hour: int, weekday: int, expected: bool
) -> None:
    assert Schedule("s", start, end, days).covers(hour, weekday) is expected


EVENING = Schedule("evening", 18, 22, weights={"low": 0.5}, reserves={"critical": 4})
NIGHT = Schedule("night", 22, 6, weights={"low": 8.0}, reserves={"critical": 1})
WEEKEND = Schedule("weekend", 0, 24, days=(SAT, SUN), weights={"low": 4.0})
TABLE = (EVENING, NIGHT, WEEKEND)


@pytest.mark.parametrize(
    ("wall", "expected"),
    [
        (at(2026, 6, 3, 12), None),  # a Wednesday
        (at(2026, 6, 3, 18), EVENING),
        (at(2026, 6, 3, 21, 59), EVENING),
        (at(2026, 6, 3, 22), NIGHT),
        (at(2026, 6, 4, 5, 59), NIGHT),
        (at(2026, 6, 4, 6), None),
        (at(2026, 6, 6, 12), WEEKEND),  # Saturday
        (at(2026, 6, 6, 19), EVENING),  # first match wins over the weekend
        # 20:30 UTC is 22:30 in Berlin in summer and 21:30 in winter.
        (utc(2026, 6, 3, 20, 30), NIGHT),
        (utc(2026, 1, 7, 20, 30), EVENING),
    ],
)
def test_active(wall: float, expected: Schedule | None) -> None:
    assert active(TABLE, BERLIN, wall) == expected


def test_active_with_no_schedules() -> None:
    assert active((), BERLIN, at(2026, 6, 3, 12)) is None


@pytest.mark.parametrize(
    ("name", "schedules", "wall", "expected"),
    [
        ("into the evening", TABLE, at(2026, 6, 3, 12, 17), at(2026, 6, 3, 18)),
        ("evening to night", TABLE, at(2026, 6, 3, 18), at(2026, 6, 3, 22)),
        ("night to nothing", TABLE, at(2026, 6, 3, 23, 59), at(2026, 6, 4, 6)),
        ("Friday night hands over to the weekend", TABLE, at(2026, 6, 5, 23),
         at(2026, 6, 6, 6)),
        ("weekend hands over to the evening", TABLE, at(2026, 6, 6, 6), at(2026, 6, 6, 18)),
        ("weekend into Monday", (WEEKEND,), at(2026, 6, 6, 3), at(2026, 6, 8, 0)),
        # Spring forward on 29 March 2026: 02:00 CET jumps to 03:00 CEST, so the night
        # lasts six real hours, not seven.
        ("night across spring forward", TABLE, at(2026, 3, 28, 23), utc(2026, 3, 29, 4)),
        ("start in the skipped hour", (Schedule("s", 2, 4),), at(2026, 3, 29, 1, 30),
         utc(2026, 3, 29, 1)),
        # Fall back on 25 October 2026: 03:00 CEST returns to 02:00 CET; hour 2 happens
        # twice and the schedule starting at 3 starts after the second one.
        ("start after the repeated hour", (Schedule("s", 3, 5),), at(2026, 10, 25, 1, 30),
         utc(2026, 10, 25, 2)),
        ("end at the repeated hour", (Schedule("s", 22, 2),), at(2026, 10, 24, 23),
         utc(2026, 10, 25, 0)),
        ("night across fall back", TABLE, at(2026, 10, 24, 23), utc(2026, 10, 25, 5)),
    ],
)
def test_next_change(
    name: str, schedules: tuple[Schedule, ...], wall: float, expected: float
) -> None:
    assert next_change(schedules, BERLIN, wall) == expected, name


@pytest.mark.parametrize(
    ("zone", "wall", "expected"),
    [
        # India is UTC+5:30 and Nepal UTC+5:45: local hours start off the UTC hour.
        ("Asia/Kolkata", utc(2026, 6, 3, 0), utc(2026, 6, 3, 3, 30)),
        ("Asia/Kathmandu", utc(2026, 6, 3, 0), utc(2026, 6, 3, 3, 15)),
    ],
)
def test_next_change_in_odd_offsets(zone: str, wall: float, expected: float) -> None:
    nine_to_five = (Schedule("office", 9, 17),)
    assert next_change(nine_to_five, ZoneInfo(zone), wall) == expected


@pytest.mark.parametrize("schedules", [(), (Schedule("always", 0, 24),)])
def test_next_change_without_changes_is_a_week_or_more_ahead(
    schedules: tuple[Schedule, ...],
) -> None:
    wall = at(2026, 6, 3, 12, 5)
    later = next_change(schedules, BERLIN, wall)
    assert WEEK_S <= later - wall <= WEEK_S + 2 * 24 * 3600


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_hour": 24, "end_hour": 2}, "start_hour"),
        ({"start_hour": -1, "end_hour": 2}, "start_hour"),
        ({"start_hour": 1, "end_hour": 25}, "end_hour"),
        ({"start_hour": 5, "end_hour": 5}, "all day"),
        ({"start_hour": 1, "end_hour": 2, "days": (0,)}, "days"),
        ({"start_hour": 1, "end_hour": 2, "days": (8,)}, "days"),
        ({"start_hour": 1, "end_hour": 2, "weights": {"low": 0.0}}, "weights"),
        ({"start_hour": 1, "end_hour": 2, "reserves": {"high": -1}}, "reserves"),
    ],
)
def test_schedule_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Schedule("bad", **kwargs)  # type: ignore[arg-type]


@st.composite
def schedules_lists(draw: st.DrawFn) -> tuple[Schedule, ...]:
    result: list[Schedule] = []
    for _ in range(draw(st.integers(0, 3))):
        hours = st.tuples(st.integers(0, 23), st.integers(0, 24))
        start, end = draw(hours.filter(lambda pair: pair[0] != pair[1]))
        days = tuple(draw(st.lists(st.integers(1, 7), max_size=3, unique=True)))
        result.append(Schedule(f"s{len(result)}", start, end, days))
    return tuple(result)


@given(
    schedules=schedules_lists(),
    zone=st.sampled_from(["Europe/Berlin", "America/New_York", "Asia/Kolkata", "UTC"]),
    wall=st.floats(utc(2026, 1, 1, 0), utc(2027, 1, 1, 0)),
    fractions=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=8),
)
@settings(max_examples=150, deadline=None)
def test_active_is_constant_until_next_change(
    schedules: tuple[Schedule, ...], zone: str, wall: float, fractions: list[float]
) -> None:
    tz = ZoneInfo(zone)
    change = next_change(schedules, tz, wall)
    assert change > wall
    now = active(schedules, tz, wall)
    for fraction in fractions:
        # Rounding can carry a fraction just below 1 onto the change itself.
        point = min(wall + fraction * (change - wall), change - 0.001)
        assert active(schedules, tz, point) == now
    if change - wall < WEEK_S:
        assert active(schedules, tz, change) != now
        assert datetime.fromtimestamp(change, tz).minute == 0
