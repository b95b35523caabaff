"""The driver's side of the keys' spend budgets (``proxy.core.call.budgets``, shared across
replicas by ``proxy.state.budgets``): checked when a call arrives, reserved when it is
dispatched, settled when its attempt ends.

A call the rule holds (the rest of its key's budget is reserved by calls in flight) gives
its slot back and waits, holding nothing, until one of its key's calls here settles or
``HELD_POLL_S`` passes (another replica's settle wakes no one here), then queues again;
if its deadline comes first it is refused, with a short ``retry-after``.
"""

from __future__ import annotations

import asyncio
import contextlib

from ...core.call.attempts import Attempts, Command, Queue
from ...core.call.budgets import HELD, TOO_BIG, Refusal, Reservation, call_cost
from ...core.call.plan import Plan
from ...core.call.route import Deployment
from ...core.clock import Clock
from ...core.errors import BudgetExceeded
from ...core.scheduling.scheduler import Scheduler
from ...core.scheduling.tickets import Ticket
from ...state.base import BudgetBook

HELD_POLL_S = 0.5
HELD_MARGIN_S = 0.05  # a held call is refused this long before its deadline, not after


class HeldCalls:
    """Wakes the held calls of a key when one of its reservations here settles."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    async def wait(self, key: str, timeout_s: float) -> None:
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()

    def wake(self, key: str) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()


def budget_exceeded(refusal: Refusal) -> BudgetExceeded:
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


class BudgetGate:
    """The keys' spend budgets on the call path: checked on arrival, reserved at dispatch,
    settled when an attempt ends; a held call waits here, holding nothing."""

    def __init__(self, book: BudgetBook, clock: Clock, scheduler: Scheduler) -> None:
        self.book = book
        self._clock = clock
        self._scheduler = scheduler
        self._held = HeldCalls()

    def arrival(self, plan: Plan) -> None:
        """A new call: BudgetExceeded if what its key spent leaves no room for it (at its
        cheapest candidate's estimate)."""
        if plan.caller not in self.book.budgets:
            return
        estimate = min(call_cost(plan, d, d.service_tier(plan.tier_name))[0]
                       for d in plan.route.candidates)
        refusal = self.book.check(plan.caller, estimate, self._clock.wall())
        if refusal is not None:
            raise budget_exceeded(refusal)

    async def reserve(self, attempts: Attempts, deployment_id: str
                      ) -> tuple[bool, Reservation | None]:
        """At dispatch through ``deployment_id``, for a key with a budget (in ``book``):
        (True, its reservation) if the call may go, (False, None) if the rule holds it
        (``hold``); BudgetExceeded if it is refused."""
        plan = attempts.plan
        deployment = attempts.candidate(deployment_id)
        estimate, maximum = call_cost(plan, deployment, attempts.tier_for(deployment))
        got = await self.book.reserve(plan.caller, estimate, maximum, self._clock.wall())
        if got is None or isinstance(got, Reservation):
            return True, got
        if got.reason == HELD:
            return False, None
        raise budget_exceeded(got)

    async def hold(self, key: str, ticket: Ticket) -> Command:
        """The call is held: its slot goes back, and it queues again once a call of its key
        settled here or ``HELD_POLL_S`` passed; refused if its deadline is nearer."""
        now = self._clock.now()
        self._scheduler.give_back(ticket, now)
        left = ticket.deadline - now - HELD_MARGIN_S
        if not left > 0:
            raise budget_exceeded(Refusal(HELD, key, self.book.budgets[key], 0.0, 1.0))
        await self._held.wait(key, min(HELD_POLL_S, left))
        return Queue(ticket)

    def settle(self, attempts: Attempts, reservation: Reservation | None,
               deployment: Deployment | None, cost: float | None) -> None:
        """The call's attempt through ``deployment`` ended (None: it was never sent) having
        cost ``cost`` (None: not known, so its estimate if it was sent): its reservation is
        settled. A call of a key that had no budget when it was dispatched is counted too."""
        key = attempts.plan.caller
        if reservation is None and key not in self.book.budgets:
            return
        if cost is None:
            cost = 0.0 if deployment is None else (
                reservation.estimate if reservation is not None
                else call_cost(attempts.plan, deployment, attempts.service_tier)[0])
        if reservation is not None:
            self.book.settle(reservation, cost)
            self._held.wake(key)
        else:
            self.book.spend(key, cost, self._clock.wall())
