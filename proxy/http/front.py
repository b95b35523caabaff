"""The fast lane: proxied calls served without aiohttp's per-request machinery.

aiohttp's server spends about 50 µs of CPU and 13 KiB on a request before its handler runs.
The lane reads the plain case itself — an HTTP/1.1 ``POST`` to a proxied route, with a well
formed head and a ``Content-Length`` body within the limit — and runs the same middleware
and handler on it, answering through aiohttp's own response writer. Anything else (another
route, a query string, a chunked or compressed body, ``Expect``, ``Upgrade``, a head it does
not accept, a body over the limit) hands the connection, from that request's first byte, to
aiohttp's protocol, which serves it and whatever follows on that connection.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import HttpVersion11, StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from .edge import Incoming, written_by_aiohttp
from .middleware import errors_middleware, guarded

log = logging.getLogger(__name__)

_T = TypeVar("_T")
Handler = Callable[[Incoming], Awaitable[web.StreamResponse]]

MAX_HEAD = 16 * 1024  # longer heads go to aiohttp, which answers 400 or 431
MAX_FIELDS = 128  # aiohttp's own limit
HOLD_BYTES = 64 * 1024  # read no more while a request is served and this much waits
KEEPALIVE_S = 3630.0  # aiohttp's own idle limit for a connection between requests

_PREFIX = b"POST /v1/"
_LINE = re.compile(rb"POST (/v1/[a-z/]+) HTTP/1\.1\r\n")
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"[\t\x20-\x7e\x80-\xff]*"
_FIELDS = re.compile(rb"(?:" + _TOKEN + rb":" + _VALUE + rb"\r\n)*")
# Headers that need aiohttp's handling: chunked or compressed bodies, 100-continue, upgrades.
_AIOHTTPS = ("transfer-encoding", "content-encoding", "expect", "upgrade")
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[\t ]*(" + _VALUE + rb"?)[\t ]*\r\n")


@dataclass(slots=True, frozen=True)
class Head:
    """A request head the lane serves: its route, headers and framing."""

    path: str
    headers: CIMultiDictProxy[str]
    size: int  # bytes of the head, blank line included
    length: int  # bytes of the body that follows
    keep_alive: bool


class Other:
    """The verdict on a head the lane leaves to aiohttp."""


OTHER = Other()


def read_head(data: bytes | bytearray, routes: Mapping[str, object],
              max_body: int) -> Head | Other | None:
    """The head at the start of ``data``: a ``Head``, ``OTHER`` for aiohttp, or None
    while it is not whole yet."""
    start = data[:len(_PREFIX)]
    if not _PREFIX.startswith(start):
        return OTHER
    end = data.find(b"\r\n\r\n", 0, MAX_HEAD)
    if end < 0:
        return OTHER if len(data) >= MAX_HEAD else None
    line = _LINE.match(data)
    if line is None or (path := line[1].decode()) not in routes:
        return OTHER
    fields_end = end + 2
    if _FIELDS.fullmatch(data, line.end(), fields_end) is None:
        return OTHER
    pairs = _FIELD.findall(data, line.end(), fields_end)
    if len(pairs) > MAX_FIELDS:
        return OTHER
    headers = CIMultiDictProxy(CIMultiDict(
        (name.decode(), value.decode("utf-8", "surrogateescape")) for name, value in pairs))
    if any(name in headers for name in _AIOHTTPS):
        return OTHER
    lengths = headers.getall("content-length", ())
    if len(lengths) > 1 or (lengths and not (
            lengths[0].isascii() and lengths[0].isdigit() and len(lengths[0]) <= 15)):
        return OTHER
    length = int(lengths[0]) if lengths else 0
    if length > max_body:
        return OTHER
    connection = {token.strip() for token in
                  ",".join(headers.getall("connection", ())).lower().split(",")}
    if "upgrade" in connection:
        return OTHER
    return Head(path, headers, end + 4, length, "close" not in connection)


class FastRequest:
    """A request the lane took: what the handler and aiohttp's response writers read."""

    __slots__ = (
        "_body",
        "_payload_writer",
        "_protocol",
        "_state",
        "app",
        "headers",
        "keep_alive",
        "path",
    )
    method = "POST"
    version = HttpVersion11

    def __init__(self, app: web.Application, head: Head, body: bytes,
                 protocol: FrontProtocol) -> None:
        self.app = app
        self.path = head.path
        self.headers = head.headers
        self.keep_alive = head.keep_alive
        self._body = body
        self._protocol = protocol
        self._payload_writer = StreamWriter(protocol, protocol.loop)
        self._state: dict[web.RequestKey[Any], Any] = {}

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._protocol.transport

    @property
    def rel_url(self) -> URL:
        return URL.build(path=self.path, encoded=True)

    async def read(self) -> bytes:
        return self._body

    def __getitem__(self, key: web.RequestKey[_T]) -> _T:
        return cast(_T, self._state[key])

    def __setitem__(self, key: web.RequestKey[_T], value: _T) -> None:
        self._state[key] = value

    def get(self, key: web.RequestKey[bool], /) -> Any:
        return self._state.get(key)

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        return None  # the app has no on_response_prepare signal (FrontServer checks)


class FrontProtocol(BaseProtocol):
    """One client connection, served by the lane until a request needs aiohttp."""

    __slots__ = (
        "_buffer",
        "_closing",
        "_front",
        "_head",
        "_idle_since",
        "_task_handler",
        "_timer",
    )

    def __init__(self, front: FrontServer) -> None:
        super().__init__(front.loop)
        self._front = front
        self._buffer = bytearray()
        self._head: Head | None = None
        self._task_handler: asyncio.Task[None] | None = None
        self._closing = False
        self._idle_since = front.loop.time()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._front.lanes.add(self)
        self._timer = self._loop.call_at(self._idle_since + KEEPALIVE_S, self._on_timer)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if self._timer is not None:
            self._timer.cancel()
        task = self._task_handler
        if task is None:
            self._front.lanes.discard(self)
        else:  # as aiohttp does: the handler is cancelled, and waited for at shutdown
            task.add_done_callback(lambda _: self._front.lanes.discard(self))
            task.cancel()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._task_handler is None:
            self._advance()
        if (self._task_handler is not None and len(self._buffer) > HOLD_BYTES
                and not self._buffer_paused):
            self._pause_reading_for_buffer()

    def _advance(self) -> None:
        """Start the next request if it is all here, or hand the connection to aiohttp."""
        if self.transport is None or self._closing:
            return
        head = self._head
        if head is None:
            verdict = read_head(self._buffer, self._front.routes, self._front.max_body)
            if verdict is None:
                return
            if isinstance(verdict, Other):
                self._hand_over()
                return
            head = self._head = verdict
        end = head.size + head.length
        if len(self._buffer) < end:
            return
        body = bytes(memoryview(self._buffer)[head.size:end])
        self._buffer = self._buffer[end:]
        self._head = None
        request = FastRequest(self._front.app, head, body, self)
        self._task_handler = self._loop.create_task(self._serve(request))

    async def _serve(self, request: FastRequest) -> None:
        try:
            response = await guarded(request, self._front.routes[request.path])
            await response.prepare(written_by_aiohttp(request))
            await response.write_eof()
        except Exception:  # the client left mid-answer, or a half-sent answer failed
            log.debug("fast lane: answer not delivered", exc_info=True)
            if self.transport is not None:
                self.transport.abort()
            return
        finally:
            self._task_handler = None
        self._idle_since = self._loop.time()
        if not response.keep_alive or self._closing:
            if self.transport is not None:
                self.transport.close()
            return
        if self._buffer_paused:
            self._resume_reading_for_buffer()
        if self._buffer:
            self._advance()

    def _hand_over(self) -> None:
        transport = self.transport
        assert transport is not None
        self._front.lanes.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        data, self._buffer = bytes(self._buffer), bytearray()
        handler = self._front.aiohttp_protocol()
        self.transport = None
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused:
            handler.pause_writing()
        if self._buffer_paused:
            transport.resume_reading()
        handler.data_received(data)

    def _on_timer(self) -> None:
        due = self._idle_since + KEEPALIVE_S
        if self._task_handler is None and self._loop.time() >= due:
            if self.transport is not None:
                self.transport.close()
            return
        self._timer = self._loop.call_at(max(due, self._loop.time() + 1.0), self._on_timer)

    def close(self) -> None:
        """Shutdown has begun: no new request; an idle connection closes now."""
        self._closing = True
        if self._task_handler is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout_s: float | None) -> None:
        """The last step of shutdown: wait for the request in progress, then end it."""
        self.close()
        task = self._task_handler
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)
            task.cancel()
            await asyncio.wait({task}, timeout=timeout_s)
        if self.transport is not None:
            self.transport.close()


class FrontServer(web.Server):
    """aiohttp's server for the app, whose connections start in the fast lane."""

    def __init__(self, inner: web.Server, app: web.Application,
                 routes: Mapping[str, Handler]) -> None:
        if tuple(app.middlewares) != (errors_middleware,) or app.on_response_prepare:
            raise RuntimeError("the fast lane runs errors_middleware and no other hook")
        super().__init__(inner.request_handler)
        self.inner = inner
        self.app = app
        self.routes = routes
        self.max_body: int = app._client_max_size
        self.loop = asyncio.get_running_loop()
        self.lanes: set[FrontProtocol] = set()

    def __call__(self) -> FrontProtocol:  # type: ignore[override]
        """A new connection: the listener's protocol factory."""
        return FrontProtocol(self)

    def aiohttp_protocol(self) -> asyncio.Protocol:
        return self.inner()

    def pre_shutdown(self) -> None:
        for lane in list(self.lanes):
            lane.close()
        self.inner.pre_shutdown()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(self.inner.shutdown(timeout),
                             *(lane.shutdown(timeout) for lane in list(self.lanes)))
        self.lanes.clear()


class FrontRunner(web.AppRunner):
    """``web.AppRunner`` whose server has the fast lane for ``routes``."""

    def __init__(self, app: web.Application, routes: Mapping[str, Handler],
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._routes = routes

    async def _make_server(self) -> web.Server:
        return FrontServer(await super()._make_server(), self.app, self._routes)
