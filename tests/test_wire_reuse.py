"""Upstreams as they really behave with keep-alive: a server that closes a connection it
called keep-alive (llama.cpp's ``llama-server`` does after each stream) costs no call and
no breaker failure, and idle connections are closed on a timer, not only when reused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.core.errors import UpstreamConnectError
from proxy.http.server.app import build_app
from proxy.http.upstream import wire
from proxy.http.upstream.upstream import HttpUpstream

from .conftest import config_from
from .test_wire import OK, call, raw_server, read_request

Factory = Callable[..., Awaitable[Any]]
ANSWER = (b'{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
EVENTS = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
          b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
          b"data: [DONE]\n\n")


async def test_a_reused_connection_closed_before_any_answer_is_sent_again_fresh() -> None:
    """The server answers one call, then closes the connection when the next call comes
    on it (it had closed it while idle): the next call goes again on a new connection."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)  # and hangs up without a byte

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        assert await call(upstream) == (200, b"{}")
        assert server.connections == 2
        await upstream.close()


async def test_a_fresh_connection_closed_before_any_answer_is_an_error_not_a_loop() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url, {})
        with pytest.raises(UpstreamConnectError):
            await call(upstream)
        assert server.connections == 1
        await upstream.close()


async def test_a_reused_connection_that_fails_twice_is_not_tried_a_third_time() -> None:
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        if requests == 1:
            writer.write(OK)
            await writer.drain()
            await read_request(reader)
            requests += 1

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url, {})
        assert await call(upstream) == (200, b"{}")
        with pytest.raises(UpstreamConnectError):
            await call(upstream)
        assert (requests, server.connections) == (3, 2)
        await upstream.close()


async def test_idle_connections_are_closed_on_a_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "KEEPALIVE_S", 0.3)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    async with raw_server(handler) as server:
        upstream = HttpUpstream(server.url, {})
        await asyncio.gather(call(upstream), call(upstream), call(upstream))
        assert server.open == 3
        await asyncio.sleep(0.15)
        assert await call(upstream) == (200, b"{}")  # one is used again: its clock restarts
        async with asyncio.timeout(2):
            while server.open > 1:
                await asyncio.sleep(0.02)
        async with asyncio.timeout(2):
            while server.open:
                await asyncio.sleep(0.02)
        assert server.connections == 3
        await upstream.close()


def closing_after_each_stream() -> Callable[..., Awaitable[None]]:
    """As llama-server: keep-alive answers, but the connection closed after a stream."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(reader)
            if b'"stream":true' not in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"keep-alive: timeout=5\r\ncontent-length: "
                             + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"keep-alive: timeout=5\r\ntransfer-encoding: chunked\r\n\r\n"
                         + f"{len(EVENTS):x}\r\n".encode() + EVENTS + b"\r\n0\r\n\r\n")
            await writer.drain()
            return
    return handler


async def test_through_the_proxy_a_server_closing_after_streams_fails_no_call(
        aiohttp_client: Factory, counter: TokenCounter) -> None:
    """One slot, a stream and a plain call at once, ten times, with the official SDK:
    every call answered, and the provider's breaker saw no failure."""
    async with raw_server(closing_after_each_stream()) as server:
        config = config_from([{"name": "llama", "base_url": server.url, "max_concurrency": 1}],
                             {"m": [{"provider": "llama", "model": "tiny"}]})
        client: TestClient[web.Request, web.Application] = await aiohttp_client(
            build_app(config, counter=counter))
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x",
                                 max_retries=0)
        messages: Any = [{"role": "user", "content": "hi"}]

        async def streamed() -> str:
            stream = await sdk.chat.completions.create(model="m", messages=messages,
                                                       stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])

        for _ in range(10):
            text, reply = await asyncio.gather(
                streamed(), sdk.chat.completions.create(model="m", messages=messages))
            assert text == "hi" and reply.choices[0].message.content == "hi"
        status = await (await client.get("/admin/status")).json()
        breaker = status["breakers"]["llama/tiny"]
        assert breaker["window_failures"] == 0 and breaker["state"] == "closed"
        await sdk.close()
