"""The request the fast lane took (``front``): what a proxied call's handler reads of it
(``base.edge.Incoming``), and, only where aiohttp's writer answers, aiohttp's own request
made from it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import RawRequestMessage
from aiohttp.http_writer import HttpVersion11, StreamWriter
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler
from yarl import URL

from ..base import edge
from ..call.events import ANSWER_EVENTS
from .events import LaneEvents
from .head import Head

if TYPE_CHECKING:
    from .front import FrontProtocol

_T = TypeVar("_T")


class FastRequest:
    """A request the lane took: what the handler and aiohttp's response writers read."""

    __slots__ = (
        "_body",
        "_protocol",
        "_state",
        "_waiter",
        "app",
        "headers",
        "keep_alive",
        "path",
    )
    method = "POST"

    def __init__(self, app: web.Application, head: Head, protocol: FrontProtocol) -> None:
        self.app = app
        self.path = head.path
        self.headers = head.headers
        self.keep_alive = head.keep_alive
        self._body: bytes | None = None  # until it has all come in
        self._waiter: asyncio.Future[None] | None = None
        self._protocol = protocol
        # It is given the lane's SSE answer (``call.events.event_stream``).
        self._state: dict[web.RequestKey[Any], Any] = {ANSWER_EVENTS: LaneEvents}

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._protocol.transport

    @property
    def protocol(self) -> BaseProtocol:
        return self._protocol

    @property
    def rel_url(self) -> URL:
        return URL.build(path=self.path, encoded=True)

    async def read(self) -> bytes:
        """The whole body; if it is still coming, within ``edge.BODY_WAIT_S`` (else
        ``BodyTimeout``): a timer only for a body that is not in yet."""
        if self._body is None:
            self._waiter = self._protocol.loop.create_future()
            async with edge.arriving(edge.BODY_WAIT_S):
                await self._waiter
            assert self._body is not None
        return self._body

    def arrived(self, body: bytes) -> None:
        self._body = body
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __getitem__(self, key: web.RequestKey[_T]) -> _T:
        return cast(_T, self._state[key])

    def __setitem__(self, key: web.RequestKey[_T], value: _T) -> None:
        self._state[key] = value

    def get(self, key: web.RequestKey[_T], /) -> _T | None:
        return self._state.get(key)

    def for_aiohttp(self) -> web.BaseRequest:
        """This request as aiohttp's own, for an answer aiohttp's writer sends (one the
        lane does not write itself): made only then, as it costs what the lane saves."""
        protocol = self._protocol
        headers = self.headers
        message = RawRequestMessage(
            "POST", self.path, HttpVersion11, headers,
            tuple((name.encode(), value.encode()) for name, value in headers.items()),
            not self.keep_alive, None, False, False, self.rel_url)
        task = asyncio.current_task()
        assert task is not None
        return web.BaseRequest(
            message, EMPTY_PAYLOAD, cast(RequestHandler, protocol),
            StreamWriter(protocol, protocol.loop), cast("asyncio.Task[None]", task),
            protocol.loop, client_max_size=self.app._client_max_size)
