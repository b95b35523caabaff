"""A call answered from a cache: no slot, no upstream tokens, no cost; as JSON, or replayed
as the stream the call asks for (``hit_response``, for the response cache and the semantic
cache). The response cache's hits (``proxy.http.call.cache``) are this replica's entry,
the identical call's in flight here, then the fleet's in Redis."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from ...core.formats.request import Call
from ..base.appkeys import RECORD, REQUEST_ID
from ..base.edge import Incoming
from .cache import Entry, replay

if TYPE_CHECKING:  # at run time a cycle: the service builds the semantic cache, which imports this
    from .forward import Exchange
    from .service import Service


def hit_response(request: Incoming, call: Call, entry: Entry, outcome: str, tier_name: str,
                 waited_s: float, **headers: str) -> web.Response:
    """``outcome``: the access log's ``cache`` and the ``x-proxy-cache`` header (hit,
    semantic); ``headers``: more response headers."""
    record = request[RECORD]
    record.cache = outcome
    record.prompt_tokens, record.completion_tokens = entry.prompt_tokens, entry.completion_tokens
    record.cost_usd = 0.0
    shown = {"x-request-id": request[REQUEST_ID], "x-proxy-tier": tier_name,
             "x-proxy-queue-ms": str(round(waited_s * 1000)),
             "x-proxy-upstream": entry.deployment, "x-proxy-cache": outcome, **headers}
    if not call.stream:
        return web.Response(body=entry.answer, headers=shown, content_type="application/json")
    shown["cache-control"] = "no-cache"
    return web.Response(body=replay(call.kind, entry.answer, call.wants_usage),
                        headers=shown, content_type="text/event-stream")


def cache_hit(service: Service, exchange: Exchange, tier_name: str,
              waited_s: float | None = None) -> web.Response | None:
    """This replica's cached answer to the call, if there is one now: no slot, no upstream
    tokens, no cost, no budget."""
    call, request = exchange.plan.call, exchange.request
    fingerprint = exchange.fingerprint
    entry = None if fingerprint is None else service.cache.get(call.model, fingerprint)
    if entry is None:
        return None
    service.metrics.cache_lookups.get(call.model, "hit").inc()
    return hit_response(request, call, entry, "hit", tier_name,
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
    return cache_hit(service, exchange, plan.tier_name, service.clock.now() - started)


async def fleet_cache_hit(service: Service, exchange: Exchange) -> web.Response | None:
    """The fleet's cached answer (redis backend: one round trip, a miss if Redis is slow
    or away). The call asking is the one identical calls here wait for."""
    fingerprint = exchange.fingerprint
    if fingerprint is None or await service.cache.recall(exchange.plan.call.model,
                                                         fingerprint) is None:
        return None
    return cache_hit(service, exchange, exchange.plan.tier_name, 0.0)
