"""The driver's side of the keys' spend budgets (``proxy.core.call.budgets``, shared across
replicas by ``proxy.state.budgets``): checked when a call arrives, reserved when the
attempt policy says (a ``Reserve`` command), settled when its attempt ends.

A call the rule holds (the rest of its key's budget is reserved by calls in flight) gives
its slot back and waits (a ``Hold``), holding nothing, until one of its key's calls here
settles or the hold's time is up (another replica's settle wakes no one here), then
queues again; ``Attempts.reserved`` refuses it if its deadline comes first.
"""

from __future__ import annotations

import asyncio
import contextlib

from ...core.call import budgets
from ...core.call.attempts import Attempts
from ...core.call.budgets import Reservation, budget_exceeded
from ...core.call.plan import Plan
from ...core.call.route import Deployment
from ...core.clock import Clock
from ...state.base import BudgetBook


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


class BudgetGate:
    """The keys' spend budgets on the call path: checked on arrival, reserved at dispatch,
    settled when an attempt ends; a held call waits here, holding nothing."""

    def __init__(self, book: BudgetBook, clock: Clock) -> None:
        self.book = book
        self._clock = clock
        self._held = HeldCalls()

    def arrival(self, plan: Plan) -> None:
        """A new call: BudgetExceeded if what its key spent leaves no room for it."""
        refusal = budgets.arrival(self.book, plan, self._clock.wall())
        if refusal is not None:
            raise budget_exceeded(refusal)

    async def wait(self, key: str, timeout_s: float) -> None:
        """Carry out a ``Hold``: until a call of ``key`` settles here, or ``timeout_s``."""
        await self._held.wait(key, timeout_s)

    def settle(self, attempts: Attempts, reservation: Reservation | None,
               deployment: Deployment | None, cost: float | None) -> None:
        """The attempt is over (``budgets.settle``); the key's held calls here may go."""
        plan = attempts.plan
        if budgets.settle(self.book, plan, attempts.service_tier, reservation, deployment,
                          cost, self._clock.wall()):
            self._held.wake(plan.caller)
