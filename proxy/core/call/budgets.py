"""Spend budgets per key: ``amount_usd`` per calendar day or month in the configured timezone.

A call is *reserved* when it is dispatched and *settled* when its attempt ends: the
reservation goes and what it really cost is added (``settle``). A reservation holds the
call's **maximum cost**, the most it may cost as far as the proxy can tell (its prompt,
and the output its ``max_tokens`` allows or else its deployment's ``max_output_tokens``,
at the deployment's prices: ``call_cost``). The rule (``decide``) weighs the call's own
**estimate** (the output its plan expects) against what is ``spent`` (settled) and
``reserved`` (the maximum costs of the key's calls in flight)::

    estimate > amount                    too_big  never sent, whatever is spent
    spent + estimate > amount            spent    refused until the period ends
    spent + reserved + estimate > amount held     the rest is reserved by calls in
                                                  flight: it waits for them to settle
    otherwise                            go       its maximum cost reserved

So spent + reserved never passes the amount by more than the maximum cost less the
estimate of the last call let go, whatever the order of the calls, and the spend, once
that call settles, by no more than its real cost: never more than one call over the
amount, however many run at once, as long as no call costs more than its maximum (an
upstream that writes past ``max_output_tokens`` for a call without ``max_tokens``, or
counts the prompt higher than the proxy). A call whose estimate alone is more than the
whole budget is refused outright: the "one call over" is for estimates lower than the
truth, never for a cost known to pass the amount before the call is sent.

A call is charged to the period it was reserved in (one that runs past midnight counts
for the day it started). ``Budgets`` is one process's ledger: with ``state.backend:
memory`` the whole truth; with redis, ``proxy.state.budgets`` decides in Redis and keeps
this replica's own spend and reservations here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol
from zoneinfo import ZoneInfo

from ..errors import BudgetExceeded
from ..value import value
from .route import Deployment

if TYPE_CHECKING:  # a plan names its key's budget
    from .plan import Plan

PERIODS = ("day", "month")
GO, SPENT, TOO_BIG, HELD = "go", "spent", "too_big", "held"


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


def decide(amount: float, spent: float, reserved: float, estimate: float) -> str:
    """``GO``, ``SPENT``, ``TOO_BIG`` or ``HELD`` (the module's table). The same rule runs
    in Redis (``proxy.state.budgets``)."""
    if estimate > amount:
        return TOO_BIG
    if spent >= amount or spent + estimate > amount:
        return SPENT
    if spent + reserved + estimate > amount:
        return HELD
    return GO


def decide_share(amount: float, others_seen: float, mine_seen: float, mine: float,
                 reserved: float, estimate: float, replicas: int) -> str:
    """``decide`` for one of ``replicas`` while they cannot reach each other: what was
    left when they last could (``amount`` less the other replicas' spend and this one's,
    as last seen) is shared equally, and this replica counts its spend since then
    (``mine - mine_seen``) and its own reservations against its share."""
    if estimate > amount:
        return TOO_BIG
    share = (amount - others_seen - mine_seen) / max(replicas, 1)
    verdict = decide(share, mine - mine_seen, reserved, estimate) if share > 0 else SPENT
    return SPENT if verdict == TOO_BIG else verdict


def call_cost(plan: Plan, deployment: Deployment, service_tier: str | None = None
              ) -> tuple[float, float]:
    """(estimate, maximum) in dollars of ``plan``'s call through ``deployment``, sent with
    ``service_tier``: its prompt and the output its plan expects (the tokens its rate
    limits are charged), or the most output it may produce (its ``max_tokens``, else the
    deployment's ``max_output_tokens``), ``n`` times, at ``Deployment.cost``'s prices."""
    choices = plan.call.choices
    expected = deployment.output_cap(plan.output_tokens)
    asked = plan.call.max_tokens
    most = 0 if not plan.call.generates else (
        asked if asked is not None else deployment.max_output_tokens)
    if most < expected:
        most = expected
    return (deployment.cost(plan.prompt_tokens, expected * choices, service_tier),
            deployment.cost(plan.prompt_tokens, most * choices, service_tier))


@value
class Reservation:
    """One call's hold on its key's budget, in the period it was made in."""

    key: str
    start: float  # the period's, epoch seconds
    end: float
    id: int
    estimate: float
    maximum: float


@value
class Refusal:
    """Why a call of ``key`` may not go now (``SPENT``, ``TOO_BIG`` or ``HELD``)."""

    reason: str
    key: str
    budget: Budget
    estimate: float
    retry_after_s: float  # to the period's end


@dataclass(slots=True)
class _Period:
    end: float
    spent: float = 0.0
    held: dict[int, Reservation] = field(default_factory=dict)

    @property
    def reserved(self) -> float:
        return sum(r.maximum for r in self.held.values())


class Budgets:
    """One process's spend and reservations per key and period, on the wall clock it is
    told (a fake one in tests)."""

    def __init__(self, budgets: Mapping[str, Budget], timezone: str = "UTC") -> None:
        self._periods: dict[tuple[str, float], _Period] = {}  # (key, period start) → …
        self._ids = 0
        self.configure(budgets, timezone)

    def configure(self, budgets: Mapping[str, Budget], timezone: str) -> None:
        """Budgets as configured now; spend so far in the current period is kept (a new
        period or timezone starts over)."""
        self.budgets = dict(budgets)
        self._tz = ZoneInfo(timezone)

    def period(self, key: str, wall: float) -> tuple[float, float] | None:
        """(start, end) of ``key``'s current period (None without a budget)."""
        budget = self.budgets.get(key)
        return None if budget is None else period_of(budget.period, wall, self._tz)

    def _current(self, key: str, wall: float) -> _Period | None:
        found = self.period(key, wall)
        return None if found is None else self._periods.get((key, found[0]))

    def spent(self, key: str, wall: float) -> float:
        """Dollars ``key`` spent in its budget's current period (0 without a budget)."""
        period = self._current(key, wall)
        return 0.0 if period is None else period.spent

    def spent_in(self, key: str, start: float) -> float:
        period = self._periods.get((key, start))
        return 0.0 if period is None else period.spent

    def reserved(self, key: str, wall: float) -> float:
        """The maximum costs of ``key``'s calls in flight reserved in its current period."""
        period = self._current(key, wall)
        return 0.0 if period is None else period.reserved

    def in_flight(self, key: str, wall: float) -> int:
        period = self._current(key, wall)
        return 0 if period is None else len(period.held)

    def check(self, key: str, estimate: float, wall: float, spent: float | None = None
              ) -> Refusal | None:
        """On arrival: a Refusal if ``key``'s spend (``spent``, else this ledger's) leaves
        no room for ``estimate``; reservations are weighed at dispatch only."""
        budget = self.budgets.get(key)
        if budget is None:
            return None
        spent = self.spent(key, wall) if spent is None else spent
        verdict = decide(budget.amount_usd, spent, 0.0, estimate)
        return None if verdict == GO else self.refusal(verdict, key, estimate, wall)

    def refusal(self, reason: str, key: str, estimate: float, wall: float) -> Refusal:
        budget = self.budgets[key]
        end = period_of(budget.period, wall, self._tz)[1]
        return Refusal(reason, key, budget, estimate, max(end - wall, 0.0))

    def admit(self, key: str, estimate: float, maximum: float, wall: float
              ) -> Reservation | Refusal | None:
        """At dispatch: reserve ``maximum`` for the call if ``decide`` lets it go; None
        without a budget (nothing to reserve or settle)."""
        budget = self.budgets.get(key)
        if budget is None:
            return None
        verdict = decide(budget.amount_usd, self.spent(key, wall), self.reserved(key, wall),
                         estimate)
        if verdict != GO:
            return self.refusal(verdict, key, estimate, wall)
        return self.open(key, estimate, maximum, wall)

    def open(self, key: str, estimate: float, maximum: float, wall: float) -> Reservation:
        """Record a reservation whatever the rule says (someone else decided)."""
        budget = self.budgets[key]
        start, end = period_of(budget.period, wall, self._tz)
        period = self._periods.get((key, start))
        if period is None:
            self._prune(wall)
            period = self._periods[(key, start)] = _Period(end)
        self._ids += 1
        reservation = Reservation(key, start, end, self._ids, dollars(estimate),
                                  dollars(maximum))
        period.held[reservation.id] = reservation
        return reservation

    def settle(self, reservation: Reservation, cost: float) -> None:
        """The call's attempt ended having cost ``cost``: its reservation goes, the cost
        is added to the period it was reserved in. Settling twice adds nothing."""
        period = self._periods.get((reservation.key, reservation.start))
        if period is not None and period.held.pop(reservation.id, None) is not None:
            period.spent += dollars(cost)

    def spend(self, key: str, usd: float, wall: float) -> None:
        """What a call of ``key`` sent without a reservation cost (its key had no budget
        when it was dispatched), counted in its budget's current period."""
        budget = self.budgets.get(key)
        cost = dollars(usd)
        if budget is None or not cost:
            return
        start, end = period_of(budget.period, wall, self._tz)
        period = self._periods.get((key, start))
        if period is None:
            self._prune(wall)
            period = self._periods[(key, start)] = _Period(end)
        period.spent += cost

    def reservations(self) -> Iterator[Reservation]:
        """Every reservation not yet settled, of every period."""
        for period in self._periods.values():
            yield from period.held.values()

    def _prune(self, wall: float) -> None:
        """Periods that ended with nothing left in flight are forgotten."""
        gone = [k for k, p in self._periods.items() if p.end <= wall and not p.held]
        for k in gone:
            del self._periods[k]

    def snapshot(self, wall: float) -> dict[str, dict[str, object]]:
        return {key: self.describe(key, self.spent(key, wall), self.reserved(key, wall), wall)
                for key in self.budgets}

    def describe(self, key: str, spent: float, reserved: float, wall: float
                 ) -> dict[str, object]:
        budget = self.budgets[key]
        return {"amount_usd": budget.amount_usd, "period": budget.period,
                "spent_usd": round(spent, 6), "reserved_usd": round(reserved, 6),
                "resets_in_s": round(period_of(budget.period, wall, self._tz)[1] - wall)}


def dollars(value: float) -> float:
    """A cost as counted: finite and not negative (anything else counts nothing)."""
    return value if math.isfinite(value) and value > 0 else 0.0


def budget_exceeded(refusal: Refusal) -> BudgetExceeded:
    """The client's answer to a refusal: what was refused, and when to try again."""
    budget, key = refusal.budget, refusal.key
    if refusal.reason == TOO_BIG:
        return BudgetExceeded(
            f"This call's estimated cost (${refusal.estimate:.4g}) is more than the key "
            f"'{key}''s whole budget of ${budget.amount_usd:g} a {budget.period}: it is not "
            "sent (a lower max_tokens lowers the estimate).", retry_after=refusal.retry_after_s)
    if refusal.reason == HELD:
        return BudgetExceeded(
            f"The rest of the key '{key}''s budget of ${budget.amount_usd:g} for this "
            f"{budget.period} is reserved by its calls in flight, and none left room for this "
            "one in time.", retry_after=1.0, should_retry=True)
    return BudgetExceeded(
        f"The key '{key}' has spent its budget of ${budget.amount_usd:g} for this "
        f"{budget.period}.", retry_after=refusal.retry_after_s)


class Book(Protocol):
    """What ``arrival`` and ``settle`` use of a book of budgets: this process's
    (``Budgets``) or the fleet's (``proxy.state.budgets``)."""

    @property
    def budgets(self) -> dict[str, Budget]: ...

    def check(self, key: str, estimate: float, wall: float) -> Refusal | None: ...

    def settle(self, reservation: Reservation, cost: float) -> None: ...

    def spend(self, key: str, usd: float, wall: float) -> None: ...


def arrival(book: Book, plan: Plan, wall: float) -> Refusal | None:
    """A new call: refused if what its key spent leaves no room for it (at its cheapest
    candidate's estimate)."""
    if plan.caller not in book.budgets:
        return None
    estimate = min(call_cost(plan, d, d.service_tier(plan.tier_name))[0]
                   for d in plan.route.candidates)
    return book.check(plan.caller, estimate, wall)


def settle(book: Book, plan: Plan, service_tier: str | None, reservation: Reservation | None,
           deployment: Deployment | None, cost: float | None, wall: float) -> bool:
    """A call's attempt through ``deployment`` ended (None: it was never sent) having cost
    ``cost`` (None: not known, so its estimate if it was sent): its reservation is settled;
    a call of a key that had no budget when it was dispatched is counted too. True: a
    reservation was settled (the key's held calls may go)."""
    key = plan.caller
    if reservation is None and key not in book.budgets:
        return False
    if cost is None:
        cost = 0.0 if deployment is None else (
            reservation.estimate if reservation is not None
            else call_cost(plan, deployment, service_tier)[0])
    if reservation is not None:
        book.settle(reservation, cost)
        return True
    book.spend(key, cost, wall)
    return False

