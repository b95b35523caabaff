"""The fast lane (``proxy.http.lane.front``): which heads it takes and which it hands to aiohttp
(checked against aiohttp's own parser), and over real sockets: keep-alive, pipelining, bytes
trickling in, the hand-over mid-connection, a client leaving, back-pressure, idle
connections and shutdown."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import orjson
import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.tokens import TokenCounter
from proxy.http.call import forward
from proxy.http.lane import front
from proxy.http.lane import request as lane_request
from proxy.http.lane.front import FrontRunner, FrontServer
from proxy.http.lane.head import MAX_HEAD, OTHER, Head, HeadReader, whole_answer
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream, aiohttp_request

Factory = Callable[..., Awaitable[Any]]
HANDLERS = forward.HANDLERS
read_head = HeadReader(HANDLERS, 1 << 20, 8190, 128).read
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def post(*extra: bytes, path: str = "/v1/chat/completions", body: bytes = BODY) -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"host: proxy",
            b"content-type: application/json", b"authorization: Bearer sk-x",
            b"content-length: " + str(len(body)).encode(), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


LENGTH = b"content-length: %d" % len(BODY)
GET_MODELS = b"GET /v1/models HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer sk-x\r\n\r\n"


# --- which heads the lane takes --------------------------------------------------------------

def test_a_plain_call_is_read_whole() -> None:
    data = post() + b"POST /v1/next"
    head = read_head(data)
    assert isinstance(head, Head)
    assert (head.path, head.length, head.keep_alive) == ("/v1/chat/completions", len(BODY), True)
    assert head.headers["Authorization"] == "Bearer sk-x"
    assert data[head.size:head.size + head.length] == BODY


def test_a_head_is_awaited_until_whole() -> None:
    data = post()
    end = data.index(b"\r\n\r\n") + 4
    assert all(read_head(data[:n]) is None for n in range(end))
    assert isinstance(read_head(data[:end]), Head)


@pytest.mark.parametrize("data", [
    GET_MODELS,
    b"G",  # known at the first byte
    b"PUT /v1/chat/completions HTTP/1.1\r\n\r\n",
    post(path="/v1/models"),
    post(path="/v1/chat/completions?api-version=1"),
    post().replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    post().replace(b"POST /v1/chat/completions", b"POST  /v1/chat/completions"),
    post().replace(b"host: proxy\r\n", b""),  # HTTP/1.1 needs one
    post(b"Host: again"),
    post(b"content-type: text/plain"),
    post(b"user-agent: a", b"User-Agent: b"),
    post(b"transfer-encoding: chunked"),
    post(b"content-encoding: gzip"),
    post(b"expect: 100-continue"),
    post(b"upgrade: websocket", b"connection: upgrade"),
    post(b"connection: keep-alive, Upgrade"),
    post(b"sec-websocket-key1: 1"),
    post(b"content-length: 3"),  # two lengths
    post(b"x-folded: a", b" continued"),  # obs-fold
    post(b"bad name: x"),
    post(b"x-ctl: a\x01b"),
    post(b"x-bare: a\nb"),
    post().replace(LENGTH, b"content-length: 5\xc2\xb2"),
    post().replace(LENGTH, b"content-length: -1"),
    post().replace(LENGTH, b"content-length: 0x39"),
    post(*[b"x-many-%d: v" % i for i in range(130)]),
    post(b"x-big: " + b"a" * 8190),  # over aiohttp's max_field_size
    post(b"x-long: " + b"a" * MAX_HEAD),
    b"POST /v1/chat/completions HTTP/1.1\r\nx: " + b"a" * MAX_HEAD,  # never ends
    # refused before the head ends: a bare LF, a control byte, a line that is no route
    b"POST /v1/chat/completions HTTP/1.1\nhost: p\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\x00",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\rx",
    b"POST /v1/models HTTP/1.1\r\nho",
], ids=lambda data: repr(data[:40]) + str(len(data)))
def test_heads_the_lane_leaves_to_aiohttp(data: bytes) -> None:
    assert read_head(data) is OTHER


def test_a_body_over_the_limit_goes_to_aiohttp_which_answers_413() -> None:
    assert HeadReader(HANDLERS, len(BODY), 8190, 128).read(post()) != OTHER
    assert HeadReader(HANDLERS, len(BODY) - 1, 8190, 128).read(post()) is OTHER


def test_connection_close_and_odd_but_valid_heads() -> None:
    for closing in ([b"Connection: Close"], [b"connection: keep-alive", b"connection: close"],
                    [b"Proxy-Connection: close"], [b"Connection: x, CLOSE "]):
        head = read_head(post(*closing))
        assert isinstance(head, Head) and not head.keep_alive
        assert _aiohttp_reads(post(*closing)) == _lane_reads(post(*closing))
    head = read_head(post(b"X-Spaced:\t  two  words \t", b"x-utf: \xc3\xa9\xff",
                          b"x-empty:"))
    assert isinstance(head, Head)
    assert head.headers["x-spaced"] == "two  words"
    assert head.headers["x-utf"] == "é\udcff"  # as aiohttp decodes what is not UTF-8
    assert head.headers["x-empty"] == ""
    no_body = b"POST /v1/embeddings HTTP/1.1\r\nhost: p\r\n\r\n"
    head = read_head(no_body)
    assert isinstance(head, Head) and (head.length, head.size) == (0, len(no_body))


@pytest.mark.parametrize("field", [b"x: a" + b" " * 8000 + b"b", b"x:" + b" \t" * 4000,
                                   b"x: " + b"a " * 4000 + b"\x01"])
def test_whatever_the_spaces_a_head_is_read_in_linear_time(field: bytes) -> None:
    data = post(field)
    started = time.perf_counter()
    for _ in range(10):
        read_head(data)
    # Measured: about 1 ms for the ten. Quadratic in the 8,000 spaces would be tens of
    # millions of steps a read, seconds for the ten; 0.5 s leaves room for a loaded machine.
    assert time.perf_counter() - started < 0.5


Reading = tuple[list[tuple[str, str]], int, bool]  # headers, body length, keep-alive


def _aiohttp_reads(data: bytes) -> Reading | None:
    """aiohttp's own reading of one request (its C parser, as its server runs it), or None
    where it refuses the request."""
    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(BaseProtocol(loop), loop, 2**16, max_line_size=8190,
                                   max_field_size=8190, max_headers=128)
        try:
            messages, _, _ = parser.feed_data(data)
        except HttpProcessingError:
            return None
        if not messages:
            return None
        message, payload = messages[0]
        # A field value excludes the whitespace around it (RFC 9110, 5.5), as the lane and
        # later aiohttp releases read it; 3.14.0 keeps what trails it.
        return ([(name.lower(), value.strip(" \t")) for name, value in message.headers.items()],
                payload.total_bytes, not message.should_close)
    finally:
        loop.close()


def _lane_reads(data: bytes) -> Reading | None:
    head = read_head(data)
    if not isinstance(head, Head):
        return None
    return ([(name.lower(), value) for name, value in head.headers.items()], head.length,
            head.keep_alive)


_NAMES = st.sampled_from(["host", "Host", "content-type", "user-agent", "x-a", "X-A", "etag",
                          "authorization", "accept", "connection", "Proxy-Connection"]) | st.text(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    min_size=1, max_size=12)
_VALUES = st.binary(max_size=24).map(
    lambda raw: bytes(b for b in raw if b == 9 or 32 <= b < 127 or b >= 128)) | st.sampled_from(
    [b"close", b"keep-alive", b" Keep-Alive ", b"keep-alive, close", b"Upgrade", b"x, close"])


@settings(max_examples=400, deadline=None)
@given(fields=st.lists(st.tuples(_NAMES, _VALUES), max_size=10), body=st.binary(max_size=64),
       path=st.sampled_from(sorted(HANDLERS)))
def test_what_the_lane_takes_aiohttp_reads_the_same(
        fields: list[tuple[str, bytes]], body: bytes, path: str) -> None:
    fields = [(name, value) for name, value in fields if name.lower() != "content-length"]
    data = post(*[name.encode() + b":" + value for name, value in fields], path=path,
                body=body).replace(b"host: proxy\r\n", b"")
    lane = _lane_reads(data)
    if lane is not None:
        assert _aiohttp_reads(data) == lane
        assert lane[1] == len(body)


def _spliced(request: bytes) -> st.SearchStrategy[bytes]:
    """``request`` with a few arbitrary bytes put in, or put in place of some, anywhere."""
    return st.tuples(st.integers(0, len(request)), st.integers(0, 3),
                     st.binary(min_size=1, max_size=6)).map(
        lambda cut: request[:cut[0]] + cut[2] + request[cut[0] + cut[1]:])


@settings(max_examples=500, deadline=None)
@given(_spliced(post(b"x-a: b", b"Connection: keep-alive")))
def test_whatever_the_bytes_the_lane_takes_nothing_aiohttp_refuses(data: bytes) -> None:
    head = read_head(data)
    # A request taken whole; what follows it would be the next request's.
    if isinstance(head, Head) and len(data) >= head.size + head.length:
        request = data[:head.size + head.length]
        assert _aiohttp_reads(request) == _lane_reads(request)


# --- over real sockets -----------------------------------------------------------------------

async def serve(aiohttp_server: Factory, counter: TokenCounter, fake: FakeUpstream,
                concurrency: int = 4, **server: Any) -> TestServer:
    """The proxy in front of ``fake``; ``server``: the runner's settings."""
    upstream = await aiohttp_server(fake.app())
    provider = {"name": "p", "base_url": str(upstream.make_url("/v1")), "api_key": "sk-p",
                "max_concurrency": concurrency}
    config = config_from([provider], {"m": [{"provider": "p", "model": "up"}]},
                         classify={"keys": [{"name": "k", "key": "sk-x"}]})
    proxy: TestServer = await aiohttp_server(build_app(config, counter=counter), **server)
    return proxy


def front_of(proxy: TestServer) -> FrontServer:
    assert proxy.runner is not None and isinstance(proxy.runner.server, FrontServer)
    return proxy.runner.server


def in_lane(proxy: TestServer) -> int:
    """Connections the fast lane serves now."""
    return len(front_of(proxy).in_lane)


class Answers:
    """The responses read off one raw connection, in order."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._parser = httptools.HttpResponseParser(self)
        self.got: list[tuple[int, bytes]] = []
        self._body = b""

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.got.append((self._parser.get_status_code(), self._body))
        self._body = b""

    async def read(self, count: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
        async with asyncio.timeout(timeout_s):
            while len(self.got) < count:
                data = await self._reader.read(65536)
                assert data, f"connection closed after {self.got}"
                self._parser.feed_data(data)
        taken, self.got = self.got[:count], self.got[count:]
        return taken

    async def closed(self, timeout_s: float) -> bool:
        """The server closed the connection (and sent nothing more) within ``timeout_s``."""
        return await asyncio.wait_for(self._reader.read(), timeout_s) == b""

    async def informational(self) -> bytes:
        """A 1xx head, read before the final answer."""
        return await asyncio.wait_for(self._reader.readuntil(b"\r\n\r\n"), 5)


async def connect(proxy: TestServer) -> tuple[asyncio.StreamWriter, Answers]:
    assert proxy.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    return writer, Answers(reader)


def is_completion(answer: tuple[int, bytes]) -> bool:
    return answer[0] == 200 and orjson.loads(answer[1])["object"] == "chat.completion"


async def test_calls_on_one_connection_stay_in_the_lane_until_another_route(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    proxy = await serve(aiohttp_server, counter, fake)
    writer, answers = await connect(proxy)
    for _ in range(2):
        writer.write(post())
        assert is_completion((await answers.read(1))[0])
        assert in_lane(proxy) == 1
    writer.write(GET_MODELS)
    (status, body), = await answers.read(1)
    assert status == 200 and orjson.loads(body)["data"][0]["id"] == "m"
    assert in_lane(proxy) == 0  # aiohttp has it now, and serves calls on it too
    writer.write(post())
    assert is_completion((await answers.read(1))[0])
    assert len(fake.seen) == 3
    writer.close()


async def test_pipelined_requests_are_answered_in_order(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    embedding = post(path="/v1/embeddings", body=orjson.dumps({"model": "m", "input": "x"}))
    writer.write(post() + embedding + b"GET /healthz HTTP/1.1\r\nhost: p\r\n\r\n" + post())
    got = await answers.read(4)
    assert is_completion(got[0])
    assert orjson.loads(got[1][1])["object"] == "list"
    assert got[2] == (200, b'{"status":"ok"}')
    assert is_completion(got[3])
    writer.close()


async def test_a_call_trickling_in_byte_by_byte_is_served(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    for byte in post():
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0)
    assert is_completion((await answers.read(1))[0])
    assert in_lane(proxy) == 1
    writer.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: p\r\nauthorization: Bearer sk-x\r\n"
     b"transfer-encoding: chunked\r\n\r\n" + f"{len(BODY):x}".encode() + b"\r\n" + BODY
     + b"\r\n0\r\n\r\n", 200),
    (post(path="/v1/chat/completions?trace=1"), 200),
    (post().replace(b"host: proxy", b"host: proxy\r\n folded"), 400),
    (post().replace(LENGTH, LENGTH + b"\r\ncontent-length: 99"), 400),
])
async def test_what_the_lane_leaves_aiohttp_answers(
        aiohttp_server: Factory, counter: TokenCounter, request_bytes: bytes,
        status: int) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    writer.write(request_bytes)
    got, = await answers.read(1)
    assert got[0] == status
    assert status != 200 or is_completion(got)
    assert in_lane(proxy) == 0
    writer.close()


async def test_expect_100_continue_is_answered_by_aiohttp(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    head = post(b"expect: 100-continue", body=b"").replace(b"content-length: 0", LENGTH)
    writer.write(head)
    data = await answers.informational()
    assert data.startswith(b"HTTP/1.1 100 Continue")
    writer.write(BODY)
    assert is_completion((await answers.read(1))[0])
    writer.close()


async def test_connection_close_ends_the_connection_after_the_answer(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    writer.write(post(b"connection: close"))
    assert is_completion((await answers.read(1))[0])
    assert await answers.closed(5)
    writer.close()


async def test_a_client_leaving_while_queued_is_never_sent_upstream(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.5)
    proxy = await serve(aiohttp_server, counter, fake, concurrency=1)
    first, first_answers = await connect(proxy)
    first.write(post())
    await asyncio.sleep(0.1)
    second, _ = await connect(proxy)
    second.write(post())
    await asyncio.sleep(0.1)
    second.close()
    assert is_completion((await first_answers.read(1))[0])
    first.write(post())
    assert is_completion((await first_answers.read(1))[0])
    assert len(fake.seen) == 2  # the first call, then the third: never the one that left
    first.close()


async def test_pipelined_bytes_past_the_hold_limit_pause_reading_then_are_served(
        aiohttp_server: Factory, counter: TokenCounter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(front, "HOLD_BYTES", 200)
    proxy = await serve(aiohttp_server, counter, FakeUpstream(hold_s=0.2))
    writer, answers = await connect(proxy)
    writer.write(post() * 6)
    await asyncio.sleep(0.1)
    lane, = front_of(proxy).in_lane
    assert lane._held  # the first call is still upstream
    got = await answers.read(6)
    assert all(is_completion(answer) for answer in got)
    writer.write(post())  # reading resumed
    assert is_completion((await answers.read(1))[0])
    writer.close()


async def test_an_idle_connection_closes_after_the_keepalive_limit_a_busy_one_does_not(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream(hold_s=1.2),
                        keepalive_timeout=0.3)
    writer, answers = await connect(proxy)
    writer.write(post())
    assert is_completion((await answers.read(1))[0])  # took longer than the limit
    assert await answers.closed(3)
    assert in_lane(proxy) == 0
    writer.close()


async def test_shutdown_closes_idle_connections_and_finishes_calls_in_flight(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream(hold_s=0.5))
    idle, idle_answers = await connect(proxy)
    busy, busy_answers = await connect(proxy)
    busy.write(post())
    await asyncio.sleep(0.1)
    closing = asyncio.ensure_future(proxy.close())
    assert await idle_answers.closed(0.3)  # at once
    assert is_completion((await busy_answers.read(1))[0])
    await closing
    for writer in (idle, busy):
        writer.close()


async def test_a_slow_upload_is_not_cut_by_the_keepalive_limit(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream(), keepalive_timeout=0.3)
    writer, answers = await connect(proxy)
    await asyncio.sleep(0.2)
    data = post()
    writer.write(data[:-5])
    await asyncio.sleep(0.5)
    writer.write(data[-5:])
    assert is_completion((await answers.read(1))[0])
    writer.close()


def wrong_key(length: int) -> bytes:
    return post(body=b"").replace(b"Bearer sk-x", b"Bearer wrong").replace(
        b"content-length: 0", b"content-length: %d" % length)


async def test_a_wrong_key_is_refused_before_its_body_has_come(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    proxy = await serve(aiohttp_server, counter, fake, lingering_time=0.3)
    writer, answers = await connect(proxy)
    writer.write(wrong_key(900_000) + b"{" * 1000)
    (status, body), = await answers.read(1, timeout_s=1.0)
    assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
    # The rest is read and dropped for lingering_time, then the connection is closed.
    assert await answers.closed(2)
    assert not fake.seen and in_lane(proxy) == 0
    writer.close()


async def test_a_client_that_sends_all_its_body_before_reading_gets_its_answer(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    body = b" " * 3_000_000
    writer.write(wrong_key(len(body)) + body)
    await writer.drain()  # all of it went, as a blocking sendall() would
    (status, _), = await answers.read(1)
    assert status == 401  # not a reset
    writer.write(post())  # the dropped body is behind it: the connection goes on
    assert is_completion((await answers.read(1))[0])
    writer.close()


async def test_a_call_waits_for_its_body_then_the_connection_goes_on(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    data = post()
    writer.write(data[:-10])
    await asyncio.sleep(0.1)
    writer.write(data[-10:] + post())
    got = await answers.read(2)
    assert all(is_completion(answer) for answer in got)
    writer.close()


async def test_lane_connections_have_tcp_keepalive_like_aiohttps(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    writer.write(post())
    await answers.read(1)
    lane, = front_of(proxy).in_lane
    assert lane.transport is not None
    sock = lane.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    writer.close()


# --- plain answers, written as aiohttp writes them --------------------------------------------

async def _aiohttp_writes(response: web.StreamResponse, keep_alive: bool) -> bytes:
    request, sink = aiohttp_request(keep_alive)
    await response.prepare(request)
    await response.write_eof()
    return bytes(sink.data)


_DATE = re.compile(rb"Date: [^\r]+")


def _answers() -> list[web.Response]:
    return [
        web.Response(body=b'{"id":"x"}', headers={"content-type": "application/json",
                                                  "x-request-id": "req_1", "x-é": "vé"}),
        web.Response(body=b'{"error":{}}', status=429, content_type="application/json",
                     headers={"retry-after": "1"}),
        web.Response(body=b"", status=200),
        web.Response(body=b"data: x\n\n", status=503, reason="Busy Now"),
        web.Response(body=b"raw"),
        # aiohttp's serializer drops a lone surrogate (a header read with surrogateescape)
        web.Response(body=b"x", headers={"x-odd": "a\udcffb"}),
    ]


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("index", range(len(_answers())))
async def test_a_plain_answer_is_the_bytes_aiohttp_would_write(index: int,
                                                               keep_alive: bool) -> None:
    whole = whole_answer(_answers()[index], keep_alive)
    assert whole is not None
    lane, aiohttps = b"".join(whole), await _aiohttp_writes(_answers()[index], keep_alive)
    # The Date each one wrote, the same unless a second began between the two.
    assert _DATE.search(lane) and _DATE.search(aiohttps)
    assert _DATE.sub(b"Date: -", lane) == _DATE.sub(b"Date: -", aiohttps)


@pytest.mark.parametrize("response", [
    web.Response(body=b"x", headers={"x-bad": "a\x01b"}),
    web.Response(body=b"x", headers={"x-bad": "a\rb"}),
    web.Response(body=b"xyz", headers={"content-length": "1"}),
    web.Response(body=b"x", status=204),
    web.StreamResponse(),
], ids=str)
def test_answers_whole_answer_leaves_to_aiohttps_writer(response: web.StreamResponse) -> None:
    before = list(response.headers.items())
    assert whole_answer(response, True) is None
    assert list(response.headers.items()) == before  # left as it was, for aiohttp


@pytest.mark.parametrize("cancellation", [True, False])
async def test_a_client_leaving_cancels_its_call_as_the_runner_says(
        aiohttp_server: Factory, counter: TokenCounter, cancellation: bool) -> None:
    fake = FakeUpstream(hold_s=0.4)
    upstream = await aiohttp_server(fake.app())
    provider = {"name": "p", "base_url": str(upstream.make_url("/v1")), "api_key": "sk-p"}
    config = config_from([provider], {"m": [{"provider": "p", "model": "up"}]})
    runner = FrontRunner(build_app(config, counter=counter), HANDLERS,
                         handler_cancellation=cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        _, writer = await asyncio.open_connection(*runner.addresses[0][:2])
        writer.write(post())
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.sleep(0.5)
        assert (fake.cancelled, fake.completed) == ((1, 0) if cancellation else (0, 1))
    finally:
        await runner.cleanup()


async def test_a_stream_the_lane_wrote_is_not_handed_to_aiohttps_writer(
        aiohttp_server: Factory, counter: TokenCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed answer begins and ends in the lane: aiohttp's own request (costly to
    build) is made only for an answer the lane does not write."""
    def refused(self: object) -> None:
        raise AssertionError("built an aiohttp request for a stream the lane wrote")

    monkeypatch.setattr(lane_request.FastRequest, "for_aiohttp", refused)
    proxy = await serve(aiohttp_server, counter, FakeUpstream())
    writer, answers = await connect(proxy)
    streamed = orjson.dumps({**orjson.loads(BODY), "stream": True})
    for _ in range(2):  # on one keep-alive connection
        writer.write(post(body=streamed))
        (status, body), = await answers.read(1)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert in_lane(proxy) == 1
    writer.close()
