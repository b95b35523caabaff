"""A call answered from a cache: no slot, no upstream tokens, no cost; as JSON, or replayed
as the stream the call asks for (``hit_response``, for the response cache and the semantic
cache). The response cache's hits (``proxy.http.call.cache``) are this replica's entry,
the identical call's in flight here, then the fleet's in Redis."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ...core.call.plan import Plan
from ...core.clock import Clock
from ...core.formats.request import Call
from ..base.appkeys import RECORD, REQUEST_ID
from ..base.edge import Incoming
from ..base.metrics import Metrics
from .cache import Entry, ResponseCache, replay


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


class CacheHits:
    """The response cache's answers to a call (see the module)."""

    def __init__(self, cache: ResponseCache, metrics: Metrics, clock: Clock) -> None:
        self._cache, self._metrics, self._clock = cache, metrics, clock

    def hit(self, request: Incoming, plan: Plan, fingerprint: bytes | None, tier_name: str,
            waited_s: float) -> web.Response | None:
        """This replica's cached answer to the call, if there is one now: no slot, no
        upstream tokens, no cost, no budget."""
        call = plan.call
        entry = None if fingerprint is None else self._cache.get(call.model, fingerprint)
        if entry is None:
            return None
        self._metrics.cache_lookups.get(call.model, "hit").inc()
        return hit_response(request, call, entry, "hit", tier_name, waited_s)

    async def follow(self, request: Incoming, plan: Plan,
                     fingerprint: bytes | None) -> web.Response | None:
        """An identical call is on its way upstream: wait for it (no slot held, at most until
        this call's own deadline), then answer from the cache if it left an answer there."""
        flight = None if fingerprint is None else self._cache.flight(fingerprint)
        if flight is None:
            return None
        started = self._clock.now()
        try:
            async with asyncio.timeout(max(plan.deadline - started, 0.0)):
                await flight.wait()
        except TimeoutError:
            return None  # the queue refuses it in its turn
        return self.hit(request, plan, fingerprint, plan.tier_name, self._clock.now() - started)

    async def fleet_hit(self, request: Incoming, plan: Plan,
                        fingerprint: bytes) -> web.Response | None:
        """The fleet's cached answer (redis backend: one round trip, a miss if Redis is slow
        or away). The call asking is the one identical calls here wait for."""
        if await self._cache.recall(plan.call.model, fingerprint) is None:
            return None
        return self.hit(request, plan, fingerprint, plan.tier_name, 0.0)
