"""Spend budgets per key: ``amount_usd`` per calendar day or month in the configured timezone.

A key whose spend in the current period has reached its amount is refused until the period
ends (the HTTP layer checks on arrival and again at dispatch). Spend is what the cost
accounting counts when a call ends; calls already sent when the budget ran out finish and
are counted, so the spend can pass the amount by what was in flight. Spend is kept in
memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

PERIODS = ("day", "month")


@dataclass(frozen=True)
class Budget:
    amount_usd: float
    period: str  # day | month

    def __post_init__(self) -> None:
        if not (math.isfinite(self.amount_usd) and self.amount_usd > 0):
            raise ValueError("a budget's amount must be a positive number of dollars")
        if self.period not in PERIODS:
            raise ValueError(f"a budget's period is one of {', '.join(PERIODS)}")


def period_of(period: str, wall: float, tz: ZoneInfo) -> tuple[float, float]:
    """(start, end) in epoch seconds of the calendar ``period`` holding ``wall`` in ``tz``
    (local midnights, so a day across a daylight-saving change is 23 or 25 hours)."""
    today = datetime.fromtimestamp(wall, tz).date()
    if period == "month":
        first = today.replace(day=1)
        after = (first + timedelta(days=32)).replace(day=1)
    else:
        first, after = today, today + timedelta(days=1)
    return (datetime(first.year, first.month, first.day, tzinfo=tz).timestamp(),
            datetime(after.year, after.month, after.day, tzinfo=tz).timestamp())


class Budgets:
    def __init__(self, budgets: Mapping[str, Budget], timezone: str = "UTC") -> None:
        self._spent: dict[str, tuple[float, float]] = {}  # key -> (period start, dollars)
        self.configure(budgets, timezone)

    def configure(self, budgets: Mapping[str, Budget], timezone: str) -> None:
        """Budgets as configured now; spend so far in the current period is kept."""
        self.budgets = dict(budgets)
        self._tz = ZoneInfo(timezone)

    def spent(self, key: str, wall: float) -> float:
        """Dollars ``key`` spent in its budget's current period (0 without a budget)."""
        budget = self.budgets.get(key)
        if budget is None:
            return 0.0
        start, _ = period_of(budget.period, wall, self._tz)
        since, dollars = self._spent.get(key, (start, 0.0))
        return dollars if since == start else 0.0

    def refused_for(self, key: str, wall: float) -> float | None:
        """None while ``key`` may spend; else the seconds until its period ends."""
        budget = self.budgets.get(key)
        if budget is None or self.spent(key, wall) < budget.amount_usd:
            return None
        return period_of(budget.period, wall, self._tz)[1] - wall

    def spend(self, key: str, dollars: float, wall: float) -> None:
        """What a call of ``key`` cost, counted in its budget's current period."""
        budget = self.budgets.get(key)
        if budget is None or not (math.isfinite(dollars) and dollars > 0):
            return
        start, _ = period_of(budget.period, wall, self._tz)
        self._spent[key] = (start, self.spent(key, wall) + dollars)

    def snapshot(self, wall: float) -> dict[str, dict[str, object]]:
        return {key: {"amount_usd": b.amount_usd, "period": b.period,
                      "spent_usd": round(self.spent(key, wall), 6),
                      "resets_in_s": round(period_of(b.period, wall, self._tz)[1] - wall)}
                for key, b in self.budgets.items()}
