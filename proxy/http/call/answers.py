"""What the call path keeps of answers for later calls: the response cache's answers
(``proxy.http.call.cache``: this replica's, the identical call's in flight here, then
the fleet's in Redis) and where each stored Responses API answer lives.

A call with ``previous_response_id`` may only go to the deployment holding that
response (``Engine.plan``, pure: it asks the engine's own map). With the redis backend a
replica that did not relay the response asks Redis for its home before the call is
planned, and teaches its engine what it hears; a response it relays is told to Redis as
well as to its engine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from ...core.call.route import Deployment
from ...core.formats.request import Call
from .kept import kept_answer
from .service import Service

if TYPE_CHECKING:
    from .forward import Exchange


def cached(service: Service, exchange: Exchange, tier_name: str,
           waited_s: float | None = None) -> web.Response | None:
    """This replica's cached answer to the call, if there is one now: no slot, no upstream
    tokens, no cost, no budget."""
    call, request = exchange.plan.call, exchange.request
    fingerprint = exchange.fingerprint
    entry = None if fingerprint is None else service.cache.get(call.model, fingerprint)
    if entry is None:
        return None
    service.metrics.cache_lookups.get(call.model, "hit").inc()
    return kept_answer(request, call, entry, "hit", tier_name,
                       exchange.attempts.queue_s if waited_s is None else waited_s)


async def follow(service: Service, exchange: Exchange) -> web.Response | None:
    """An identical call is on its way upstream: wait for it (no slot held, at most until
    this call's own deadline), then answer from the cache if it left an answer there."""
    fingerprint, plan = exchange.fingerprint, exchange.plan
    flight = None if fingerprint is None else service.cache.flight(fingerprint)
    if flight is None:
        return None
    started = service.clock.now()
    try:
        async with asyncio.timeout(max(plan.deadline - started, 0.0)):
            await flight.wait()
    except TimeoutError:
        return None  # the queue refuses it in its turn
    return cached(service, exchange, plan.tier_name, service.clock.now() - started)


async def recalled(service: Service, exchange: Exchange) -> web.Response | None:
    """The fleet's cached answer (redis backend: one round trip, a miss if Redis is slow
    or away). The call asking is the one identical calls here wait for."""
    fingerprint = exchange.fingerprint
    if fingerprint is None or await service.cache.recall(exchange.plan.call.model,
                                                         fingerprint) is None:
        return None
    return cached(service, exchange, exchange.plan.tier_name, 0.0)


async def find_home(service: Service, call: Call) -> None:
    """A call continuing a response this replica knows no home for: the fleet's, if it
    knows one (redis backend; nothing is learnt if Redis is slow or away)."""
    response_id, answers = call.previous_response_id, service.shared.answers
    route = service.engine.models.get(call.model)
    if (response_id is None or answers is None or route is None
            or service.engine.home(response_id) is not None):
        return
    found = await answers.home(response_id)
    for deployment in route.candidates:
        if deployment.id == found:
            service.engine.remember_response(response_id, deployment)
            return


def remember(service: Service, call: Call, response_id: str | None,
             deployment: Deployment) -> None:
    """A Responses API answer: calls that continue it go where it lives."""
    if call.kind == "responses" and response_id is not None:
        service.engine.remember_response(response_id, deployment)
        answers = service.shared.answers
        if answers is not None:
            answers.remember(response_id, deployment.id)
