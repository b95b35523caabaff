"""The lean provider client (``proxy.http.upstream.wire`` behind ``HttpUpstream``) against raw
servers on 127.0.0.1 that write exactly the bytes each case needs: framing, reuse, broken
and hostile answers, deadlines, back-pressure, cancellation, TLS."""

from __future__ import annotations

import asyncio
import gzip
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trustme

from proxy.core.errors import UpstreamBadResponse, UpstreamConnectError, UpstreamTimeout
from proxy.core.health.provider import Timeouts
from proxy.http.upstream import upstream as upstream_module
from proxy.http.upstream.upstream import HttpUpstream, UpstreamRequest
from proxy.http.upstream.wire import HIGH_WATER

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
QUICK = Timeouts(connect_s=1.0, first_byte_s=1.0, idle_s=0.3, response_s=1.0)
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class Server:
    url: str
    connections: int = 0
    open: int = 0
    requests: list[bytes] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


@asynccontextmanager
async def raw_server(handler: Handler, tls: ssl.SSLContext | None = None,
                     ) -> AsyncIterator[Server]:
    server = Server("")

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        server.open += 1
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            server.open -= 1
            writer.close()

    listener = await asyncio.start_server(on_connection, "127.0.0.1", 0, ssl=tls)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1"
    async with listener:
        yield server


def answering(*replies: bytes, keep: bool = True) -> Handler:
    """Answers requests with the replies in turn, whichever connection they come on, then
    with the last one; without ``keep`` it hangs up after each."""
    queue = list(replies)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(queue.pop(0) if len(queue) > 1 else queue[0])
            await writer.drain()
            if not keep:
                return
    return handler


def request(stream: bool = False, **headers: str) -> UpstreamRequest:
    return UpstreamRequest("/chat/completions", b'{"model":"m"}', "m", stream, headers)


async def call(upstream: HttpUpstream, timeouts: Timeouts = QUICK, stream: bool = False,
               **headers: str) -> tuple[int, bytes]:
    response = await upstream.send(request(stream, **headers), timeouts)
    if stream:
        return response.status, b"".join([chunk async for chunk in response.chunks()])
    return response.status, await response.read()


async def test_a_connection_is_reused_and_the_request_is_well_formed() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(OK)

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url.replace("/v1", "/openai/v1"),
                                {"Authorization": "Bearer k"}, {"api-version": "2024-10-21"})
        for _ in range(3):
            assert await call(upstream, **{"x-request-id": "r1"}) == (200, b"{}")
        await upstream.close()
    assert server.connections == 1
    head = seen[0].decode()
    assert head.startswith("POST /openai/v1/chat/completions?api-version=2024-10-21 HTTP/1.1\r\n")
    lines = head.lower().split("\r\n")
    assert "authorization: bearer k" in lines and "x-request-id: r1" in lines
    assert f"host: {server.url.split('/')[2]}" in lines and "content-length: 13" in lines
    assert seen[0].endswith(b'{"model":"m"}')


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
], ids=["chunked", "informational-first"])
async def test_framings_that_keep_the_connection(reply: bytes) -> None:
    async with raw_server(answering(reply, reply)) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert server.connections == 1


async def test_an_answer_without_a_length_ends_with_its_connection() -> None:
    reply = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{\"a\": 1}"
    async with raw_server(answering(reply, keep=False)) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b'{"a": 1}')
        assert await call(upstream, stream=True) == (200, b'{"a": 1}')
        await upstream.close()
    assert server.connections == 2  # never reused


async def test_a_connection_the_provider_closed_while_idle_is_not_reused() -> None:
    async with raw_server(answering(OK, keep=False)) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        await asyncio.sleep(0.05)  # the server has hung up by now
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert server.connections == 2


async def test_an_answer_not_read_to_its_end_closes_its_connection() -> None:
    half = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345"
    async with raw_server(answering(half, OK)) as server:
        upstream = HttpUpstream(server.url, {})
        response = await upstream.send(request(), QUICK)
        response.close()
        response.close()  # twice is fine
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert server.connections == 2


@pytest.mark.parametrize("encoding, pack", [
    ("gzip", gzip.compress), ("deflate", zlib.compress),
])
async def test_compressed_answers_are_inflated(encoding: str, pack: Callable[[bytes], bytes],
                                               ) -> None:
    body = pack(b'{"long": "' + b"x" * 5000 + b'"}')
    reply = (f"HTTP/1.1 200 OK\r\ncontent-encoding: {encoding}\r\n"
             f"content-length: {len(body)}\r\n\r\n").encode() + body
    async with raw_server(answering(reply, reply)) as server:
        upstream = HttpUpstream(server.url, {})
        assert (await call(upstream))[1].startswith(b'{"long": "xxx')
        assert len((await call(upstream, stream=True))[1]) == 5012
        await upstream.close()


@pytest.mark.parametrize("reply, error, match", [
    (b"garbage\r\n\r\n", UpstreamBadResponse, "malformed"),
    (b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 2\r\n\r\n{}",
     UpstreamBadResponse, "unsupported encoding"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n{}", UpstreamBadResponse, "broke"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 200\r\n\r\n" + b"x" * 200, UpstreamBadResponse,
     "larger than 100 bytes"),
    (b"", UpstreamConnectError, "closed the connection"),
    (b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 4\r\n\r\nnope",
     UpstreamBadResponse, "malformed"),
    (b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n",
     UpstreamBadResponse, "malformed"),
], ids=["garbage", "brotli", "cut", "too-large", "hang-up", "bad-gzip", "upgrade"])
async def test_broken_answers_are_the_proxys_errors(reply: bytes, error: type[Exception],
                                                   match: str) -> None:
    async with raw_server(answering(reply, keep=False)) as server:
        upstream = HttpUpstream(server.url, {}, max_response_bytes=100)
        with pytest.raises(error, match=match):
            await call(upstream)
        await upstream.close()


async def test_a_gzip_bomb_stops_at_the_size_bound() -> None:
    body = gzip.compress(b"0" * (50 << 20))
    reply = (f"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\n"
             f"content-length: {len(body)}\r\n\r\n").encode() + body
    async with raw_server(answering(reply, keep=False)) as server:
        upstream = HttpUpstream(server.url, {}, max_response_bytes=1 << 20)
        with pytest.raises(UpstreamBadResponse, match="larger than"):
            await call(upstream)
        await upstream.close()


async def test_deadlines_head_whole_answer_and_stream_idle() -> None:
    slow_body = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345"

    def stalls(reply: bytes) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(reply)
            await asyncio.sleep(5)
        return handler

    timeouts = Timeouts(connect_s=1.0, first_byte_s=0.2, idle_s=0.2, response_s=0.2)
    for reply, stream, match in [
        (b"", False, "no response within 0.2s"),
        (slow_body, False, "not complete in time"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", True, "stalled"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n", True, "stalled"),
    ]:
        async with raw_server(stalls(reply)) as server:
            upstream = HttpUpstream(server.url, {})
            started = asyncio.get_running_loop().time()
            with pytest.raises(UpstreamTimeout, match=match):
                await call(upstream, timeouts, stream=stream)
            # The 0.2 s deadline, not the server's 5 s: generous for a loaded machine.
            assert asyncio.get_running_loop().time() - started < 3.0
            await upstream.close()


async def test_a_stream_that_keeps_coming_is_not_a_stall() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):  # 0.8 s in all, never idle for 0.3 s
            await asyncio.sleep(0.1)
            writer.write(b"1\r\na\r\n")
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async with raw_server(trickle) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream, stream=True) == (200, b"a" * 8)
        await upstream.close()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing() -> None:
    chunk = b"y" * 65536
    total = 64  # 4 MiB

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(total):
            writer.write(b"10000\r\n" + chunk + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async with raw_server(flood) as server:
        upstream = HttpUpstream(server.url, {})
        response = await upstream.send(request(stream=True), QUICK)
        chunks = response.chunks()
        size = len(await anext(chunks))
        await asyncio.sleep(0.5)  # longer than idle_s: a paused socket is not a stall
        conn = response._conn
        # At most one socket read (uvloop reads up to 256 KiB) past the high-water mark.
        assert conn is not None and conn._buffered <= HIGH_WATER + 256 * 1024
        async for part in chunks:
            size += len(part)
        assert size == total * len(chunk)
        await upstream.close()


async def test_a_call_cancelled_at_each_await_leaks_no_connection() -> None:
    async def hung_up(reader: asyncio.StreamReader) -> bool:
        """Whether the client closes the connection within 0.2 s."""
        try:
            async with asyncio.timeout(0.2):
                return await reader.read(1) == b""
        except TimeoutError:
            return False

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            if await hung_up(reader):
                return
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            if await hung_up(reader):
                return
            writer.write(b"2\r\n{}\r\n0\r\n\r\n")

    async with raw_server(slow) as server:
        upstream = HttpUpstream(server.url, {})
        for delay in (0.0, 0.1, 0.3):
            task = asyncio.create_task(call(upstream))
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert server.open == 0  # the connection was closed at once
        assert upstream._origin._idle == []  # nothing half-read goes back to the pool
        assert await call(upstream) == (200, b"{}")
        assert len(upstream._origin._idle) == 1
        await upstream.close()
    assert server.connections == 4


async def test_bytes_on_an_idle_connection_make_it_unusable() -> None:
    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nXX")  # nobody asked
        await reader.read()

    async with raw_server(chatty) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        await asyncio.sleep(0.2)
        assert upstream._origin._idle == []
        await upstream.close()


async def test_header_injection_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be sent"):
        HttpUpstream("http://127.0.0.1:1/v1", {"x-api-key": "k\r\nx-evil: 1"})
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await reader.read()

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream, **{"user-agent": "a\r\nx-evil: 1"}) == (200, b"{}")
        await upstream.close()
    assert b"x-evil" not in seen[0]


async def test_connect_failures() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    upstream = HttpUpstream(f"http://127.0.0.1:{port}/v1", {})
    with pytest.raises(UpstreamConnectError, match="failed"):
        await call(upstream)
    with socket.socket() as full:  # a listener whose backlog is full drops new SYNs
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        waiting = [socket.socket() for _ in range(3)]
        for sock in waiting:
            sock.setblocking(False)
            sock.connect_ex(full.getsockname())
        blackhole = HttpUpstream("http://{}:{}/v1".format(*full.getsockname()), {})
        with pytest.raises(UpstreamConnectError, match="timed out"):
            await call(blackhole, Timeouts(connect_s=0.2, first_byte_s=1, idle_s=1,
                                           response_s=1))
        for sock in waiting:
            sock.close()


async def test_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    authority = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    authority.configure_trust(client_context)
    async with raw_server(answering(OK, OK), tls=server_context) as server:
        monkeypatch.setattr(upstream_module, "_tls_context", lambda: client_context)
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
        monkeypatch.setattr(upstream_module, "_tls_context", ssl.create_default_context)
        untrusting = HttpUpstream(server.url, {})
        with pytest.raises(UpstreamConnectError, match="SSL"):
            await call(untrusting)
    assert server.connections == 1  # the refused handshake never became a connection
