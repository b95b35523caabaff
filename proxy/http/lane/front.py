"""The fast lane: proxied calls served without aiohttp's per-request machinery.

aiohttp's server spends CPU and memory on a request before its handler runs (its request,
parser, payload stream and handler task; docs/benchmarks.md and docs/operations.md measure it).
The lane reads the plain case itself (``proxy.http.lane.head``) — an HTTP/1.1 ``POST`` to a
proxied route, with a well formed head and a ``Content-Length`` body within the limit — and
runs the same middleware and handler on it, as soon as the head is in (a wrong key is
refused before its body is read, as aiohttp does). A plain answer is written in one go,
an SSE stream by ``proxy.http.call.events``, any other answer by aiohttp's writer. Anything else
(another route, a query string, a chunked or compressed body, ``Expect``, ``Upgrade``, a
head it does not accept, a body over the limit) hands the connection, from that request's
first byte, to aiohttp's protocol, which serves it and whatever follows on that
connection.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.tcp_helpers import tcp_keepalive
from aiohttp.web_protocol import RequestHandler

from ..base.appkeys import LANE
from ..base.edge import Incoming
from ..call.middleware import guarded
from .check import lane_off_because
from .head import HeadReader, Other, whole_answer
from .refusals import Runner
from .request import FastRequest

log = logging.getLogger(__name__)

Handler = Callable[[Incoming], Awaitable[web.StreamResponse]]

HOLD_BYTES = 64 * 1024  # read no more while a request is served and this much waits beyond it
# aiohttp's own defaults for the settings the lane shares with its RequestHandler.
_AIOHTTP_DEFAULTS = {name: parameter.default for name, parameter in
                     inspect.signature(RequestHandler.__init__).parameters.items()}


class FrontProtocol(BaseProtocol):
    """One client connection, served by the lane until a request needs aiohttp."""

    __slots__ = (
        "_buffer",
        "_closing",
        "_discard",
        "_front",
        "_held",
        "_idle_since",
        "_linger",
        "_reading",
        "_task_handler",
        "_timer",
    )

    def __init__(self, front: FrontServer) -> None:
        super().__init__(front.loop)
        self._front = front
        self._buffer = bytearray()
        self._reading: tuple[FastRequest, int] | None = None  # a body still coming in
        self._discard = 0  # bytes of an answered call's body still to come, to drop
        self._linger: asyncio.TimerHandle | None = None  # until then, at most
        self._task_handler: asyncio.Task[None] | None = None
        self._closing = False
        self._held = False  # reading paused while a request is served and bytes pile up
        self._idle_since = front.loop.time()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # What aiohttp's request reads of its protocol (``FastRequest.for_aiohttp``).
    ssl_context = None

    @property
    def peername(self) -> Any:
        return None if self.transport is None else self.transport.get_extra_info("peername")

    @property
    def sockname(self) -> Any:
        return None if self.transport is None else self.transport.get_extra_info("sockname")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._front.tcp_keepalive:
            tcp_keepalive(cast(asyncio.Transport, transport))
        self._front.in_lane.add(self)
        if self._front.keepalive_s > 0:
            self._timer = self._loop.call_at(self._idle_since + self._front.keepalive_s,
                                             self._on_timer)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        for timer in (self._timer, self._linger):
            if timer is not None:
                timer.cancel()
        task = self._task_handler
        if task is None:
            self._front.in_lane.discard(self)
        else:  # as aiohttp does: the handler is cancelled, and waited for at shutdown
            task.add_done_callback(lambda _: self._front.in_lane.discard(self))
            if self._front.handler_cancellation:
                task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._discard:
            dropped = min(self._discard, len(data))
            self._discard -= dropped
            data = data[dropped:]
            if self._discard:
                return
            self._lingered()
            if self._closing:
                self._close()
                return
        self._buffer += data
        if self._task_handler is None:
            self._advance()
        elif self._reading is not None:
            self._fill()
        if (self._task_handler is not None and self._reading is None
                and len(self._buffer) > HOLD_BYTES and not self._held):
            self._hold(True)

    def _advance(self) -> None:
        """Start the next request once its head is in, or hand the connection to aiohttp."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._closing:
            return
        head = self._front.reader.read(self._buffer)
        if head is None:
            return
        if isinstance(head, Other):
            self._hand_over()
            return
        del self._buffer[:head.size]
        request = FastRequest(self._front.app, head, self)
        self._reading = (request, head.length)
        self._fill()
        self._task_handler = self._loop.create_task(self._serve(request))

    def _fill(self) -> None:
        """Hand the body over once it has all come in."""
        assert self._reading is not None
        request, length = self._reading
        if len(self._buffer) < length:
            return
        body = bytes(memoryview(self._buffer)[:length])
        self._buffer = self._buffer[length:]
        self._reading = None
        request.arrived(body)

    async def _serve(self, request: FastRequest) -> None:
        try:
            response = await guarded(request, self._front.handlers[request.path])
            keep_alive = request.keep_alive and response.keep_alive is not False
            whole = whole_answer(response, keep_alive)
            if whole is None:
                if not keep_alive:
                    response.force_close()
                if not response.prepared:  # a stream has begun itself (``events``)
                    await response.prepare(request.for_aiohttp())
                await response.write_eof()
            else:
                assert self.transport is not None
                self.transport.writelines(whole)
                if self.writing_paused:
                    await self._drain_helper()
        except asyncio.CancelledError:
            self._close()
            raise
        except Exception:  # the client left mid-answer, or a half-sent answer failed
            log.debug("fast lane: answer not delivered", exc_info=True)
            if self.transport is not None:
                self.transport.abort()
            return
        finally:
            self._task_handler = None
        self._idle_since = self._loop.time()
        if self._reading is not None:  # answered before its body came: drop the rest
            self._linger_on(keep_alive)
            return
        if not keep_alive or self._closing:
            self._close()
            return
        if self._held:
            self._hold(False)
        if self._buffer:
            self._advance()

    def _linger_on(self, keep_alive: bool) -> None:
        """Read and drop the rest of an answered call's body (a client that sends it all
        before reading would otherwise meet a reset, not the answer), for at most
        ``lingering_time``; then go on with the connection, or close it."""
        assert self._reading is not None
        self._discard = self._reading[1] - len(self._buffer)
        self._reading = None
        self._buffer = bytearray()
        if self._closing or self._front.lingering_s <= 0:
            self._close()
            return
        self._closing = not keep_alive
        self._linger = self._loop.call_later(self._front.lingering_s, self._close)

    def _lingered(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _hand_over(self) -> None:
        transport = self.transport
        assert transport is not None
        self._front.in_lane.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        data, self._buffer = bytes(self._buffer), bytearray()
        handler = self._front.inner()
        self.transport = None
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.writing_paused:
            handler.pause_writing()
        if self._held:
            self._hold(False, transport)
        handler.data_received(data)

    def _hold(self, held: bool, transport: asyncio.Transport | None = None) -> None:
        """Pause reading from the client, or resume it (the lane's own flag: aiohttp's
        protocol keeps its reading state in names that change between releases)."""
        self._held = held
        transport = transport or self.transport
        if transport is None:
            return
        try:
            if held:
                transport.pause_reading()
            else:
                transport.resume_reading()
        except (AttributeError, NotImplementedError, RuntimeError):
            pass  # a transport with no flow control, or one closing

    def _on_timer(self) -> None:
        due = self._idle_since + self._front.keepalive_s
        if self._task_handler is None and self._loop.time() >= due:
            self._close()
            return
        self._timer = self._loop.call_at(max(due, self._loop.time() + 1.0), self._on_timer)

    def close(self) -> None:
        """Shutdown has begun: no new request; an idle connection closes now."""
        self._closing = True
        if self._task_handler is None:
            self._close()

    async def shutdown(self, timeout_s: float | None) -> None:
        """The last step of shutdown: wait for the request in progress, then end it."""
        self.close()
        task = self._task_handler
        if task is not None:
            await asyncio.wait({task}, timeout=timeout_s)
            task.cancel()
            await asyncio.wait({task}, timeout=timeout_s)
        self._close()


class FrontServer(web.Server):
    """aiohttp's server for the app, whose connections start in the fast lane."""

    def __init__(self, inner: web.Server, app: web.Application,
                 handlers: Mapping[str, Handler]) -> None:
        off_because = lane_off_because(app)
        if off_because is not None:
            raise RuntimeError(f"the fast lane cannot serve this app: {off_because}")
        super().__init__(inner.request_handler)
        app[LANE].on = True
        self.inner = inner
        self.app = app
        self.handlers = handlers
        self.loop = asyncio.get_running_loop()
        self.in_lane: set[FrontProtocol] = set()  # connections the lane serves now
        # The runner's settings for aiohttp's RequestHandler hold in the lane too.
        settings = {**_AIOHTTP_DEFAULTS, **inner._kwargs}
        self.keepalive_s: float = settings["keepalive_timeout"]
        self.lingering_s: float = settings["lingering_time"]
        self.handler_cancellation = inner.handler_cancellation
        self.tcp_keepalive: bool = settings["tcp_keepalive"]
        self.reader = HeadReader(handlers, app._client_max_size, settings["max_field_size"],
                                 settings["max_headers"])

    def __call__(self) -> FrontProtocol:  # type: ignore[override]
        """A new connection: the listener's protocol factory."""
        return FrontProtocol(self)

    def pre_shutdown(self) -> None:
        for connection in list(self.in_lane):
            connection.close()
        self.inner.pre_shutdown()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(self.inner.shutdown(timeout),
                             *(c.shutdown(timeout) for c in list(self.in_lane)))
        self.in_lane.clear()


class FrontRunner(Runner):
    """The proxy's runner (``refusals.Runner``) whose server has the fast lane for
    ``handlers``."""

    def __init__(self, app: web.Application, handlers: Mapping[str, Handler],
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._handlers = handlers

    async def _make_server(self) -> web.Server:
        return FrontServer(await super()._make_server(), self.app, self._handlers)
