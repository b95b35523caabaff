"""The Batch API and background responses end to end with the official SDK: files,
batches, polling, output/error files with every custom_id once, malformed lines,
ownership, cancel, expiry on a fake clock, and the store surviving a new process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.state import StateSettings
from proxy.core.call.tokens import TokenCounter
from proxy.core.clock import Clock
from proxy.core.formats.batchfile import read_lines
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app
from proxy.http.work.runner import WORK
from proxy.store.redis_store import RedisStore

from .conftest import config_from
from .fakes import FakeUpstream
from .redis_server import URL, PrivateRedis, prefixed
from .serving import serving

Factory = Callable[..., Awaitable[Any]]
KEYS = {"keys": [{"name": "team", "key": "team-key", "tier": "normal"},
                 {"name": "other", "key": "other-key", "tier": "normal"}]}


class FakeClock(Clock):
    def __init__(self) -> None:
        self.offset = 0.0
        self._real = asyncio.get_running_loop()

    def now(self) -> float:
        return self._real.time() + self.offset

    def wall(self) -> float:
        return 1_800_000_000.0 + self._real.time() + self.offset


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def chat_line(custom_id: str, text: str = "hi") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": text}]}}


class Proxy:
    def __init__(self, server: TestServer, upstream: FakeUpstream) -> None:
        self.server = server
        self.upstream = upstream
        self.url = str(server.make_url("/v1"))

    def sdk(self, key: str = "team-key") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key=key, max_retries=0)

    @property
    def work(self) -> Any:
        return self.server.app[WORK]


async def serve(aiohttp_server: Factory, config: Any, counter: TokenCounter,
                upstream: FakeUpstream | None = None, **app: Any) -> Proxy:
    """A proxy on ``config`` with its work that can wait started."""
    server = await aiohttp_server(build_app(config, counter=counter, **app))
    await server.app[WORK].start(str(server.make_url("")))
    return Proxy(server, upstream or FakeUpstream())


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def start(request: pytest.FixtureRequest, aiohttp_server: Factory, counter: TokenCounter,
                tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    """A proxy whose store is SQLite, or Redis (with the redis state backend)."""
    with prefixed() if request.param == "redis" else contextlib.nullcontext(
            (None, None)) as (_, prefix):
        state = {} if prefix is None else {"state": {"backend": "redis", "url": URL,
                                                     "prefix": prefix}}

        async def make(upstream: FakeUpstream | None = None, clock: Clock | None = None,
                       **batch: Any) -> Proxy:
            upstream = upstream or FakeUpstream()
            server = await aiohttp_server(upstream.app())
            config = config_from(
                [{"name": "up", "base_url": str(server.make_url("/v1")), "api_key": "k",
                  "max_concurrency": 4}],
                {"m": [{"provider": "up", "model": "x"}]},
                classify=KEYS, batch={"max_in_flight": 3, **batch},
                storage={"path": str(tmp_path / "work.db")}, **state)
            return await serve(aiohttp_server, config, counter, upstream, clock=clock)

        yield make


async def submit(client: openai.AsyncOpenAI, data: bytes, window: str = "24h") -> Any:
    """Upload ``data`` and run it as a chat completions batch."""
    uploaded = await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
    return await client.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions",
                                       completion_window=window)  # type: ignore[arg-type]


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 20) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
            await asyncio.sleep(0.05)


def by_custom_id(content: bytes) -> dict[str, dict[str, Any]]:
    rows = [orjson.loads(line) for line in content.split(b"\n") if line.strip()]
    ids = [row["custom_id"] for row in rows if row["custom_id"] is not None]
    assert len(ids) == len(set(ids)), "a custom_id answered twice"
    return {row["custom_id"]: row for row in rows}


async def test_a_batch_through_the_sdk_answers_every_line_once(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(20)]
    uploaded = await client.files.create(file=("batch.jsonl", io.BytesIO(jsonl(lines))),
                                         purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = await client.batches.create(input_file_id=uploaded.id,
                                        endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 20
    done = await finished(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert done.request_counts.completed == 20 and done.request_counts.failed == 0
    assert done.metadata == {"job": "nightly"}
    output = by_custom_id((await client.files.content(done.output_file_id)).content)
    assert set(output) == {f"req-{i}" for i in range(20)}
    row = output["req-7"]
    assert row["response"]["status_code"] == 200
    assert row["response"]["body"]["choices"][0]["message"]["content"] == "Hello there!"
    assert proxy.upstream.peak <= 3  # max_in_flight lines at once
    listed = await client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
    assert (await client.files.delete(uploaded.id)).deleted
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(uploaded.id)


async def test_lines_run_in_the_batch_tier_as_the_owner(start: Any) -> None:
    proxy = await start(tier="low")
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line("a")]))
    await finished(client, batch.id)
    assert proxy.upstream.seen[-1].headers["X-Request-ID"].startswith("batch_req_")
    metrics = proxy.server.app[SERVICE].metrics.render().decode()
    assert 'proxy_requests_total{status="200",tier="low"} 1.0' in metrics
    assert 'key="team",tier="low"' in metrics  # its cost is the owner's


async def test_malformed_lines_go_to_the_error_file_and_the_rest_run(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    data = jsonl([chat_line("good-1"), {"custom_id": "no-body", "method": "POST",
                                        "url": "/v1/chat/completions"},
                  chat_line("good-1"),
                  {**chat_line("wrong-url"), "url": "/v1/embeddings"}]) + b"not json\n"
    batch = await submit(client, data)
    done = await finished(client, batch.id)
    assert done.request_counts.total == 5
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 4)
    errors = (await client.files.content(done.error_file_id)).content.splitlines()
    messages = [orjson.loads(line)["error"]["message"] for line in errors]
    assert any("body" in m for m in messages) and any("earlier line" in m for m in messages)
    assert any("endpoint" in m for m in messages) and any("JSON object" in m for m in messages)
    assert set(by_custom_id((await client.files.content(done.output_file_id)).content)) == {
        "good-1"}


async def test_an_upstream_refusal_is_recorded_in_the_error_file(start: Any) -> None:
    upstream = FakeUpstream(script=collections.deque(["400"]))
    proxy = await start(upstream)
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line("bad"), chat_line("ok")]))
    done = await finished(client, batch.id)
    errors = by_custom_id((await client.files.content(done.error_file_id)).content)
    assert errors["bad"]["response"]["status_code"] == 400
    assert set(by_custom_id((await client.files.content(done.output_file_id)).content)) == {
        "ok"}


async def test_other_keys_cannot_see_files_or_batches(start: Any) -> None:
    proxy = await start()
    team, other = proxy.sdk(), proxy.sdk("other-key")
    batch = await submit(team, jsonl([chat_line("a")]))
    file_id = batch.input_file_id
    for call in (other.files.retrieve(file_id), other.files.content(file_id),
                 other.batches.retrieve(batch.id), other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    with pytest.raises(openai.BadRequestError):
        await other.batches.create(input_file_id=file_id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    assert (await other.batches.list()).data == []
    with pytest.raises(openai.AuthenticationError):
        await proxy.sdk("wrong").files.retrieve(file_id)


async def test_cancel_stops_the_batch_and_reports_the_lines_not_run(start: Any) -> None:
    proxy = await start(FakeUpstream(hold_s=0.3))
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line(f"c{i}") for i in range(30)]))
    await asyncio.sleep(0.5)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await finished(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.completed + counts.failed == 30 and counts.failed > 0
    rows = by_custom_id((await client.files.content(done.error_file_id)).content)
    if done.output_file_id:
        rows.update(by_custom_id((await client.files.content(done.output_file_id)).content))
    assert set(rows) == {f"c{i}" for i in range(30)}  # every line answered, once
    assert any(r["error"] and r["error"]["code"] == "batch_cancelled" for r in rows.values())


async def test_lines_not_run_by_the_end_of_the_window_expire(start: Any) -> None:
    clock = FakeClock()
    proxy = await start(FakeUpstream(hold_s=0.2), clock=clock, max_in_flight=1)
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line(f"e{i}") for i in range(10)]), "1h")
    await asyncio.sleep(0.3)
    clock.offset += 3600  # the window ends
    done = await finished(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    rows = by_custom_id((await client.files.content(done.error_file_id)).content)
    assert any(r["error"]["code"] == "batch_expired" for r in rows.values())
    assert done.request_counts.completed < 10


async def test_bad_batch_requests_are_clear_400s(start: Any) -> None:
    proxy = await start(max_lines=3)
    client = proxy.sdk()
    uploaded = await client.files.create(
        file=("b.jsonl", io.BytesIO(jsonl([chat_line(f"x{i}") for i in range(5)]))),
        purpose="batch")
    for kwargs, words in ((dict(endpoint="/v1/images"), "endpoint"),
                          (dict(completion_window="3d"), "completion_window"),
                          (dict(input_file_id="file-nope"), "no such file"),
                          ({}, "more than 3 lines")):
        args = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as info:
            await client.batches.create(**args)
        assert words in str(info.value)
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("b.jsonl", io.BytesIO(b"x")), purpose="assistants")


async def test_a_file_past_the_size_limit_is_refused(start: Any) -> None:
    proxy = await start(max_file_bytes=1000)
    with pytest.raises(openai.APIStatusError) as info:
        await proxy.sdk().files.create(file=("b.jsonl", io.BytesIO(b"x" * 5000)),
                                       purpose="batch")
    assert info.value.status_code == 413


async def test_background_responses_answer_at_once_then_complete(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    queued = await client.responses.create(model="m", input="hello", background=True)
    assert queued.status in ("queued", "in_progress") and queued.id.startswith("resp_")
    async with asyncio.timeout(10):
        while (got := await client.responses.retrieve(queued.id)).status != "completed":
            await asyncio.sleep(0.05)
    assert got.id == queued.id and got.output_text
    with pytest.raises(openai.NotFoundError):
        await proxy.sdk("other-key").responses.retrieve(queued.id)


class SlowResponses(FakeUpstream):
    """Its Responses API takes 30 s."""

    async def shaped(self, request: web.Request) -> web.StreamResponse:
        self.active += 1
        try:
            await asyncio.sleep(30)
        finally:
            self.active -= 1
            self.cancelled += 1
        return await super().shaped(request)


async def test_a_background_response_can_be_cancelled(start: Any) -> None:
    upstream = SlowResponses()
    proxy = await start(upstream)
    client = proxy.sdk()
    queued = await client.responses.create(model="m", input="slow", background=True)
    await asyncio.sleep(0.2)
    cancelled = await client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(queued.id)).status == "cancelled"
    async with asyncio.timeout(5):  # the call in flight is called off, upstream too
        while upstream.active:
            await asyncio.sleep(0.02)


def test_read_lines_rules() -> None:
    good, bad = read_lines(jsonl([chat_line("a"), {**chat_line("b"), "method": "GET"},
                                  {**chat_line("c"), "body": {"model": "m", "stream": True}}]),
                           "/v1/chat/completions", 10)
    assert [line.custom_id for line in good] == ["a", "c"]
    assert orjson.loads(good[1].body)["stream"] is False
    assert bad[0].message == "method: must be POST"
    with pytest.raises(ValueError, match="no lines"):
        read_lines(b"\n\n", "/v1/chat/completions", 10)
    good, bad = read_lines(b"\xff\n" + orjson.dumps(chat_line("d", "a\u2028b")) + b"\n",
                           "/v1/chat/completions", 10)
    assert [line.custom_id for line in good] == ["d"]  # U+2028 is not a line break
    assert bad[0].message == "not a JSON object (or not UTF-8)"


def test_a_custom_id_is_answered_once_whatever_its_lines() -> None:
    first_bad = {**chat_line("dup"), "method": "GET"}
    good, bad = read_lines(jsonl([first_bad, chat_line("dup"), chat_line("dup")]),
                           "/v1/chat/completions", 10)
    assert good == [] and [b.custom_id for b in bad] == ["dup", None, None]
    good, bad = read_lines(jsonl([{**chat_line("bg"), "body": {"model": "m",
                                                              "background": True}}]),
                           "/v1/chat/completions", 10)
    assert bad[0].message.startswith("body.background")


async def test_a_batch_survives_sigkill_and_every_line_is_answered_once(
        aiohttp_server: Factory, tmp_path: Path) -> None:
    upstream = FakeUpstream(hold_s=0.03)
    server = await aiohttp_server(upstream.app())
    config = tmp_path / "routing.yaml"
    config.write_text(f"""
providers:
  - {{name: up, base_url: "{server.make_url('/v1')}", api_key: k, max_concurrency: 4}}
models:
  m: [{{provider: up, model: x}}]
batch: {{max_in_flight: 4}}
storage: {{path: work.db}}
""")
    lines = [chat_line(f"k{i}") for i in range(200)]
    async with serving(config) as (base, process):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        uploaded = await client.files.create(file=("b.jsonl", io.BytesIO(jsonl(lines))),
                                             purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        async with asyncio.timeout(20):
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 40:
                await asyncio.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    assert (tmp_path / "work.db").exists()  # next to the config, not in the working dir
    async with serving(config) as (base, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        done = await finished(client, batch.id, timeout=30)
        assert done.status == "completed" and done.request_counts.completed == 200
        output = by_custom_id((await client.files.content(done.output_file_id)).content)
        assert set(output) == {f"k{i}" for i in range(200)}
    assert len(upstream.seen) >= 200  # lines in flight at the kill were sent again


async def test_status_and_metrics_show_the_store_and_what_runs(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line("s1"), chat_line("s2")]))
    await finished(client, batch.id)
    status = await _get(proxy, "/admin/status")
    work = status["work"]
    assert work["bytes"] > 0 and work["batches"] == {"completed": 1}
    assert work["lines"] == {} and work["running"] == []  # lines: of batches in progress
    metrics = proxy.server.app[SERVICE].metrics.render().decode()
    assert 'proxy_batch_lines_total{outcome="done"} 2.0' in metrics
    assert "proxy_storage_bytes " in metrics


async def _get(proxy: Proxy, path: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(
            str(proxy.server.make_url(path))) as response:
        return await response.json()


async def test_past_storage_max_bytes_uploads_are_refused(start: Any) -> None:
    proxy = await start()
    proxy.work.config = dataclasses.replace(proxy.work.config, storage=dataclasses.replace(
        proxy.work.config.storage, max_bytes=1024 * 1024))
    client = proxy.sdk()
    big = jsonl([chat_line(f"b{i}", "x" * 1000) for i in range(1100)])
    with pytest.raises(openai.APIStatusError) as info:
        await client.files.create(file=("b.jsonl", io.BytesIO(big)), purpose="batch")
    assert info.value.status_code == 507 and "storage" in str(info.value)


async def test_finished_work_is_forgotten_after_the_retention(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line("r")]))
    done = await finished(client, batch.id)
    store = proxy.work.store()
    uploaded = await client.files.retrieve(batch.input_file_id)  # the second may tick after it
    first = min(uploaded.created_at, done.created_at)
    assert await store.forget_before(first) == 0  # nothing older yet
    assert await store.forget_before(done.created_at + 10) >= 3  # batch, lines, in, out
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(done.output_file_id)


async def test_the_dashboards_feed_lists_the_batches_running(start: Any) -> None:
    proxy = await start(FakeUpstream(hold_s=0.2), max_in_flight=1)
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line(f"d{i}") for i in range(10)]))
    history = await _get(proxy, "/admin/history")
    [shown] = history["batches"]
    assert (shown["id"], shown["owner"], shown["status"], shown["total"]) == (
        batch.id, "team", "in_progress", 10)
    await client.batches.cancel(batch.id)
    await finished(client, batch.id)
    assert (await _get(proxy, "/admin/history"))["batches"] == []


async def test_a_line_turned_away_until_the_window_ends_is_answered_expired(
        start: Any) -> None:
    clock = FakeClock()
    proxy = await start(FakeUpstream(default="500"), clock=clock)
    client = proxy.sdk()
    batch = await submit(client, jsonl([chat_line("z")]), "1m")
    clock.offset += 59.5  # the line's next try would come after the window
    done = await finished(client, batch.id)
    rows = by_custom_id((await client.files.content(done.error_file_id)).content)
    assert set(rows) == {"z"} and rows["z"]["error"]["code"] == "batch_expired"
    assert done.request_counts.failed == 1


async def test_deleting_files_makes_room_again(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    data = jsonl([chat_line(f"f{i}", "x" * 1000) for i in range(500)])
    uploaded = await client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
    full = await proxy.work.size_bytes()
    await client.files.delete(uploaded.id)
    assert await proxy.work.size_bytes() < full - len(data) // 2
    assert [f.id for f in (await client.files.list()).data] == []


async def test_two_workers_on_one_store_run_each_batch_once(
        aiohttp_server: Factory, counter: TokenCounter, tmp_path: Path) -> None:
    upstream = FakeUpstream(hold_s=0.1)
    up = await aiohttp_server(upstream.app())
    config = config_from(
        [{"name": "up", "base_url": str(up.make_url("/v1")), "api_key": "k",
          "max_concurrency": 4}], {"m": [{"provider": "up", "model": "x"}]},
        classify=KEYS, batch={"max_in_flight": 2}, storage={"path": str(tmp_path / "w.db")})
    workers = [await serve(aiohttp_server, config, counter, internal_token="t")
               for _ in range(2)]
    a, b = (w.sdk() for w in workers)
    uploaded = await a.files.create(
        file=("b.jsonl", io.BytesIO(jsonl([chat_line(f"w{i}") for i in range(40)]))),
        purpose="batch")
    batch = await b.batches.create(input_file_id=uploaded.id,  # the file is seen by both
                                   endpoint="/v1/chat/completions", completion_window="24h")
    await asyncio.sleep(1.5)
    assert sorted(w.work.leading for w in workers) == [False, True]
    cancelling = await b.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    done = await finished(a, batch.id)
    assert done.status == "cancelled" and done.cancelling_at is not None
    rows = by_custom_id((await a.files.content(done.error_file_id)).content)
    if done.output_file_id:
        rows.update(by_custom_id((await a.files.content(done.output_file_id)).content))
    assert set(rows) == {f"w{i}" for i in range(40)}
    assert len(upstream.seen) < 40  # cancelled before every line ran; none ran twice


@pytest.mark.redis
async def test_with_redis_any_replica_serves_a_batch_and_takes_over_a_dead_ones_lines(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    upstream = FakeUpstream(hold_s=0.05)
    up = await aiohttp_server(upstream.app())
    with prefixed() as (_, prefix):
        config = config_from(
            [{"name": "up", "base_url": str(up.make_url("/v1")), "api_key": "k",
              "max_concurrency": 4}], {"m": [{"provider": "up", "model": "x"}]},
            classify=KEYS, batch={"max_in_flight": 2},
            state={"backend": "redis", "url": URL, "prefix": prefix})
        # Two machines: no shared token, no shared file.
        replicas = [await serve(aiohttp_server, config, counter) for _ in range(2)]
        a, b = (r.sdk() for r in replicas)
        uploaded = await a.files.create(
            file=("b.jsonl", io.BytesIO(jsonl([chat_line(f"r{i}") for i in range(60)]))),
            purpose="batch")
        batch = await b.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions", completion_window="24h")
        leader = next(r for r in replicas if r.work.leading)
        other = next(r for r in replicas if r is not leader)
        async with asyncio.timeout(10):
            while (await a.batches.retrieve(batch.id)).request_counts.completed < 10:
                await asyncio.sleep(0.02)
        await leader.work.close()  # it dies mid-batch, lines running
        survivor = other.sdk()
        done = await finished(survivor, batch.id, timeout=30)
        assert other.work.leading and done.status == "completed"
        output = by_custom_id((await survivor.files.content(done.output_file_id)).content)
        assert set(output) == {f"r{i}" for i in range(60)}


@pytest.mark.redis
async def test_a_store_that_cannot_be_reached_is_a_503_and_nothing_crashes(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    server = PrivateRedis()
    server.start()
    try:
        config = config_from(
            [{"name": "up", "base_url": "http://127.0.0.1:9/v1", "max_concurrency": 1}],
            {"m": [{"provider": "up", "model": "x"}]}, classify=KEYS,
            state={"backend": "redis", "url": server.url})
        proxy = await serve(aiohttp_server, config, counter)
        client = proxy.sdk()
        uploaded = await client.files.create(
            file=("b.jsonl", io.BytesIO(jsonl([chat_line("a")]))), purpose="batch")
        server.stop()
        with pytest.raises(openai.InternalServerError) as info:
            await client.files.retrieve(uploaded.id)
        assert info.value.status_code == 503 and "store" in str(info.value)
        await asyncio.sleep(1.5)  # the runner's lease loop meets the same trouble, and lives
        status = await _get(proxy, "/admin/status")
        assert "error" in status["work"]
        server.start()
        with pytest.raises(openai.NotFoundError):  # this Redis kept nothing: gone, not 5xx
            await client.files.retrieve(uploaded.id)
    finally:
        server.stop()


async def test_urgent_calls_keep_their_waits_while_thousands_of_lines_run(
        aiohttp_server: Factory, counter: TokenCounter, tmp_path: Path) -> None:
    config = config_from(
        [{"name": "sim", "kind": "simulated", "max_concurrency": 4,
          "simulate": {"ttft_s": 0.3, "tokens_per_s": 2000}}],
        {"m": [{"provider": "sim", "model": "s"}]},
        tiers=[{"name": "high", "weight": 8, "reserve": 2}, {"name": "low"}],
        classify={"default_tier": "high"}, batch={"tier": "low", "max_in_flight": 64},
        storage={"path": str(tmp_path / "w.db")})
    client = (await serve(aiohttp_server, config, counter)).sdk("x")
    batch = await submit(client, jsonl([chat_line(f"t{i}") for i in range(3000)]))
    async with asyncio.timeout(10):  # the batch has the slots it may have
        while (await client.batches.retrieve(batch.id)).request_counts.completed < 4:
            await asyncio.sleep(0.02)
    waits = []
    for i in range(15):  # urgent calls, one at a time, while the batch runs
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"u{i}"}],
            extra_headers={"X-Priority": "high"})
        waits.append(int(raw.headers["x-proxy-queue-ms"]))
        await asyncio.sleep(0.02)
    running = await client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts.completed > 4
    assert max(waits) <= 50, waits  # the reserve kept a slot free for each of them
    await client.batches.cancel(batch.id)
    await finished(client, batch.id)


async def test_a_background_chat_completion_is_answered_by_id(start: Any) -> None:
    proxy = await start()
    client = proxy.sdk()
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "later"}],
        extra_body={"background": True})
    queued_id = raw.headers["x-proxy-background-id"]
    assert queued_id.startswith("chatcmpl-bg-") and orjson.loads(raw.content)["status"] in (
        "queued", "in_progress")
    async with asyncio.timeout(10):
        while (got := await client.chat.completions.retrieve(queued_id)).choices == []:
            await asyncio.sleep(0.05)
    assert got.id == queued_id and got.choices[0].message.content == "Hello there!"
    with pytest.raises(openai.NotFoundError):
        await proxy.sdk("other-key").chat.completions.retrieve(queued_id)
    with pytest.raises(openai.BadRequestError):  # checked as a chat call before it is stored
        await client.chat.completions.create(model="m", messages="nope",  # type: ignore[arg-type]
                                             extra_body={"background": True})


@pytest.mark.redis
def test_a_runner_that_lost_its_lease_can_neither_answer_nor_end_lines() -> None:
    with prefixed() as (client, prefix):
        settings = StateSettings(backend="redis", url=URL, prefix=prefix)
        a, b = RedisStore(settings), RedisStore(settings)
        doc = orjson.dumps({"status": "in_progress", "finalizing_at": None,
                            "request_counts": {"total": 2}}).decode()
        a.add_batch("b1", "team", 1, "in_progress", doc,
                    [(0, "x", b"{}", "pending", None), (1, "y", b"{}", "pending", None)])
        assert a.hold_runner("A", 0, 5.0) and not b.hold_runner("B", 0, 5.0)
        taken = a.take_lines("b1", 2)
        assert [t[0] for t in taken] == [0, 1]
        client.delete(f"{prefix}:work:runner")  # A stalled past its lease: B takes over
        assert b.hold_runner("B", 0, 5.0) and b.recover("b1") == 2
        assert not a.finish_line("b1", 0, "done", b"late") and a.take_lines("b1", 2) == []
        assert not a.finalize("b1", "completed", 2, lambda: "file-x", lambda c, s: b"e")
        assert [t[0] for t in b.take_lines("b1", 2)] == [0, 1]
        assert b.finish_line("b1", 0, "done", b"ok")
        assert b.finalize("b1", "cancelled", 2, lambda: "file-y", lambda c, s: b"e")
        assert b.counts("b1") == {"done": 1, "cancelled": 1}  # no drift
        a.close()
        b.close()
