"""Requests aiohttp refuses itself, answered in OpenAI's error shape.

Some requests never reach the proxy's handlers: aiohttp's parser refuses a malformed request
line or header, a bad ``Content-Length`` or chunk size, a head over its size limits, a body
in an encoding it cannot decode (``br`` or ``zstd`` without their packages). aiohttp answers
those itself, in plain text. Here they get the ``{"error": {...}}`` body and ``x-request-id``
every other error of the proxy has, with aiohttp's status and the first line of its reason;
the connection is closed after it, as aiohttp does.

This overrides ``RequestHandler.handle_error`` and makes aiohttp's server build that
handler, which reads names aiohttp does not promise. Where this aiohttp lacks one of them,
``Runner`` is aiohttp's own runner (plain-text refusals) and says so once in the log.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestHandler

from ...core.errors import InvalidRequest, ProxyError
from ..base.edge import client_request_id
from ..call.middleware import RequestIds, error_response

log = logging.getLogger(__name__)

REASON_CHARS = 200  # a reason longer than this is cut (aiohttp quotes the client's bytes)
_HANDLE_ERROR = ("request", "status", "exc", "message")
_SERVER_ATTRS = ("_loop", "_kwargs", "request_handler", "request_factory",
                 "handler_cancellation")


_IDS = RequestIds()  # the app's are out of reach where the request line could not be read


def refusal(status: int, exc: BaseException | None, reason: str | None,
            request_id: str | None = None) -> web.Response:
    """aiohttp's refusal with ``status`` (for ``exc``, with aiohttp's ``reason``), as the
    proxy's error answer."""
    error: ProxyError
    if status >= 500:
        error = ProxyError("The proxy had an error while processing your request.")
        error.status = status
    else:
        if isinstance(exc, ContentEncodingError):
            text = "The body's Content-Encoding is not one this proxy reads: send it plain, "
            text += "gzip or deflate."
        else:
            lines = (reason or "").strip().splitlines()
            # The first line, without the client's bytes that aiohttp quotes after it.
            text = lines[0].partition(": b'")[0].rstrip(":") if lines else "bad request"
        error = InvalidRequest(text[:REASON_CHARS])
        error.status = status
    response = error_response(error, request_id or _IDS.next(), None)
    response.force_close()
    return response


class Handler(RequestHandler):
    """aiohttp's protocol for one connection, whose own refusals are the proxy's shape."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once answering
        return refusal(status, exc, message, client_request_id(request.headers))


class Server(web.Server):
    """aiohttp's server, with ``Handler`` for each connection."""

    def __call__(self) -> RequestHandler:
        return Handler(self, loop=self._loop, **self._kwargs)


def off_because() -> str | None:
    """What this aiohttp lacks for ``Handler`` and ``Server``, or None."""
    parameters = list(inspect.signature(RequestHandler.handle_error).parameters)[1:]
    if tuple(parameters) != _HANDLE_ERROR:
        return f"RequestHandler.handle_error takes {', '.join(parameters)}"
    probe = web.Server(_nothing)
    lacking = [name for name in _SERVER_ATTRS if not hasattr(probe, name)]
    return f"web.Server lacks {', '.join(lacking)}" if lacking else None


async def _nothing(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response()


class Runner(web.AppRunner):
    """``web.AppRunner`` whose server answers aiohttp's refusals in OpenAI's shape (where
    this aiohttp has what that needs: ``off_because``)."""

    async def _make_server(self) -> web.Server:
        inner = await super()._make_server()
        lacking = off_because()
        if lacking is not None:
            log.warning("requests aiohttp refuses are answered in plain text: aiohttp %s",
                        lacking)
            return inner
        kwargs: dict[str, Any] = inner._kwargs
        return Server(inner.request_handler, request_factory=inner.request_factory,
                      handler_cancellation=inner.handler_cancellation, **kwargs)
