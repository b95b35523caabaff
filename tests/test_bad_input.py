"""Inputs the proxy does not understand are 4xx in OpenAI's error shape, never a 500: a
body that is not the encoding it claims, multipart uploads with the wrong boundary or cut
short, and the requests aiohttp's parser refuses before any handler runs (with the fast
lane and without it), over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, cast

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.http.base import edge
from proxy.http.lane import refusals
from proxy.http.server.app import build_app

from .conftest import config_from

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


@pytest.fixture
async def client(aiohttp_client: Factory, counter: TokenCounter, tmp_path: Any) -> Client:
    config = config_from([{"name": "s", "kind": "simulated"}],
                         {"m": [{"provider": "s", "model": "x"}]},
                         storage={"path": str(tmp_path / "work.db")})
    made: Client = await aiohttp_client(build_app(config, counter=counter))
    return made


async def exchange(client: Client | int, request: bytes) -> tuple[int, dict[str, Any]]:
    """One request written byte for byte to a client's server (or a port); (status, the
    JSON error body)."""
    answer = await written(client if isinstance(client, int) else client.server.port, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer
    assert b"x-request-id: req_" in head.lower(), answer
    return int(head.split()[1]), orjson.loads(body)


async def written(port: int | None, request: bytes) -> bytes:
    """What the server at ``port`` answers ``request`` with, until it closes."""
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def post(path: str, body: bytes, *headers: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + b"".join(h + b"\r\n" for h in headers)
            + b"Content-Length: " + str(size).encode() + b"\r\n\r\n" + body)


def assert_openai_400(status: int, body: dict[str, Any]) -> None:
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
async def test_a_body_that_is_not_the_encoding_it_claims_is_a_400(
        client: Client, path: str, encoding: bytes) -> None:
    status, body = await exchange(client, post(
        path, b'{"model": "m", "input": "hi"}', b"Content-Type: application/json",
        b"Content-Encoding: " + encoding))
    assert_openai_400(status, body)
    assert "could not be read" in body["error"]["message"]


FORM = (b"--real\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        b"--real\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n"
        b"Content-Type: application/jsonl\r\n\r\n"
        + b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
        + b"\r\n--real--\r\n")


@pytest.mark.parametrize(("named", "body"), [
    (b"other", FORM),  # the header names another boundary than the body uses
    (b"real", FORM[:60]),  # cut short inside the first part
    (b"real", FORM[: FORM.index(b"a.jsonl") + 40]),  # cut short inside the file
    (b"real", b"--real\r\nno blank line after the part's headers"),
    (b"real", b"garbage with no boundary at all"),
])
async def test_a_malformed_upload_is_a_400(client: Client, named: bytes, body: bytes) -> None:
    status, answer = await exchange(client, post(
        "/v1/files", body, b"Content-Type: multipart/form-data; boundary=" + named))
    assert_openai_400(status, answer)


async def test_a_well_formed_upload_is_stored(client: Client) -> None:
    status, answer = await exchange(client, post(
        "/v1/files", FORM, b"Content-Type: multipart/form-data; boundary=real"))
    assert status == 200 and answer["object"] == "file" and answer["bytes"] > 0


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
REFUSED = {  # requests aiohttp's parser refuses, and a word of the reason the client reads
    "request line": (b"GARBAGE\r\n\r\n", "method"),
    "header name": (HEAD + b"Bad Header: y\r\nContent-Length: 2\r\n\r\n{}", "header"),
    "content-length": (HEAD + b"Content-Length: abc\r\n\r\n{}", "Content-Length"),
    "chunk size": (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk"),
    "zstd body": (HEAD + b"Content-Encoding: zstd\r\nContent-Length: 4\r\n\r\nabcd",
                  "Content-Encoding"),
    "br body": (HEAD + b"Content-Encoding: br\r\nContent-Length: 4\r\n\r\nabcd",
                "Content-Encoding"),
    "head too large": (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20_000
                       + b"\r\n\r\n", "bytes"),
}


@pytest.mark.parametrize("name", REFUSED)
async def test_what_aiohttp_refuses_is_an_openai_error(client: Client, name: str) -> None:
    request, word = REFUSED[name]
    status, body = await exchange(client, request)
    assert_openai_400(status, body)
    assert word in body["error"]["message"]
    assert "b'" not in body["error"]["message"]  # the client's own bytes are not echoed
    assert "install" not in body["error"]["message"]  # nor advice meant for the server


@pytest.fixture
async def lane_off(counter: TokenCounter, tmp_path: Any) -> Any:
    """The proxy as ``serve --no-fast-lane`` runs it: ``refusals.Runner`` on a real port."""
    config = config_from([{"name": "s", "kind": "simulated"}],
                         {"m": [{"provider": "s", "model": "x"}]},
                         storage={"path": str(tmp_path / "work.db")})
    runner = refusals.Runner(build_app(config, counter=counter), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1]
    await runner.cleanup()


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["request line", "zstd body", "head too large"])
async def test_without_the_lane_what_aiohttp_refuses_is_an_openai_error(
        lane_off: int, name: str) -> None:
    status, body = await exchange(lane_off, REFUSED[name][0])
    assert_openai_400(status, body)
    status, models = await exchange(lane_off, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
    assert status == 200 and models["object"] == "list"


@pytest.mark.e2e
async def test_an_aiohttp_without_the_names_answers_in_plain_text(
        counter: TokenCounter, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(refusals, "_SERVER_ATTRS", (*refusals._SERVER_ATTRS, "_gone"))
    config = config_from([{"name": "s", "kind": "simulated"}],
                         {"m": [{"provider": "s", "model": "x"}]},
                         storage={"path": str(tmp_path / "work.db")})
    runner = refusals.Runner(build_app(config, counter=counter))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        answer = await written(runner.addresses[0][1], REFUSED["request line"][0])
        assert answer.startswith(b"HTTP/1.0 400") and b"text/plain" in answer
        assert "plain text: aiohttp web.Server lacks _gone" in caplog.text
    finally:
        await runner.cleanup()


def test_a_refusal_past_aiohttp_s_own_fault_is_a_server_error() -> None:
    response = refusals.refusal(504, None, None)
    body = orjson.loads(cast(bytes, response.body))
    assert response.status == 504 and body["error"]["type"] == "server_error"


@pytest.mark.parametrize(("path", "kind"), [
    ("/v1/chat/completions", b"application/json"),  # the fast lane
    ("/v1/chat/completions?through=aiohttp", b"application/json"),
    ("/v1/batches", b"application/json"),
    ("/v1/files", b"multipart/form-data; boundary=real"),  # holds one of the upload places
])
async def test_a_body_that_stops_short_is_a_408_and_the_connection_closes(
        client: Client, path: str, kind: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge, "BODY_WAIT_S", 0.3)
    monkeypatch.setattr(edge, "UPLOAD_WAIT_S", 0.3)
    request = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: " + kind
               + b"\r\nContent-Length: 1000\r\n\r\n" + FORM[:100])
    assert client.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    body = orjson.loads(await reader.readexactly(length))
    writer.close()
    assert int(head.split()[1]) == 408, head
    assert b"connection: close" in head.lower()  # the rest of its body is no request
    assert body["error"]["code"] == "request_timeout"
