"""The HTTP edge in one place: what comes in from a client (its body, its request id, its
secrets in headers) and which upstream response headers go out to it.

Body checks live in ``proxy.core.formats.request``; here a large body is parsed and counted in a
worker thread so the event loop keeps relaying other calls' streams meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import re
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, TypeVar

from aiohttp import web
from yarl import URL

from ...core.call.tokens import TokenCounter
from ...core.errors import BodyTimeout
from ...core.formats.request import BodyLimits, Call, Kind, parse_call

# Bodies past this are parsed off the event loop: past it the thread hand-off costs far less
# than walking the body on the loop, where every other call's stream would wait for it.
OFFLOAD_BYTES = 256 * 1024
BODY_WAIT_S = 60.0  # a call's whole body arrives within this long of its head, or 408
UPLOAD_WAIT_S = 600.0  # the same for a file upload (up to batch.max_file_bytes)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

# Upstream response headers a client may see. Everything else stays inside: provider
# account headers (openai-organization, openai-project, x-ratelimit-*), cookies,
# hop-by-hop headers, server banners.
_ANSWER_HEADERS = ("content-type", "openai-processing-ms")
_ERROR_HEADERS = (*_ANSWER_HEADERS, "retry-after", "retry-after-ms")

_T = TypeVar("_T")


class Incoming(Protocol):
    """What a proxied call's handler uses of its request: aiohttp's ``web.Request``, or
    the fast lane's (``proxy.http.lane.front``)."""

    @property
    def app(self) -> web.Application: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def rel_url(self) -> URL: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def transport(self) -> asyncio.Transport | None: ...
    async def read(self) -> bytes: ...
    def __getitem__(self, key: web.RequestKey[_T]) -> _T: ...
    def __setitem__(self, key: web.RequestKey[_T], value: _T) -> None: ...
    def get(self, key: web.RequestKey[_T], /) -> _T | None: ...


async def read_call(request: Incoming, kind: Kind, limits: BodyLimits,
                    counter: TokenCounter) -> Call:
    raw = await read_body(request)
    if len(raw) <= OFFLOAD_BYTES:
        return parse_call(raw, kind, limits, counter)
    return await asyncio.to_thread(parse_call, raw, kind, limits, counter)


async def read_body(request: Incoming) -> bytes:
    if isinstance(request, web.BaseRequest):  # aiohttp's read has no bound of its own
        async with arriving(BODY_WAIT_S):
            return await request.read()
    return await request.read()  # the lane's: bounded where the body is not in yet


@contextlib.asynccontextmanager
async def arriving(seconds: float) -> AsyncIterator[None]:
    """Around the reading of a request's body: one that has not all come in ``seconds``
    after its head raises ``BodyTimeout`` (408), so a client that stops sending holds no
    handler, and no upload's place, for ever."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise BodyTimeout(f"The request body did not arrive within {seconds:g} s of its "
                          "head.") from None


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``x-request-id`` if it is a plain token of at most 128 characters."""
    given = headers.get("x-request-id")
    return given if given is not None and _REQUEST_ID.fullmatch(given) else None


def is_loopback(host: str) -> bool:
    """``host`` (an address, or ``localhost``) is this machine's loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def secret_digest(value: str) -> str:
    """SHA-256 of a secret as the client sent its bytes. aiohttp decodes header bytes that
    are not UTF-8 as surrogates; they hash like any other byte instead of raising."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()


def upstream_headers(upstream: Mapping[str, str], *, error: bool = False) -> dict[str, str]:
    """The allowlisted upstream response headers, plus its request id renamed
    ``x-upstream-request-id`` (the client's own ``x-request-id`` and ``request-id`` are
    the proxy's)."""
    allowed = _ERROR_HEADERS if error else _ANSWER_HEADERS
    headers = {name: upstream[name] for name in allowed if name in upstream}
    upstream_id = upstream.get("x-request-id") or upstream.get("request-id")  # Anthropic's
    if upstream_id is not None:
        headers["x-upstream-request-id"] = upstream_id
    return headers
