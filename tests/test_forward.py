"""The request path over real sockets: proxy app ⇄ fake upstream, both on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, TCPConnector, web
from aiohttp.test_utils import TestClient, TestServer

from proxy.config import Config
from proxy.core.call.tokens import TokenCounter
from proxy.http.base.appkeys import LIFECYCLE
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream, completion, sse_events

Factory = Callable[..., Awaitable[Any]]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def provider(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "base_url": url, "api_key": f"sk-{name}", "max_concurrency": 4,
            **extra}


async def start(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
    *fakes: FakeUpstream, config: Config | None = None, **sections: Any,
) -> TestClient[web.Request, web.Application]:
    servers: list[TestServer] = [await aiohttp_server(f.app()) for f in fakes]
    if config is None:
        providers = [provider(f"p{i}", str(s.make_url("/v1"))) for i, s in enumerate(servers)]
        models = {"m": [{"provider": p["name"], "model": f"up-{p['name']}"} for p in providers]}
        config = config_from(providers, models, **sections)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(
        build_app(config, counter=counter)
    )
    return client


async def until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def inflight(client: TestClient[web.Request, web.Application]) -> int:
    service = client.app[SERVICE]
    return sum(service.scheduler.inflight(p) for p in service.config.providers)


async def test_json_relay_rewrites_model_and_swaps_keys(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    body = {**CHAT, "temperature": 0.2, "some_future_field": {"nested": [1, 2]}}
    resp = await client.post("/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer client-secret",
                                      "x-request-id": "abc-123"})
    assert resp.status == 200
    assert await resp.json() == completion("up-p0")
    assert resp.headers["x-request-id"] == "abc-123"
    assert resp.headers["x-proxy-tier"] == "normal"
    assert resp.headers["x-proxy-upstream"] == "p0/up-p0"
    assert int(resp.headers["x-proxy-queue-ms"]) >= 0
    assert "set-cookie" not in resp.headers and "x-upstream-extra" not in resp.headers
    assert "x-hop" not in resp.headers
    seen = fake.seen[0]
    assert seen.body == {**body, "model": "up-p0"}
    assert seen.headers["Authorization"] == "Bearer sk-p0"
    assert "client-secret" not in str(seen.headers)
    assert inflight(client) == 0


async def test_stream_relay_is_what_the_upstream_sent(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream(words=["a", "b", "c", "d"])
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    received = await resp.read()
    # The proxy asked for usage; the client did not, so it must not see the usage chunk.
    assert fake.seen[0].body["stream_options"] == {"include_usage": True}
    assert received == b"".join(sse_events("up-p0", ["a", "b", "c", "d"], usage=False))
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_tokens_total{kind="completion",provider="p0"} 4.0' in metrics


async def test_stream_usage_kept_when_the_client_asked(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    received = await (await client.post("/v1/chat/completions", json=body)).read()
    assert received == b"".join(sse_events("up-p0", fake.words, usage=True))


@pytest.mark.parametrize("fault", ["500", "429", "refused", "stall"])
async def test_failover_before_first_byte(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, fault: str
) -> None:
    bad, good = FakeUpstream(default=fault), FakeUpstream()
    servers = [await aiohttp_server(bad.app()), await aiohttp_server(good.app())]
    first_url = (f"http://127.0.0.1:{closed_port()}/v1" if fault == "refused"
                 else str(servers[0].make_url("/v1")))
    config = config_from(
        [provider("bad", first_url, timeouts={"first_byte_s": 0.3, "response_s": 0.3}),
         provider("good", str(servers[1].make_url("/v1")))],
        {"m": [{"provider": "bad", "model": "x"}, {"provider": "good", "model": "y"}]},
    )
    client = await start(aiohttp_server, aiohttp_client, counter, config=config)
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-proxy-upstream"] == "good/y"
        await resp.read()
    assert good.completed == 2
    await until(lambda: inflight(client) == 0)


async def test_an_oversized_upstream_answer_is_refused_and_the_next_candidate_serves(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    big, good = FakeUpstream(), FakeUpstream()  # its ~300-byte answer is over the 100 allowed
    servers = [await aiohttp_server(big.app()), await aiohttp_server(good.app())]
    config = config_from(
        [provider("big", str(servers[0].make_url("/v1")), max_response_bytes=100),
         provider("good", str(servers[1].make_url("/v1")))],
        {"m": [{"provider": "big", "model": "x"}, {"provider": "good", "model": "y"}]},
    )
    client = await start(aiohttp_server, aiohttp_client, counter, config=config)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200 and resp.headers["x-proxy-upstream"] == "good/y"
    assert len(big.seen) == 1


async def test_upstream_4xx_is_passed_through_without_retry(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    bad, other = FakeUpstream(default="400"), FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, bad, other)
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "fake_400"
    assert other.seen == []


async def test_every_attempt_failing_returns_the_last_upstream_answer(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    a, b = FakeUpstream(default="500"), FakeUpstream(default="500")
    client = await start(aiohttp_server, aiohttp_client, counter, a, b,
                         retry={"max_attempts": 3})
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 500
    assert len(a.seen) + len(b.seen) <= 3
    assert inflight(client) == 0


async def test_mid_stream_cut_ends_with_an_error_event_and_no_done(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    cut, other = FakeUpstream(default="cut"), FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, cut, other)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    text = (await resp.read()).decode()
    assert '"error"' in text and "[DONE]" not in text
    assert '"finish_reason":"stop"' not in text
    assert other.seen == []  # no retry after the first byte
    await until(lambda: inflight(client) == 0)


@pytest.mark.parametrize("mode", ["half", "early_end"])
async def test_a_broken_stream_ends_with_an_error_event_that_parses(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, mode: str
) -> None:
    client = await start(aiohttp_server, aiohttp_client, counter, FakeUpstream(default=mode))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    text = (await (await client.post("/v1/chat/completions", json=body)).read()).decode()
    assert "data: [DONE]" not in text
    last = [e for e in text.split("\n\n") if e.strip()][-1]
    assert last.startswith("data: ")
    assert orjson.loads(last[len("data: "):])["error"]["code"] == "upstream_error"
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_upstream_attempts_total{outcome="failure",provider="p0"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["slow", "stall"])
async def test_client_disconnect_cancels_upstream_and_frees_the_slot(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, mode: str
) -> None:
    fake = FakeUpstream(default=mode)
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    url = client.make_url("/v1/chat/completions")
    async with ClientSession() as session:
        task = asyncio.create_task(session.post(url, json={**CHAT, "stream": True}))
        await until(lambda: fake.active == 1)
        if mode == "slow":
            resp = await task
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()
        else:
            task.cancel()
        await until(lambda: fake.cancelled == 1, timeout=1.0)
    await until(lambda: inflight(client) == 0, timeout=1.0)
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_upstream_attempts_total{outcome="abandon",provider="p0"} 1.0' in metrics


async def test_a_client_that_stops_reading_is_cut_off_by_the_write_timeout(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream(default="flood")
    client = await start(aiohttp_server, aiohttp_client, counter, fake,
                         limits={"write_timeout_s": 0.3})
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    # Read nothing: the proxy's writes block once the socket buffers are full.
    await until(lambda: inflight(client) == 0, timeout=5.0)
    await until(lambda: fake.cancelled == 1, timeout=1.0)
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_stream_errors_total{provider="p0",reason="client_gone"} 1.0' in metrics
    resp.close()


async def test_150_concurrent_calls_really_run_at_once(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream(hold_s=2.0)
    server = await aiohttp_server(fake.app())
    config = config_from([provider("p", str(server.make_url("/v1")), max_concurrency=150)],
                         {"m": [{"provider": "p", "model": "x"}]})
    client = await start(aiohttp_server, aiohttp_client, counter, config=config)
    url = client.make_url("/v1/chat/completions")
    # The test's own client must not be the hidden pool cap either.
    async with ClientSession(connector=TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(session.post(url, json=CHAT) for _ in range(150)))
        assert [r.status for r in results] == [200] * 150
    assert fake.peak == 150


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_request"),
        (b"[]", 400, "invalid_request"),
        (b'{"model": 5, "messages": []}', 400, "invalid_request"),
        (b'{"model": "m"}', 400, "invalid_request"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
         400, "invalid_request"),
        (b'{"model": "m", "messages": [1]}', 400, "invalid_request"),
        (b"[" * 5000 + b"]" * 5000, 400, "invalid_request"),
        (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404,
         "model_not_found"),
        (orjson.dumps({**CHAT, "pad": "x" * (5 * 1024 * 1024)}), 413, "request_too_large"),
    ],
)
async def test_bad_requests_get_openai_shaped_errors(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
    body: bytes, status: int, code: str,
) -> None:
    client = await start(aiohttp_server, aiohttp_client, counter, FakeUpstream())
    resp = await client.post("/v1/chat/completions", data=body,
                             headers={"content-type": "application/json"})
    assert resp.status == status
    error = (await resp.json())["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert resp.headers["x-request-id"]
    assert resp.headers["x-should-retry"] == "false"  # the SDK must not retry these


async def test_proxy_keys_are_required_when_configured(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    server = await aiohttp_server(fake.app())
    config = config_from(
        [provider("p", str(server.make_url("/v1")))], {"m": [{"provider": "p", "model": "x"}]},
        classify={"keys": [{"name": "app", "key": "s3cret", "tier": "high"}]},
    )
    client = await start(aiohttp_server, aiohttp_client, counter, config=config)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
        assert "wrong" not in await resp.text()
    resp = await client.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": "Bearer s3cret"})
    assert resp.status == 200 and resp.headers["x-proxy-tier"] == "high"
    assert "s3cret" not in await (await client.get("/metrics")).text()


async def test_configured_keys_with_every_variable_unset_refuse_everyone(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    server = await aiohttp_server(FakeUpstream().app())
    config = config_from(
        [provider("p", str(server.make_url("/v1")))], {"m": [{"provider": "p", "model": "x"}]},
        classify={"keys": [{"name": "app", "key": "${APP_KEY}"}]},
    )
    assert config.keys == () and config.auth_required
    client = await start(aiohttp_server, aiohttp_client, counter, config=config)
    resp = await client.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": "Bearer anything"})
    assert resp.status == 401


async def test_models_health_and_embeddings(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["m"]
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200
    resp = await client.post("/v1/embeddings", json={"model": "m", "input": "hello"})
    assert resp.status == 200 and (await resp.json())["model"] == "up-p0"
    missing = await client.post("/v1/embeddings", json={"model": "m"})
    assert missing.status == 400 and (await missing.json())["error"]["param"] == "input"
    status = await (await client.get("/admin/status")).json()
    assert set(status) >= {"scheduler", "breakers", "providers"}
    assert "proxy_requests_total" in await (await client.get("/metrics")).text()


async def test_a_drain_deadline_during_the_last_write_adds_nothing_after_the_end(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    """The stream's end is written, and its drain still waits on a client that is not
    reading, when the drain deadline passes: nothing may follow the end (no error event, no
    second terminator); the client can still read the whole stream."""
    big = b"data: " + orjson.dumps({"choices": [{"delta": {"content": "x" * (7 << 20)}}]})
    fake = FakeUpstream(raw_stream=[big + b"\n\ndata: [DONE]\n\n"])
    client = await start(aiohttp_server, aiohttp_client, counter, fake,
                         limits={"write_timeout_s": 30})
    body = orjson.dumps({**CHAT, "stream": True})
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    lifecycle = client.app[LIFECYCLE]
    await until(lambda: lifecycle.in_progress == 1)
    await asyncio.sleep(0.5)  # the end is written; nothing read: the last write waits
    assert lifecycle.in_progress == 1
    await lifecycle.drain(0.1)  # the deadline passes while it waits
    answer = await asyncio.wait_for(reader.read(), 10)  # to the connection's end
    writer.close()
    head, _, chunked = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert chunked.endswith(b"\r\n0\r\n\r\n") and chunked.count(b"\r\n0\r\n\r\n") == 1
    assert b"data: [DONE]\n\n\r\n0\r\n\r\n" in chunked and b"shutting_down" not in chunked
