"""The access log: one line per call however it ends, with the contract's fields, and no
secret anywhere the proxy writes (logs at DEBUG, access log, metrics, status)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.http.base.access import AccessLog, CallRecord
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FIELDS = {"ts", "request_id", "key", "tier", "model", "upstream", "status", "code", "queue_ms",
          "upstream_ms", "ttft_ms", "prompt_tokens", "completion_tokens", "cost_usd", "cache"}
KEY = {"Authorization": "Bearer app-secret-1"}


async def start(aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
                *fakes: FakeUpstream, fmt: str = "json",
                **sections: Any) -> tuple[Client, io.StringIO]:
    servers = [await aiohttp_server(f.app()) for f in fakes]
    providers = [{"name": f"p{i}", "base_url": str(s.make_url("/v1")),
                  "api_key": f"sk-provider-secret-{i}", "max_concurrency": 1}
                 for i, s in enumerate(servers)]
    config = config_from(
        providers,
        {"m": [{"provider": p["name"], "model": "up", "input_cost": 1.0, "output_cost": 2.0}
               for p in providers]},
        access_log={"format": fmt},
        classify={"keys": [{"name": "app", "key": "app-secret-1", "tier": "high"},
                           {"name": "batch", "key": "batch-secret-2", "tier": "low"}]},
        admin={"key": "admin-secret-3"},
        **sections,
    )
    stream = io.StringIO()
    client: Client = await aiohttp_client(build_app(config, counter=counter,
                                                    access_stream=stream))
    return client, stream


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


async def until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_an_answered_call_logs_tokens_cost_and_times(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    client, stream = await start(aiohttp_server, aiohttp_client, counter, FakeUpstream())
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={**KEY,
                                                                         "x-request-id": "r1"})
    assert resp.status == 200
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                             headers={**KEY, "x-request-id": "r2"})
    await resp.read()
    await client.get("/healthz")  # probes are not logged
    whole, streamed = lines(stream)
    assert set(whole) >= FIELDS
    assert whole["request_id"] == "r1" and whole["key"] == "app" and whole["tier"] == "high"
    assert whole["model"] == "m" and whole["upstream"] == "p0/up" and whole["status"] == 200
    assert whole["code"] is None and whole["cache"] is None
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (5, 3)
    assert whole["cost_usd"] == pytest.approx((5 * 1.0 + 3 * 2.0) / 1e6)
    assert whole["queue_ms"] >= 0 and whole["upstream_ms"] > 0 and whole["ttft_ms"] is None
    assert whole["ts"].endswith("Z")
    assert streamed["request_id"] == "r2" and streamed["ttft_ms"] > 0
    assert streamed["completion_tokens"] == 3 and streamed["status"] == 200


async def test_every_refusal_logs_its_code(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    client, stream = await start(aiohttp_server, aiohttp_client, counter,
                                 FakeUpstream(default="cut"))
    await client.post("/v1/chat/completions", json=CHAT)  # no key
    await client.post("/v1/chat/completions", data=b"{", headers=KEY)
    await client.post("/v1/chat/completions", json={**CHAT, "model": "nope\nfake line"},
                      headers=KEY)
    await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                             headers=KEY)).read()
    await client.get("/admin/status")
    got = [(e["status"], e["code"], e["key"]) for e in lines(stream)]
    assert got == [(401, "invalid_api_key", None), (400, "invalid_request", "app"),
                   (404, "model_not_found", "app"), (200, "upstream_error", "app"),
                   (401, "invalid_admin_key", None)]


@pytest.mark.parametrize("where", ["queued", "streaming"])
async def test_a_client_that_leaves_leaves_a_line(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, where: str
) -> None:
    fake = FakeUpstream(default="slow")
    client, stream = await start(aiohttp_server, aiohttp_client, counter, fake)
    url = client.make_url("/v1/chat/completions")
    async with ClientSession() as session:
        first = await session.post(url, json={**CHAT, "stream": True}, headers=KEY)
        assert (await first.content.readany()).startswith(b"data: ")
        if where == "queued":
            queued = asyncio.create_task(session.post(url, json=CHAT, headers=KEY))
            await until(lambda: client.app[SERVICE].scheduler.depth(1) == 1)
            queued.cancel()
            await until(lambda: len(lines(stream)) == 1)
            assert lines(stream)[0]["status"] == 499
            assert lines(stream)[0]["upstream"] is None
        first.close()
    await until(lambda: len(lines(stream)) == (2 if where == "queued" else 1))
    last = lines(stream)[-1]
    assert last["status"] in (200, 499) and last["upstream"] == "p0/up"


async def test_the_text_format_keeps_one_call_on_one_line(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    client, stream = await start(aiohttp_server, aiohttp_client, counter, FakeUpstream(),
                                 fmt="text")
    await client.post("/v1/chat/completions", json={**CHAT, "model": "x\ncode=forged y"},
                      headers=KEY)
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("ts=") and " status=404 code=model_not_found " in line
    assert 'model="x\\ncode=forged y"' in line


async def test_no_secret_is_ever_written(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """A suite-like run at DEBUG: every outcome, then every log line, access line, metric
    and status field is searched for every configured secret."""
    root, captured = logging.getLogger(), io.StringIO()
    handler = logging.StreamHandler(captured)
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        fakes = (FakeUpstream(script=deque(["401", "ok", "500", "cut", "429", "ok"]),
                              retry_after_ms="10"), FakeUpstream())
        client, stream = await start(aiohttp_server, aiohttp_client, counter, *fakes)
        for key in ("app-secret-1", "batch-secret-2", "wrong-secret-9"):
            headers = {"Authorization": f"Bearer {key}"}
            for body in (CHAT, {**CHAT, "stream": True}, {**CHAT, "model": "nope"}):
                await (await client.post("/v1/chat/completions", json=body,
                                         headers=headers)).read()
            await client.post("/v1/embeddings", json={"model": "m", "input": "x"},
                              headers=headers)
            await client.post("/v1/chat/completions", data=b"{bad", headers=headers)
            await client.get("/admin/status", headers={"X-Admin-Key": key})
        status = await (await client.get(
            "/admin/status", headers={"Authorization": "Bearer admin-secret-3"})).text()
        status += await (await client.get(
            "/admin/history", headers={"Authorization": "Bearer admin-secret-3"})).text()
        metrics = await (await client.get("/metrics")).text()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    written = "\n".join([captured.getvalue(), stream.getvalue(), status, metrics])
    assert len(lines(stream)) == 20  # 3 keys x 6 calls, and the status and history reads
    for secret in ("app-secret-1", "batch-secret-2", "wrong-secret-9", "admin-secret-3",
                   "provider-secret"):
        assert secret not in written, secret


def test_a_reader_that_closes_the_pipe_costs_one_warning(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --access-log | head``: the proxy serves on, without a traceback a call."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stream:
        access = AccessLog("json", stream)
        for n in range(3):
            access.emit(f"req-{n}", "POST", "/v1/chat/completions", 200, 0.1, CallRecord(0.0))
    warned = [r for r in caplog.records if "reader closed the pipe" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "Logging error" not in capsys.readouterr().err
