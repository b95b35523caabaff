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
from typing import TYPE_CHECKING

from ...core.call.attempts import Command, Queue
from ...core.call.budgets import HELD, TOO_BIG, Refusal, Reservation, call_cost
from ...core.call.plan import Plan
from ...core.call.route import Deployment
from ...core.errors import BudgetExceeded
from ...core.scheduling.tickets import Ticket

if TYPE_CHECKING:
    from .forward import Exchange
    from .service import Service

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


def arrival(service: Service, plan: Plan) -> None:
    """A new call: BudgetExceeded if what its key spent leaves no room for it (at its
    cheapest candidate's estimate)."""
    if plan.caller not in service.budgets.budgets:
        return
    estimate = min(call_cost(plan, d, d.service_tier(plan.tier_name))[0]
                   for d in plan.route.candidates)
    refusal = service.budgets.check(plan.caller, estimate, service.clock.wall())
    if refusal is not None:
        raise budget_exceeded(refusal)


async def reserve(service: Service, exchange: Exchange, deployment_id: str) -> bool:
    """At dispatch through ``deployment_id``, for a key with a budget (the caller checks):
    True if the call may go (its reservation kept on the exchange), False if the rule holds
    it (``hold``); BudgetExceeded if it is refused."""
    plan, attempts = exchange.plan, exchange.attempts
    deployment = attempts.candidate(deployment_id)
    estimate, maximum = call_cost(plan, deployment, attempts.tier_for(deployment))
    got = await service.budgets.reserve(plan.caller, estimate, maximum, service.clock.wall())
    if got is None or isinstance(got, Reservation):
        exchange.reservation = got
        return True
    if got.reason == HELD:
        return False
    raise budget_exceeded(got)


async def hold(service: Service, exchange: Exchange, ticket: Ticket) -> Command:
    """The call is held: its slot goes back, and it queues again once a call of its key
    settled here or ``HELD_POLL_S`` passed; refused if its deadline is nearer."""
    now = service.clock.now()
    service.scheduler.give_back(ticket, now)
    left = ticket.deadline - now - HELD_MARGIN_S
    if not left > 0:
        budget = service.budgets.budgets[exchange.plan.caller]
        raise budget_exceeded(Refusal(HELD, exchange.plan.caller, budget, 0.0, 1.0))
    await service.held_calls.wait(exchange.plan.caller, min(HELD_POLL_S, left))
    return Queue(ticket)


def settle(service: Service, exchange: Exchange, deployment: Deployment | None,
           cost: float | None) -> None:
    """The call's attempt through ``deployment`` ended (None: it was never sent) having
    cost ``cost`` (None: not known, so its estimate if it was sent): its reservation is
    settled. A call of a key that had no budget when it was dispatched is counted too."""
    reservation, book, key = exchange.reservation, service.budgets, exchange.plan.caller
    if reservation is None and key not in book.budgets:
        return
    exchange.reservation = None
    if cost is None:
        cost = 0.0 if deployment is None else (
            reservation.estimate if reservation is not None
            else call_cost(exchange.plan, deployment, exchange.attempts.service_tier)[0])
    if reservation is not None:
        book.settle(reservation, cost)
        service.held_calls.wake(key)
    else:
        book.spend(key, cost, service.clock.wall())
