"""A CONNECT tunnel through the egress proxy, for ``wire``: ``CONNECT host:port`` (with
``Proxy-Authorization`` when the proxy's URL has credentials), its answer's head read by
httptools, then TLS to the provider over the tunnel (the provider's host name for SNI and
the certificate check) or, for an ``http://`` provider, plain HTTP over it.

Errors are ``OSError``s, for ``wire`` to map with its others: ``ProxyRefused`` (any answer
but 2xx, such as 407 or 403) or a ``ConnectionError`` (a proxy that hung up, or answered
with something that is not HTTP).
"""

from __future__ import annotations

import asyncio
import ssl
from functools import partial
from typing import cast

import httptools

from ...core.health.provider import EgressProxy

MAX_ANSWER_BYTES = 16 * 1024  # the head of a proxy's answer to CONNECT, at most


class ProxyRefused(ConnectionError):
    def __init__(self, status: int) -> None:
        super().__init__(f"the egress proxy answered CONNECT with {status}")
        self.status = status


def connect_request(host: str, port: int, egress: EgressProxy) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    authorization = (f"proxy-authorization: {egress.authorization}\r\n"
                     if egress.authorization else "")
    return (f"CONNECT {authority} HTTP/1.1\r\nhost: {authority}\r\n{authorization}\r\n"
            ).encode()


async def open_tunnel(egress: EgressProxy, request: bytes, protocol: asyncio.Protocol,
                      tls: ssl.SSLContext | None, host: str) -> None:
    """Connects ``protocol`` to the provider through ``egress``: it gets the tunnel's
    (TLS) transport in ``connection_made`` and everything after the proxy's answer."""
    loop = asyncio.get_running_loop()
    transport, answer = await loop.create_connection(
        partial(_Answer, loop), egress.host, egress.port)
    try:
        transport.write(request)
        status = await answer.status
        if not 200 <= status < 300:
            raise ProxyRefused(status)
        if answer.extra or transport.is_closing():
            raise ConnectionError("the egress proxy sent bytes before the tunnel was used")
        if tls is None:
            transport.set_protocol(protocol)
            protocol.connection_made(transport)
            return
        tunnelled = await loop.start_tls(transport, protocol, tls, server_hostname=host)
        if tunnelled is None:
            raise ConnectionError("the tunnel closed during the TLS handshake")
        protocol.connection_made(tunnelled)
    except BaseException:
        transport.abort()
        raise


class _Answer(asyncio.Protocol):
    """Reads the proxy's answer to CONNECT up to the end of its head."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.status: asyncio.Future[int] = loop.create_future()
        self.extra = False  # bytes past the head of a 2xx: the tunnel cannot be trusted
        self._parser = httptools.HttpResponseParser(self)
        self._size = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.status.done():
            self.extra = True
            return
        self._size += len(data)
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._end(ConnectionError("the egress proxy's answer to CONNECT is not HTTP"))
            return
        if not self.status.done() and self._size > MAX_ANSWER_BYTES:
            self._end(ConnectionError("the egress proxy's answer to CONNECT is too long"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError("the egress proxy closed the connection"))

    def _end(self, error: ConnectionError) -> None:
        if not self.status.done():
            self.status.set_exception(error)
        if self._transport is not None:
            self._transport.abort()

    # --- httptools callbacks ----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200 and not self.status.done():  # a 1xx is followed by the answer
            self.status.set_result(status)

    def on_body(self, body: bytes) -> None:
        if self.status.done():
            self.extra = True
