"""Past the commit point: relaying an SSE stream to the client, watching (and, when the
proxy asked for usage itself, editing) it as it passes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from ..core.errors import UpstreamBadResponse, UpstreamError
from ..core.fleet import Verdict
from ..core.route import Deployment
from .service import Service
from .state import COMMITTED, REQUEST_ID
from .upstream import UpstreamResponse

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "content-length", "content-encoding",
    "set-cookie", "date", "server", "x-request-id",
})
_BOUNDARY = re.compile(rb"\r?\n\r?\n")
_MAX_PENDING = 1 << 16  # an event larger than this is passed on as it is


class StreamTally:
    """Counts content events and picks up ``usage`` from SSE bytes as they pass.

    With ``strip_usage`` (the proxy added ``stream_options.include_usage`` the client did
    not ask for) the usage-only chunk is removed, so the client sees exactly what it asked
    for; only then are bytes held back, and never more than one partial event.
    """

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._pending + data if self._pending else data
        parts = _BOUNDARY.split(buffer)
        self._pending = parts.pop()
        if not self.strip_usage:
            for event in parts:
                self._inspect(event)
            if len(self._pending) > _MAX_PENDING:
                self._pending = b""
            return data
        out = b"".join(event + b"\n\n" for event in parts if self._inspect(event))
        if len(self._pending) > _MAX_PENDING:
            out, self._pending = out + self._pending, b""
        return out

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest if self.strip_usage else b""

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; False if the client must not see it."""
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return True
        if b'"usage"' not in event:
            self.events += 1
            return True
        payload = _data(event)
        if not isinstance(payload, dict):
            self.events += 1
            return True
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if self.strip_usage and not payload.get("choices"):
                return False
        self.events += 1
        return True


def _data(event: bytes) -> object:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                return orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
    return None


def error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + b"\n\n"


def passthrough_headers(upstream: Mapping[str, str]) -> dict[str, str]:
    """The upstream's response headers a client may see: no hop-by-hop ones (including
    those its ``Connection`` header names), no cookies."""
    named = {t.strip().lower() for t in upstream.get("connection", "").split(",")}
    return {
        k: v for k, v in upstream.items() if k.lower() not in HOP_BY_HOP and k.lower() not in named
    }


def answer_headers(
    request: web.Request, tier_name: str, queue_s: float, deployment: Deployment,
    response: UpstreamResponse,
) -> dict[str, str]:
    headers = passthrough_headers(response.headers)
    headers["x-request-id"] = request[REQUEST_ID]
    headers["x-proxy-tier"] = tier_name
    headers["x-proxy-queue-ms"] = str(round(queue_s * 1000))
    headers["x-proxy-upstream"] = deployment.id
    return headers


@dataclass(frozen=True)
class Relayed:
    """How a relayed stream ended, and the usage it reported (or the events it counted)."""

    verdict: Verdict
    prompt_tokens: object
    completion_tokens: object


class _ClientGone(Exception):
    """The client stopped reading (write timed out) or disconnected."""


async def _to_client(step: Awaitable[object], timeout_s: float) -> None:
    """One step of sending to the client (head, chunk, end: ``write_eof`` drains the socket
    too), bounded by the write timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except (TimeoutError, ConnectionResetError) as exc:
        raise _ClientGone() from exc


def _hang_up(request: web.Request) -> None:
    """Close a connection whose client stopped reading, so nothing is left half-sent and
    the stream cannot later look complete."""
    if request.transport is not None:
        request.transport.abort()


async def relay(
    service: Service,
    request: web.Request,
    headers: dict[str, str],
    deployment: Deployment,
    chunks: AsyncIterator[bytes],
    first: bytes,
    strip_usage: bool,
    expect_done: bool,
) -> tuple[web.StreamResponse, Relayed]:
    """Past the commit point: relay chunks as they come; errors become an SSE error event.
    With ``expect_done`` (chat completions) a stream that ends without ``[DONE]`` was cut."""
    answer = web.StreamResponse(headers=headers)
    answer.headers.setdefault("cache-control", "no-cache")
    timeout_s = service.config.limits.write_timeout_s
    tally = StreamTally(strip_usage)
    verdict = Verdict.SUCCESS
    request[COMMITTED] = True
    try:
        await _to_client(answer.prepare(request), timeout_s)
        await _to_client(answer.write(tally.feed(first)), timeout_s)
        async for chunk in chunks:
            data = tally.feed(chunk)
            if data:
                await _to_client(answer.write(data), timeout_s)
        rest = tally.flush()
        if rest:
            await _to_client(answer.write(rest), timeout_s)
        if not tally.done and expect_done:
            raise UpstreamBadResponse("the provider's stream ended without [DONE]")
        await _to_client(answer.write_eof(), timeout_s)
    except UpstreamError as exc:
        verdict = Verdict.FAILURE
        service.metrics.stream_errors.get(deployment.provider, exc.code).inc()
        # The blank lines close any event the upstream left half-written (after a whole
        # event they are a no-op), so the error event always parses.
        event = b"\n\n" + error_event(f"upstream stream failed: {exc.message}", exc.code)
        try:
            await _to_client(answer.write(event), timeout_s)
            await _to_client(answer.write_eof(), timeout_s)
        except _ClientGone:
            _hang_up(request)
    except _ClientGone:
        verdict = Verdict.ABANDONED
        service.metrics.stream_errors.get(deployment.provider, "client_gone").inc()
        _hang_up(request)
    usage = tally.usage or {}
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = max(tally.events - 2, 0)  # content events, less the role and stop ones
    return answer, Relayed(verdict, usage.get("prompt_tokens"), completion)
