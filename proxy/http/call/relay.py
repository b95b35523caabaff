"""Past the commit point: relaying an SSE stream to the client, watching (and, when the
proxy asked for usage itself, editing) it as it passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from aiohttp import web

from ...core.call.route import Deployment
from ...core.errors import ShuttingDown, UpstreamBadResponse, UpstreamError
from ...core.health.fleet import ABANDONED, FAILURE, SUCCESS, Verdict
from ...core.value import value
from ..base.appkeys import COMMITTED, LIFECYCLE, RECORD
from ..base.drain import FAREWELL_S, uncancel
from ..base.edge import Incoming
from ..base.metrics import Metrics
from ..upstream.upstream import UpstreamResponse
from .events import event_stream
from .tally import Tally
from .watchdog import ClientGone, Watchdog


@value
class Relayed:
    """How a relayed stream ended, and the usage it reported (or the events it counted)."""

    verdict: Verdict
    prompt_tokens: object
    completion_tokens: object
    response_id: str | None = None
    kept: list[bytes] | None = None  # the events' data, when asked to keep them
    service_tier: object = None  # as the upstream reported it, beside its usage


def usage_counts(usage: dict[str, Any]) -> tuple[object, object]:
    """(prompt, completion) tokens from a usage object, in Chat Completions' names or the
    Responses API's and Anthropic's (``input_tokens``, ``output_tokens``). Anthropic's
    ``input_tokens`` leaves out the tokens read from or written to its cache: they are
    prompt tokens too, and counted."""
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if isinstance(prompt, int) and ("cache_read_input_tokens" in usage
                                    or "cache_creation_input_tokens" in usage):
        for name in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            cached = usage.get(name)
            if isinstance(cached, int) and cached > 0:
                prompt += cached
    return prompt, usage.get("completion_tokens", usage.get("output_tokens"))


async def _to_client(step: Awaitable[object], timeout_s: float) -> None:
    """One step of sending to the client (head, chunk, end: ``write_eof`` drains the socket
    too), bounded by the write timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except (TimeoutError, ConnectionResetError) as exc:
        raise ClientGone() from exc


def _hang_up(request: Incoming) -> None:
    """Close a connection whose client stopped reading, so nothing is left half-sent and
    the stream cannot later look complete."""
    if request.transport is not None:
        request.transport.abort()


async def relay(
    metrics: Metrics,
    write_timeout_s: float,
    request: Incoming,
    headers: dict[str, str],
    deployment: Deployment,
    upstream: UpstreamResponse,
    chunks: AsyncIterator[bytes],
    first: bytes,
    tally: Tally,
) -> tuple[web.StreamResponse, Relayed]:
    """Past the commit point: relay chunks as they come; errors become an SSE error event.
    A stream that ends without its last event (``[DONE]``, or a Responses API stream's
    ``response.completed``/``incomplete``/``failed``) was cut."""
    headers.setdefault("cache-control", "no-cache")
    answer = event_stream(request, headers)
    timeout_s = write_timeout_s
    verdict = SUCCESS
    request[COMMITTED] = True
    watchdog = Watchdog(timeout_s)
    ending = False  # the stream's end is being written
    try:
        # Waits for nothing (the head goes out with the first event): no watchdog.
        await answer.begin(request)
        # The chunk that ends the upstream's answer goes out with the end of the client's
        # (and, if it is the first, with the head): one write instead of up to three.
        data = tally.feed(first)
        if not upstream.ended:
            await watchdog.send(answer.write(data))
            data = b""
            async for chunk in chunks:
                data = tally.feed(chunk)
                if upstream.ended:
                    break
                if data:
                    await watchdog.send(answer.write(data))
                data = b""
        data += tally.finish()
        if upstream.ended:
            upstream.close()  # its connection is free now, not once a slow client has read
        if not tally.done:
            if data:
                await watchdog.send(answer.write(data))
            raise UpstreamBadResponse(
                tally.failure or "the provider's stream ended before its last event")
        ending = True
        await watchdog.send(answer.write_eof(data))
    except UpstreamError as exc:
        verdict = FAILURE
        request[RECORD].code = exc.code
        metrics.stream_errors.get(deployment.provider, exc.code).inc()
        # Only whole events were relayed: the error event is the next one, and parses.
        event = tally.error_event(f"upstream stream failed: {exc.message}", exc.code)
        try:
            await _to_client(answer.write(event), timeout_s)
            await _to_client(answer.write_eof(), timeout_s)
        except ClientGone:
            _hang_up(request)
    except asyncio.CancelledError:
        # The client left; or the end is written and only its drain was cut short: nothing
        # may follow it, and the connection closes after what is written. Else the drain
        # timed out: say so in the stream, then close it.
        if not request.app[LIFECYCLE].expired or ending or not uncancel():
            raise
        verdict = ABANDONED
        request[RECORD].code = ShuttingDown.code
        event = tally.error_event("the proxy is shutting down; the stream was ended",
                                  ShuttingDown.code)
        try:
            await _to_client(answer.write(event), min(timeout_s, FAREWELL_S))
            await _to_client(answer.write_eof(), min(timeout_s, FAREWELL_S))
        except ClientGone:
            _hang_up(request)
    except ClientGone:
        verdict = ABANDONED
        request[RECORD].code = "client_gone"
        metrics.stream_errors.get(deployment.provider, "client_gone").inc()
        _hang_up(request)
    finally:
        watchdog.stop()
    prompt, completion = usage_counts(tally.usage or {})
    if completion is None:
        completion = max(tally.events - 2, 0)  # content events, less the role and stop ones
    return answer, Relayed(verdict, prompt, completion, tally.response_id, tally.kept,
                           tally.service_tier)
