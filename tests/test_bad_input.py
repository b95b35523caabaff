"""Inputs the proxy does not understand are 4xx in OpenAI's error shape, never a 500: a
body that is not the encoding it claims, multipart uploads with the wrong boundary or cut
short, over real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.tokens import TokenCounter
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


async def exchange(client: Client, request: bytes) -> tuple[int, dict[str, Any]]:
    """One request written byte for byte; (status, the JSON error body)."""
    assert client.server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)


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
