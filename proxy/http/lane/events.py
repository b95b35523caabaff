"""The fast lane's SSE answer, for a call the lane took (``proxy.http.lane.front``).

It writes the bytes aiohttp's response and writer would write — the same headers in the
same order, made by aiohttp's own serializer, chunked the same way — with none of their
per-answer machinery. Like aiohttp's, its head goes out with the first event, and its end
with the last. What the relay never sends (an empty-body status, a cookie, compression)
goes through aiohttp's writer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.http_writer import _serialize_headers

from ..base.edge import Incoming
from ..call.events import EventStream
from .head import writer_defaults

if TYPE_CHECKING:
    from .request import FastRequest

_END = b"0\r\n\r\n"


class LaneEvents(EventStream):
    """The fast lane's SSE answer (see the module)."""

    _lane: FastRequest | None = None
    _head: bytes | None = None  # until the first write

    @property
    def prepared(self) -> bool:
        return self._eof_sent or self._lane is not None or self._payload_writer is not None

    async def begin(self, request: Incoming) -> None:
        if self._eof_sent or self._lane is not None:
            return
        lane = cast("FastRequest", request)
        if (self._status < 200 or self._status in (204, 304) or self._cookies
                or self._compression or self._chunked):
            await self.prepare(lane.for_aiohttp())  # what the relay never sends: aiohttp's
            return
        # What aiohttp's _prepare_headers does for a POST answered with a body of unknown
        # length over HTTP/1.1.
        if self._keep_alive is None:
            self._keep_alive = lane.keep_alive
        headers = self._headers
        headers["Transfer-Encoding"] = "chunked"
        headers.extend(writer_defaults(headers, self._keep_alive, has_body=True))
        self._head = _serialize_headers(f"HTTP/1.1 {self._status} {self._reason}", headers)
        self._lane = lane

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        lane = self._lane
        if lane is None:
            await super().write(data)
            return
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self._head is None and not data:
            return
        self._send(lane, bytes(data), end=False)
        protocol = lane.protocol
        if protocol.writing_paused:  # aiohttp drains past 64 KiB; the transport knows better
            await protocol._drain_helper()

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        lane = self._lane
        if lane is None:
            await super().write_eof(data)
            return
        self._send(lane, data, end=True)
        self._eof_sent = True
        await lane.protocol._drain_helper()

    def _send(self, lane: FastRequest, data: bytes, *, end: bool) -> None:
        """The head if not sent yet, ``data`` as a chunk, and with ``end`` the last chunk,
        in one write (as aiohttp's writer coalesces them)."""
        transport = lane.transport
        if transport is None or transport.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")
        pieces = [] if self._head is None else [self._head]
        self._head = None
        if data:
            pieces += (f"{len(data):x}\r\n".encode("ascii"), data,
                       b"\r\n" + _END if end else b"\r\n")
        elif end:
            pieces.append(_END)
        transport.writelines(pieces)
