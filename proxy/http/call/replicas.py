"""The driver's side of shared state (``proxy.state``): with the redis backend, a call
the local scheduler grants a slot also needs one of its provider's slots leased across
replicas (the best waiting call across them gets it) and room in the provider's and its
key's shared rpm/tpm buckets. With the memory backend nothing here awaits anything."""

from __future__ import annotations

import math

from ...core.attempts import Attempts, Command, Queue, Send
from ...core.capacity import GROW_EVERY_S
from ...core.classify import Principal
from ...core.errors import RateLimited
from ...core.fleet import Verdict
from ...core.plan import Plan
from ...core.route import Deployment
from ...core.scheduler import Ticket, TicketState
from ...state.base import Lease
from .service import Service

LEVELS = 16  # rank = tier * LEVELS + level: the order of tiers, then of levels


def rank(ticket: Ticket) -> int:
    return ticket.current_tier * LEVELS + min(ticket.level, LEVELS - 1)


async def grant(service: Service, attempts: Attempts,
                deployment_id: str) -> tuple[Command, Lease | None]:
    """``Attempts.granted`` with shared state (the caller calls ``granted`` itself
    without): first a slot of the provider leased across replicas (the lease is returned
    while the call is sent)."""
    deployment = attempts.candidate(deployment_id)
    tokens = attempts.tokens(deployment)
    got = await _lease(service, attempts, deployment, tokens)
    if not isinstance(got, Lease):
        return got, None
    command = attempts.granted(deployment_id, service.clock.now())
    if isinstance(command, Send):
        return command, got
    ended(service, deployment, tokens, None, got, None)
    return command, None


async def _lease(service: Service, attempts: Attempts, deployment: Deployment,
                 tokens: int) -> Lease | Command:
    """The lease, or what to do instead: queue again (Redis went away while it waited, or
    the provider's shared rpm/tpm is spent), or give up at the deadline. The local slot
    is given back in those cases."""
    shared, clock = service.shared, service.clock
    ticket, plan = attempts.ticket, attempts.plan
    assert ticket is not None
    provider = service.engine.providers[deployment.provider]
    now = clock.now()
    waited = now - ticket.arrived if math.isfinite(ticket.arrived) else 0.0
    try:
        lease = await shared.lease(provider.name, provider.max_concurrency, rank(ticket),
                                   waited, max(plan.deadline - now, 0.0), ticket.key,
                                   ticket.key_weight, ticket.charged_s)
    except TimeoutError:
        now = clock.now()
        service.scheduler.give_back(ticket, now)
        return attempts.refused("queue_timeout", 1.0, now)
    finally:
        service.metrics.shared_wait.observe(clock.now() - now)
    if lease is None:  # Redis went away while it waited: the local share decides now
        service.scheduler.give_back(ticket, clock.now())
        return Queue(ticket)
    kept = False
    try:
        wait_s = await shared.take_rate("provider:" + provider.name, provider.rpm,
                                        provider.tpm, tokens)
        kept = wait_s <= 0
    finally:
        if not kept:  # spent, cancelled, or refused (reject mode): the slot goes back
            shared.release(lease)
    if not kept:
        now = clock.now()
        service.scheduler.pause(provider.name, now + wait_s, now)
        service.scheduler.give_back(ticket, now)
        return Queue(ticket)
    return lease


def make_room(service: Service, attempts: Attempts, ticket: Ticket) -> None:
    """Before ``ticket`` queues here: if its provider's local slots are all taken, and some
    by calls of a less urgent tier waiting in Redis for a slot, send the least urgent of
    those back to the local queue, so this call takes its local slot and waits in Redis in
    the global order (not behind them, outside it)."""
    shared = service.shared
    if not shared.shared:
        return
    tier = ticket.tier if ticket.state is TicketState.NEW else ticket.current_tier
    scheduler = service.scheduler
    candidates = set(ticket.candidates)
    for deployment in attempts.plan.route.candidates:
        name = deployment.provider
        if (deployment.id in candidates and scheduler.inflight(name) >= scheduler.capacity(name)
                and shared.withdraw_below(name, (tier + 1) * LEVELS - 1)):
            return


def ended(service: Service, deployment: Deployment, tokens: int, used: int | None,
          lease: Lease | None, verdict: Verdict | None) -> None:
    """An attempt is over: its slot back, its buckets reconciled with what it used (None:
    nothing, the request too if it never went), a 429's cut told to every replica."""
    shared = service.shared
    if not shared.shared:
        return
    if lease is not None:
        shared.release(lease)
    provider = service.engine.providers[deployment.provider]
    shared.settle_rate("provider:" + provider.name, provider.rpm, provider.tpm,
                       1 if verdict is None else 0, tokens - (used or 0))
    if verdict is Verdict.THROTTLED:
        shared.limit_cut(provider.name, service.scheduler.capacity(provider.name),
                         GROW_EVERY_S)


async def take_key(service: Service, principal: Principal, plan: Plan) -> bool:
    """With shared state (the caller checks), the key's share of its shared rpm/tpm: True
    if taken (settle it with ``settle_key``); RateLimited if the key is over its limit."""
    if principal.rpm is None and principal.tpm is None:
        return False
    wait_s = await service.shared.take_rate("key:" + principal.name, principal.rpm,
                                            principal.tpm, plan.tokens)
    if wait_s > 0:
        raise RateLimited(f"The key '{principal.name}' is over its rate limit.",
                          retry_after=wait_s)
    return True


def settle_key(service: Service, principal: Principal, plan: Plan, sent: bool,
               used: int | None) -> None:
    service.shared.settle_rate("key:" + principal.name, principal.rpm, principal.tpm,
                               0 if sent else 1, plan.tokens - (used or 0) if sent
                               else plan.tokens)
