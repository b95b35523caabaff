"""What the proxy answers itself has the fields OpenAI's API spec requires: the simulated
provider's chat completion, a background response while it waits, and file lists, which
page as the spec says (``limit``, ``after``, ``order``; ``first_id``, ``last_id``,
``has_more``), through the official SDK."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.core.formats.batchdoc import response_doc
from proxy.http.server.app import build_app

from .conftest import config_from

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
# The "required" lists of the spec's schemas (openai/openai-openapi), by field name.
RESPONSE_REQUIRED = {"id", "object", "created_at", "error", "incomplete_details",
                     "instructions", "model", "tools", "output", "parallel_tool_calls",
                     "metadata", "tool_choice", "temperature", "top_p"}
CHAT_MESSAGE_REQUIRED = {"role", "content", "refusal"}
LIST_REQUIRED = {"object", "data", "first_id", "last_id", "has_more"}
LINE = b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
async def client(aiohttp_client: Factory, counter: TokenCounter, tmp_path: Path) -> Client:
    config = config_from(
        [{"name": "s", "kind": "simulated", "simulate": {"ttft_s": 5, "tokens_per_s": 100}}],
        {"m": [{"provider": "s", "model": "x"}]}, storage={"path": str(tmp_path / "w.db")})
    made: Client = await aiohttp_client(build_app(config, counter=counter))
    return made


def sdk(client: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x",
                              max_retries=0)


async def test_the_simulated_chat_message_has_every_required_field(
        aiohttp_client: Factory, counter: TokenCounter) -> None:
    config = config_from([{"name": "s", "kind": "simulated",
                           "simulate": {"ttft_s": 0.01, "tokens_per_s": 1000}}],
                         {"m": [{"provider": "s", "model": "x"}]})
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    resp = await client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    message = (await resp.json())["choices"][0]["message"]
    assert set(message) >= CHAT_MESSAGE_REQUIRED and message["refusal"] is None


async def test_a_queued_background_response_has_every_required_field(
        client: Client) -> None:
    resp = await client.post("/v1/responses", json={
        "model": "m", "input": "hi", "background": True, "instructions": "be brief",
        "temperature": 0.2, "metadata": {"team": "a"}})
    doc = await resp.json()
    assert resp.status == 200 and set(doc) >= RESPONSE_REQUIRED, RESPONSE_REQUIRED - set(doc)
    assert (doc["status"], doc["instructions"], doc["temperature"], doc["metadata"]) == (
        "queued", "be brief", 0.2, {"team": "a"})
    assert (doc["tools"], doc["tool_choice"], doc["top_p"]) == ([], "auto", None)
    fetched = await (await client.get(f"/v1/responses/{doc['id']}")).json()
    assert set(fetched) >= RESPONSE_REQUIRED
    retrieved = await sdk(client).responses.retrieve(doc["id"])  # the SDK reads it
    assert retrieved.id == doc["id"] and retrieved.instructions == "be brief"


def test_a_queued_response_echoes_a_null_as_openais_default() -> None:
    # The spec allows a request's parallel_tool_calls to be null, not a Response's.
    doc = response_doc("resp_1", 0, "queued", {"model": "m", "parallel_tool_calls": None})
    assert doc["parallel_tool_calls"] is True


async def test_file_lists_page_as_the_spec_says(client: Client) -> None:
    api = sdk(client)
    made = [(await api.files.create(file=(f"{i}.jsonl", io.BytesIO(LINE)), purpose="batch")).id
            for i in range(5)]
    raw = await (await client.get("/v1/files", params={"limit": "2"})).json()
    assert set(raw) >= LIST_REQUIRED and raw["has_more"] and len(raw["data"]) == 2
    assert (raw["first_id"], raw["last_id"]) == (raw["data"][0]["id"], raw["data"][1]["id"])
    every = [f.id async for f in await api.files.list(limit=2)]  # the SDK follows ``after``
    assert sorted(every) == sorted(made) and every[:2] == [f["id"] for f in raw["data"]]
    oldest = await (await client.get("/v1/files", params={"order": "asc", "limit": "10"})).json()
    assert [f["id"] for f in oldest["data"]] == every[::-1] and not oldest["has_more"]
    rest = await (await client.get("/v1/files", params={"after": every[2]})).json()
    assert [f["id"] for f in rest["data"]] == every[3:] and not rest["has_more"]
    for bad in ({"limit": "0"}, {"limit": "x"}, {"after": "file-nope"}, {"order": "up"}):
        refused = await client.get("/v1/files", params=bad)
        body = await refused.json()
        assert refused.status == 400 and body["error"]["param"] == next(iter(bad)), bad
    await api.close()
