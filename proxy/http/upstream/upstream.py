"""The seam between the proxy and a provider: one small Protocol.

``Upstream.send`` opens one call and returns once the response head is in; the body is
then read chunk by chunk. Real providers go through ``HttpUpstream`` (the lean client
in ``wire``); the in-process ``simulated`` provider implements the same Protocol, and tests
swap in their own. Errors: implementations raise only
``proxy.core.errors.UpstreamConnectError`` / ``UpstreamTimeout`` / ``UpstreamBadResponse``.
"""

from __future__ import annotations

import asyncio
import functools
import re
import ssl
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import Protocol
from urllib.parse import urlencode

from yarl import URL

from ...core.health.provider import EgressProxy, Timeouts
from ...core.value import value
from .wire import Connection, Origin, StaleConnection


@value
class UpstreamRequest:
    path: str  # e.g. "/chat/completions", relative to the provider's base URL
    body: bytes  # JSON, already rewritten (upstream model name, stream options)
    model: str  # upstream model name
    stream: bool
    headers: Mapping[str, str]  # extra request headers to pass on (already filtered)


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]  # names in lower case

    @property
    def ended(self) -> bool:
        """``chunks()`` has handed out the last of the body: nothing more will come."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamTimeout if idle too long."""
        ...

    async def read(self) -> bytes:
        """The whole body (non-streaming)."""
        ...

    def close(self) -> None:
        """Abort the call and release the connection; safe to call twice."""
        ...


class Upstream(Protocol):
    async def send(self, request: UpstreamRequest, timeouts: Timeouts) -> UpstreamResponse: ...

    async def close(self) -> None:
        """No more calls will be sent (a reload replaced it, or the proxy stops): idle
        connections close now; a call in flight finishes, then its connection closes."""
        ...


class HttpUpstream:
    """An OpenAI-compatible provider over HTTP (``wire``): the request's head is built
    once but for the few headers that change per call."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        query: Mapping[str, str] | None = None,
        max_response_bytes: int = 64 * 1024 * 1024,
        egress: EgressProxy | None = None,
    ) -> None:
        """``egress``: the proxy calls go through (a CONNECT tunnel); None: directly."""
        url = URL(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        for name, text in headers.items():
            _check_header(name, text)
        tls = _tls_context() if url.scheme == "https" else None
        self._origin = Origin(url.raw_host, url.port or (443 if tls else 80), tls, egress)
        self._max_response_bytes = max_response_bytes
        self._prefix = url.raw_path.rstrip("/")
        self._query = "?" + urlencode(dict(query)) if query else ""
        fixed = {name.lower(): (name, value) for name, value in {
            "host": url.raw_authority.rpartition("@")[2], **headers,
            "content-type": "application/json", "accept-encoding": "gzip, deflate",
        }.items()}
        self._fixed = set(fixed)
        self._fixed_head = "".join(f"{name}: {value}\r\n" for name, value in fixed.values())

    async def send(self, request: UpstreamRequest, timeouts: Timeouts) -> HttpResponse:
        timeout_s = timeouts.first_byte_s if request.stream else timeouts.response_s
        timeout_at = asyncio.get_running_loop().time() + timeout_s
        connect_s = timeout_s if timeout_s < timeouts.connect_s else timeouts.connect_s
        conn = await self._origin.connection(connect_s)
        head = self._head(request)
        call = partial(Connection.call, head=head, body=request.body, stream=request.stream,
                       timeout_at=timeout_at, timeout_s=timeout_s, idle_s=timeouts.idle_s,
                       max_bytes=self._max_response_bytes)
        try:
            try:
                await call(conn)
            except StaleConnection:  # closed by the server while idle: once more, fresh
                conn.release()
                conn = await self._origin.connection(connect_s, fresh=True)
                await call(conn)
        except BaseException:
            conn.release()  # at most once: a released connection ignores it
            raise
        return HttpResponse(conn)

    def _head(self, request: UpstreamRequest) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in request.headers.items()
                        if name.lower() not in self._fixed and _safe(name, value))
        return (f"POST {self._prefix}{request.path}{self._query} HTTP/1.1\r\n"
                f"{self._fixed_head}{extra}content-length: {len(request.body)}\r\n\r\n"
                ).encode()

    async def close(self) -> None:
        self._origin.close()


_UNSAFE = re.compile("[\r\n\0]")


def _safe(name: str, value: str) -> bool:
    return _UNSAFE.search(name) is None and _UNSAFE.search(value) is None


def _check_header(name: str, value: str) -> None:
    if not _safe(name, value) or not name or ":" in name:
        raise ValueError(f"the header {name!r} cannot be sent")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


class HttpResponse:
    """An answer being read; ``close`` gives its connection back (or closes it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn: Connection | None = conn
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None:
            return b""
        try:
            return await conn.read()
        finally:
            self.close()

    def chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    @property
    def ended(self) -> bool:
        return self._conn is None or self._conn.drained

    async def next_chunk(self) -> bytes:
        conn = self._conn
        if conn is None:
            return b""
        try:
            data = await conn.next_chunk()
        except BaseException:
            self.close()
            raise
        if not data:
            self.close()
        return data

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.release()


class _Chunks:
    """``HttpResponse.chunks()``: an async iterator without a generator's frame."""

    __slots__ = ("_response",)

    def __init__(self, response: HttpResponse) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        data = await self._response.next_chunk()
        if not data:
            raise StopAsyncIteration
        return data
