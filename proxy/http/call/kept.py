"""A call answered from a kept answer (the response cache's or the semantic cache's): no
slot, no upstream tokens, no cost; as JSON, or replayed as the stream the call asks for."""

from __future__ import annotations

from aiohttp import web

from ...core.formats.request import Call
from ..base.appkeys import RECORD, REQUEST_ID
from ..base.edge import Incoming
from .cache import Entry, replay


def kept_answer(request: Incoming, call: Call, entry: Entry, outcome: str, tier_name: str,
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
