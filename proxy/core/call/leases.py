"""What a call decides about a slot leased across replicas (``state.backend: redis``), as
pure policy beside ``attempts``: the driver asks the shared state what these functions
say to ask, reports what it answered, and carries out the command it gets back.

A call the local scheduler grants a slot also needs one of its provider's slots leased
across replicas, where the best waiting call across them goes first (``rank``), and room
in the provider's shared rpm/tpm::

    granted locally ─▶ lease_ask ─▶ (shared state) ─┬─ leased ─▶ rate ─┬─ room ─▶ granted
                                                    │                  └─ spent ─▶ rate_spent
                                                    ├─ deadline ─▶ lease_timed_out
                                                    └─ Redis gone ─▶ lease_lost

Every refusal gives the local slot back. ``withdrawals`` says which less urgent waiters a
call may send back to their local queues before it queues itself; ``reconciliation``
what an ended attempt returns to the shared buckets.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..health.fleet import THROTTLED, Verdict
from ..scheduling.tickets import NEW, Ticket
from ..value import value
from .commands import Command, LeaseAsk, Queue
from .route import Deployment

if TYPE_CHECKING:
    from .attempts import Attempts

LEVELS = 16  # rank = tier * LEVELS + level: the order of tiers, then of levels


def rank(ticket: Ticket) -> int:
    """A waiter's place in the order shared by every replica (lower goes first)."""
    return ticket.current_tier * LEVELS + min(ticket.standing, LEVELS - 1)


@value
class Reconciliation:
    """What an ended attempt gives back to its provider's shared buckets, and whether a
    429 cut the provider's limit for every replica."""

    requests: int
    tokens: int
    cut_limit: bool


def lease_ask(attempts: Attempts, deployment: Deployment, now: float) -> LeaseAsk:
    ticket = attempts.ticket
    assert ticket is not None
    provider = attempts.engine.providers[deployment.provider]
    waited = now - ticket.arrived if math.isfinite(ticket.arrived) else 0.0
    return LeaseAsk(provider.name, provider.max_concurrency, rank(ticket), waited,
                    max(attempts.plan.deadline - now, 0.0), ticket.key, ticket.key_weight,
                    ticket.charged_s)


def lease_timed_out(attempts: Attempts, now: float) -> Command:
    """The deadline came while the call waited for the lease."""
    attempts.engine.scheduler.give_back(_ticket(attempts), now)
    return attempts.refused("queue_timeout", 1.0, now)


def lease_lost(attempts: Attempts, now: float) -> Command:
    """Redis went away while the call waited: the local share decides, from the queue."""
    ticket = _ticket(attempts)
    attempts.engine.scheduler.give_back(ticket, now)
    return Queue(ticket)


def rate_spent(attempts: Attempts, provider: str, wait_s: float, now: float) -> Command:
    """The provider's shared rpm/tpm is spent for ``wait_s``: it pauses here until then,
    and the call waits in its place (the lease is already given back)."""
    ticket = _ticket(attempts)
    scheduler = attempts.engine.scheduler
    scheduler.pause(provider, now + wait_s, now)
    scheduler.give_back(ticket, now)
    return Queue(ticket)


def withdrawals(attempts: Attempts, ticket: Ticket) -> list[tuple[str, int]]:
    """Before ``ticket`` queues here: (provider, rank) for each of its providers whose
    local slots are all taken, in the route's order. The driver sends back to its local
    queue the least urgent waiter in Redis for that provider ranked after ``rank`` (a less
    urgent tier), stopping at the first it finds: this call then takes its local slot and
    waits in Redis in the global order, not behind them outside it."""
    tier = ticket.tier if ticket.state is NEW else ticket.current_tier
    scheduler = attempts.engine.scheduler
    candidates = set(ticket.candidates)
    return [(d.provider, (tier + 1) * LEVELS - 1) for d in attempts.plan.route.candidates
            if d.id in candidates
            and scheduler.inflight(d.provider) >= scheduler.capacity(d.provider)]


def reconciliation(tokens: int, used: int | None, verdict: Verdict | None) -> Reconciliation:
    """``tokens`` were charged; ``used`` were used (None: nothing); ``verdict`` None: the
    request never went, so it is given back too."""
    return Reconciliation(1 if verdict is None else 0, tokens - (used or 0), verdict is THROTTLED)


def _ticket(attempts: Attempts) -> Ticket:
    ticket = attempts.ticket
    if ticket is None:
        raise RuntimeError("no ticket yet")
    return ticket
