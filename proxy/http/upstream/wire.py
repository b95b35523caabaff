"""A lean HTTP/1.1 client for provider calls: keep-alive connections per origin, the
response parsed by httptools (llhttp), every timeout of a call kept by one timer.

aiohttp's client cost more CPU per call than the proxy's own request path (the overhead
is measured as docs/benchmarks.md says). This one does what a provider call needs and no
more: a
request whose body is known in full, the answer read whole or chunk by chunk
(Content-Length, chunked, or until the connection closes), gzip/deflate answers, TLS,
idle connections reused (last in, first out) and closed ``KEEPALIVE_S`` after their last
use (on a timer, so none lingers), a call that finds its reused connection closed by the
server before any answer sent once more on a fresh one (``StaleConnection``), directly
or through a CONNECT tunnel of the egress proxy (``tunnel``), pooled alike.

Errors are the proxy's own (``UpstreamConnectError`` / ``UpstreamTimeout`` /
``UpstreamBadResponse``); a connection with anything unusual is closed, never reused.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections import deque
from functools import partial
from typing import cast

import httptools

from ...core.errors import UpstreamBadResponse, UpstreamConnectError, UpstreamError, UpstreamTimeout
from ...core.health.provider import EgressProxy
from .tunnel import ProxyRefused, connect_request, open_tunnel

KEEPALIVE_S = 15.0  # an idle connection older than this is closed, not reused
HIGH_WATER = 256 * 1024  # unread answer bytes past which the socket stops being read
_ENCODINGS = ("gzip", "deflate", "x-gzip")
_NO_BODY = (204, 304)


class StaleConnection(UpstreamConnectError):
    """A reused connection closed before any byte of the answer came back: the server had
    closed it while it was idle (some say keep-alive and close after each stream), so the
    call is sent once more on a fresh one."""


class Origin:
    """The connections to one scheme://host:port."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None,
                 egress: EgressProxy | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.egress = egress
        self._connect = connect_request(host, port, egress) if egress is not None else b""
        # What a connect error names: never the provider's address (a client may read it).
        self._via = egress.display_url if egress is not None else ""
        self._to = f"the provider through the egress proxy {self._via}" if egress else (
            "the provider")
        self._idle: list[Connection] = []
        self._sweep: asyncio.TimerHandle | None = None  # closes idle ones past KEEPALIVE_S
        self.closed = False

    async def connection(self, connect_s: float, fresh: bool = False) -> Connection:
        """A live connection: the most recently used idle one (unless ``fresh``), else a
        new one."""
        loop = asyncio.get_running_loop()
        idle = self._idle
        while idle and not fresh:
            conn = idle.pop()
            if conn.usable(loop.time()):
                conn.reused = True
                return conn
            conn.abort()
        try:
            async with asyncio.timeout(connect_s):
                if self.egress is None:
                    _, conn = await loop.create_connection(
                        partial(Connection, self, loop), self.host, self.port, ssl=self.tls,
                        server_hostname=self.host if self.tls is not None else None)
                else:
                    conn = Connection(self, loop)
                    await open_tunnel(self.egress, self._connect, conn, self.tls, self.host)
        except TimeoutError as exc:
            raise UpstreamConnectError(f"connecting to {self._to} timed out") from exc
        except ProxyRefused as exc:
            raise UpstreamConnectError(
                f"the egress proxy {self._via} refused the tunnel to the provider "
                f"({exc.status})") from exc
        except OSError as exc:
            # The detail (the provider's address) stays in the chain for logs, not in the
            # message a client sees.
            raise UpstreamConnectError(
                f"connecting to {self._to} failed ({type(exc).__name__})") from exc
        return conn

    def put_back(self, conn: Connection) -> None:
        if self.closed:
            conn.abort()
            return
        self._idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_at(
                conn.idle_since + KEEPALIVE_S, self._close_idle)

    def _close_idle(self) -> None:
        """Close the idle connections past ``KEEPALIVE_S``; come back for the next one."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self._idle if not c.usable(now)]:
            self._idle.remove(conn)
            conn.abort()
        if self._idle and not self.closed:
            oldest = min(c.idle_since for c in self._idle)
            self._sweep = loop.call_at(oldest + KEEPALIVE_S, self._close_idle)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def forget(self, conn: Connection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        while self._idle:
            self._idle.pop().abort()


class Connection(asyncio.Protocol):
    """One connection; at most one call on it at a time."""

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self._origin = origin
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._busy = False
        self.lost = False
        self.reused = False  # taken from the pool for the call on it now
        self.idle_since = 0.0
        self._begin(False, 0.0, 0.0, 0)

    def _begin(self, stream: bool, timeout_s: float, idle_s: float, max_bytes: int) -> None:
        self._stream = stream
        self._timeout_s = timeout_s
        self._idle_s = idle_s
        self._max_bytes = max_bytes
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head = False
        self._complete = False
        self._keep_alive = False
        self._until_close = False
        self._flowing = False  # a stream's first chunk is in: the idle timeout applies
        self._error: UpstreamError | None = None
        self._decoder: zlib._Decompress | None = None
        self._buffered = 0
        self._size = 0
        self._paused = False
        self._last = 0.0
        self._answered = False  # a byte of the answer came back
        self._chunks.clear()

    # --- the call's side ------------------------------------------------------------------

    async def call(self, head: bytes, body: bytes, *, stream: bool, timeout_at: float,
                   timeout_s: float, idle_s: float, max_bytes: int) -> None:
        """Sends the request; returns once the answer's head is in (``status``,
        ``headers``); ``timeout_at`` (loop time, ``timeout_s`` after the call began) ends it.
        The caller must ``release`` the connection on every path."""
        assert self._transport is not None and not self._busy
        self._busy = True
        self._begin(stream, timeout_s, idle_s, max_bytes)
        self._timer = self._loop.call_at(timeout_at, self._expire)
        self._transport.writelines((head, body))
        while not self._head:
            await self._wait()

    async def read(self) -> bytes:
        """The whole answer (its size bounded by ``max_bytes``)."""
        while not self._complete:
            await self._wait()
        return self._take()

    async def next_chunk(self) -> bytes:
        """All the answer's bytes in so far that were not yet taken (waiting for some if
        there are none); ``b""`` at its end."""
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait()
        data = self._take()
        if self._paused and self._transport is not None:
            self._paused = False
            self._last = self._loop.time()
            self._transport.resume_reading()
        return data

    @property
    def drained(self) -> bool:
        """The answer is complete and every byte of it was taken."""
        return self._complete and not self._chunks

    def _take(self) -> bytes:
        """Every byte in and not yet taken."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        """Back to the pool if the answer was read to its end, else closed."""
        if not self._busy:
            return
        self._busy = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._complete and self._keep_alive and self._error is None and not self.lost:
            self._chunks.clear()
            self.idle_since = self._loop.time()
            self._origin.put_back(self)
        else:
            self.abort()

    def usable(self, now: float) -> bool:
        return not self.lost and now - self.idle_since < KEEPALIVE_S

    def abort(self) -> None:
        self.lost = True
        if self._transport is not None:
            self._transport.abort()

    # --- timeouts ---------------------------------------------------------------------------

    def _expire(self) -> None:
        self._timer = None
        if self._complete or self._error is not None:
            return
        if self._flowing:
            due = self._last + self._idle_s
            if self._paused or due > self._loop.time():  # a slow reader is not a stall
                self._timer = self._loop.call_at(
                    self._loop.time() + self._idle_s if self._paused else due, self._expire)
                return
            self._fail(UpstreamTimeout("upstream stream stalled"))
        elif not self._head:
            self._fail(UpstreamTimeout(f"no response within {self._timeout_s:g}s"))
        elif self._stream:
            self._fail(UpstreamTimeout("upstream stream stalled"))
        else:
            self._fail(UpstreamTimeout("response not complete in time"))

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None and not self._complete:
            self._error = error
        self._wake()
        self.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # bytes nobody asked for: the connection is not to be trusted
            self._origin.forget(self)
            self.abort()
            return
        self._last = self._loop.time()
        self._answered = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(UpstreamBadResponse(
                f"the provider's response was malformed ({type(exc).__name__})"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost ends what is in flight

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._origin.forget(self)
        # The parser holds this connection's callbacks: one that calls nothing instead, so
        # the two are freed by reference counting, not left for the garbage collector.
        self._parser = httptools.HttpResponseParser(None)
        if not self._busy or self._complete:
            return
        if self._head and self._until_close and self._error is None:
            self._done()  # an answer without a length ends with its connection
        elif not self._head:
            self._fail(StaleConnection("the provider closed the connection")
                       if self.reused and not self._answered
                       else UpstreamConnectError("the provider closed the connection"))
        else:
            self._fail(UpstreamBadResponse("the provider's response broke (connection lost)"))

    # --- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("utf-8", "surrogateescape")
        headers = self.headers
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the real answer follows
            self.headers = {}
            return
        self.status = status
        headers = self.headers
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding in _ENCODINGS:
            self._decoder = zlib.decompressobj(wbits=47 if encoding != "deflate" else 15)
        elif encoding != "identity":
            self._fail(UpstreamBadResponse(
                f"the provider's response uses an unsupported encoding ({encoding[:32]})"))
            return
        self._until_close = (status not in _NO_BODY and "content-length" not in headers
                             and "chunked" not in headers.get("transfer-encoding", ""))
        self._head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self._head or self._error is not None:
            return
        if self._decoder is not None:
            room = self._max_bytes - self._size + 1 if not self._stream else 0
            body = self._decoder.decompress(body, room)
        if not body:
            return
        if self._stream:  # bounded by reading no more past HIGH_WATER, not by a size
            buffered = self._buffered = self._buffered + len(body)
            if not self._flowing:
                self._flowing = True
                self._rearm(self._loop.time() + self._idle_s)
            if buffered > HIGH_WATER and not self._paused and self._transport is not None:
                self._paused = True
                self._transport.pause_reading()
        else:
            size = self._size = self._size + len(body)
            if size > self._max_bytes:
                self._fail(UpstreamBadResponse(
                    f"the provider's response is larger than {self._max_bytes} bytes"))
                return
        self._chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        if not self._head:
            return  # the end of an informational answer
        if self._decoder is not None and self._error is None:
            rest = self._decoder.flush()
            if rest:
                self._decoder = None
                self.on_body(rest)
        self._keep_alive = self._parser.should_keep_alive()
        self._done()

    def _done(self) -> None:
        if self._error is None:
            self._complete = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._wake()

    def _rearm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
