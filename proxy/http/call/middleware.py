"""Request ids, errors in the client's shape (OpenAI's; Anthropic's on the Messages API's
paths) and per-call metrics, for every route."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from ...core.errors import InvalidRequest, ProxyError, RequestTooLarge
from ...core.formats import messages
from ...core.formats.endpoints import ANTHROPIC_PREFIX, BY_PATH
from ...core.formats.events import error_of
from ..base.access import CallRecord
from ..base.appkeys import ACCESS_LOG, COMMITTED, RECORD, REQUEST_ID
from ..base.edge import Incoming, client_request_id
from .service import SERVICE
from .tracing import TRACE

log = logging.getLogger(__name__)
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestIds:
    """Unique ids without a system call per request: a random prefix per process, then a
    counter."""

    def __init__(self) -> None:
        self._prefix = "req_" + secrets.token_hex(8)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):08x}"


REQUEST_IDS = web.AppKey("request_ids", RequestIds)


R = TypeVar("R", bound=Incoming)


def _request_id(request: Incoming) -> str:
    return client_request_id(request.headers) or request.app[REQUEST_IDS].next()


def error_response(error: ProxyError, request_id: str, tier: str | None,
                   path: str = "") -> web.Response:
    """The proxy's own error: in OpenAI's shape, or in Anthropic's on the Messages API's
    paths (with its ``request-id`` header too)."""
    headers = error.headers()
    headers["x-request-id"] = request_id
    if tier is not None:
        headers["x-proxy-tier"] = tier
    if path.startswith(ANTHROPIC_PREFIX):
        headers["request-id"] = request_id
        body = messages.encode_error(error_of(error), request_id)
    else:
        body = orjson.dumps(error.body())
    response = web.Response(body=body, status=error.status, content_type="application/json",
                            headers=headers)
    if error.closes:
        response.force_close()
    return response


def _from_http(exc: web.HTTPException) -> ProxyError:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return RequestTooLarge(
            "The request body is too large for this proxy."
        )
    error = InvalidRequest(exc.reason or "bad request")
    error.status = exc.status
    error.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "invalid_request")
    return error


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    return await guarded(request, handler)


async def guarded(request: R, handler: Callable[[R], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Around every call's handler, whichever server took the request (aiohttp's, or the
    fast lane of ``proxy.http.lane.front``)."""
    request_id = _request_id(request)
    request[REQUEST_ID] = request_id
    service = request.app[SERVICE]
    record = request[RECORD] = CallRecord(service.clock.wall())
    started = service.clock.now()
    status = 500
    tracing = service.tracing
    trace = request[TRACE] = None if tracing is None else tracing.begin(request.path,
                                                                        request.headers)
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers.setdefault("x-request-id", request_id)
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except ProxyError as exc:
        status, record.code = exc.status, exc.code
        if record.tier is not None and exc.status in (429, 503):
            service.metrics.rejections.get(record.tier, exc.code).inc()
        return error_response(exc, request_id, record.tier, request.path)
    except web.RequestPayloadError as exc:  # a body that cannot be decoded (bad gzip)
        # aiohttp words it "400, message:\n  Can not decode content-encoding: gzip".
        reason = (str(exc).strip().splitlines() or ["undecodable"])[-1].strip()
        error: ProxyError = InvalidRequest(f"The request body could not be read ({reason}).")
        status, record.code = error.status, error.code
        return error_response(error, request_id, record.tier, request.path)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _from_http(exc)
        status, record.code = error.status, error.code
        return error_response(error, request_id, record.tier, request.path)
    except Exception:  # the one place where an unexpected error becomes a 500
        log.exception("unhandled error in %s %s (request %s)", request.method, request.path,
                      request_id)
        record.code = "internal_error"
        if request.get(COMMITTED):
            # A response is half-sent: a second one would corrupt it. Hang up instead.
            if request.transport is not None:
                request.transport.abort()
            raise
        error = ProxyError("The proxy failed unexpectedly; this is a bug.")
        return error_response(error, request_id, record.tier, request.path)
    finally:
        if trace is not None:
            trace.end(status, record)
        path = request.path
        if path in BY_PATH:
            service.metrics.requests.get(record.tier or "none", str(status)).inc()
            service.live.call_ended(status, record, service.clock.now())
        access = request.app.get(ACCESS_LOG)
        if access is not None and path not in _PROBES:
            access.emit(request_id, request.method, request.rel_url.raw_path[:256], status,
                        service.clock.now() - started, record)
