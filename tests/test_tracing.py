"""OpenTelemetry traces (``telemetry:``): a span per call with children for its queue wait
and each upstream attempt, GenAI attributes, the client's ``traceparent`` continued and each
attempt's sent upstream; spans reach an OTLP/HTTP receiver; off, nothing is imported."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.call.tracing import Tracing
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[TestServer]]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
KEYS = {"keys": [{"name": "team", "key": "sk-team-secret", "tier": "high"}]}


def config(upstream: str, endpoint: str = "http://127.0.0.1:9/", limit: int = 4) -> Any:
    return config_from(
        [{"name": "up", "base_url": upstream, "api_key": "k", "max_concurrency": limit}],
        {"m": [{"provider": "up", "model": "up-model"}]}, classify=KEYS,
        telemetry={"otlp_endpoint": endpoint, "service_name": "proxy-under-test"})


async def start(aiohttp_server: Factory, counter: TokenCounter, upstream: FakeUpstream,
                exporter: InMemorySpanExporter | None = None, endpoint: str | None = None,
                limit: int = 4) -> TestServer:
    up = await aiohttp_server(upstream.app())
    settings = config(str(up.make_url("/v1")), endpoint or "http://127.0.0.1:9/", limit)
    return await aiohttp_server(build_app(settings, counter=counter, span_exporter=exporter))


def sdk(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-team-secret",
                              max_retries=0)


def tracer(server: TestServer) -> Tracing:
    tracing = server.app[SERVICE].tracing
    assert tracing is not None
    return tracing


def spans_of(server: TestServer, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    tracer(server).flush()
    return list(exporter.get_finished_spans())


async def test_a_call_is_a_span_continuing_the_clients_trace_with_its_attempt_upstream(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    exporter, upstream = InMemorySpanExporter(), FakeUpstream()
    server = await start(aiohttp_server, counter, upstream, exporter)
    await sdk(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}],
        extra_headers={"traceparent": TRACEPARENT})
    spans = {span.name: span for span in spans_of(server, exporter)}
    call, attempt = spans["chat m"], spans["chat up-model"]
    assert call.context is not None and attempt.context is not None
    assert f"{call.context.trace_id:032x}" == TRACE_ID  # the client's trace, continued
    assert call.parent is not None and f"{call.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert attempt.parent is not None and attempt.parent.span_id == call.context.span_id
    sent = upstream.seen[0].headers["traceparent"]  # the attempt's own, sent upstream
    assert sent == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"
    attributes = dict(call.attributes or {})
    assert attributes["gen_ai.request.model"] == "m"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["triage.tier"] == "high" and attributes["triage.key"] == "team"
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] > 0
    assert attributes["http.response.status_code"] == 200 and "triage.queue_ms" in attributes
    assert "sk-team-secret" not in repr([dict(s.attributes or {}) for s in spans.values()])
    assert dict(attempt.attributes or {})["gen_ai.system"] == "openai"
    assert dict(attempt.attributes or {})["triage.verdict"] == "success"


async def test_a_queued_call_has_a_queue_span_and_a_failed_attempt_its_own(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    exporter, upstream = InMemorySpanExporter(), FakeUpstream(hold_s=0.2)
    server = await start(aiohttp_server, counter, upstream, exporter, limit=1)
    client = sdk(server)
    first = asyncio.ensure_future(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "first"}]))
    await asyncio.sleep(0.05)
    upstream.script.append("500")
    await client.chat.completions.create(model="m",
                                         messages=[{"role": "user", "content": "second"}])
    await first
    spans = spans_of(server, exporter)
    queues = [s for s in spans if s.name == "queue"]
    assert queues and max((s.end_time or 0) - (s.start_time or 0) for s in queues) > 0.1e9
    verdicts = sorted(str(dict(s.attributes or {}).get("triage.verdict"))
                      for s in spans if s.name == "chat up-model")
    assert verdicts == ["failure", "success", "success"]  # the 500 was tried again


async def test_a_stream_spans_to_its_last_byte_and_a_stranger_path_has_no_span(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    exporter = InMemorySpanExporter()
    upstream = FakeUpstream(chunk_delay_s=0.05, words=["a", "b", "c", "d"])
    server = await start(aiohttp_server, counter, upstream, exporter)
    stream = await sdk(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    async for _ in stream:
        pass
    async with aiohttp.ClientSession() as session, \
            session.get(server.make_url("/healthz")) as health:
        assert health.status == 200
    spans = {span.name: span for span in spans_of(server, exporter)}
    call = spans["chat m"]
    assert (call.end_time or 0) - (call.start_time or 0) > 0.15e9
    assert set(spans) == {"chat m", "chat up-model"}


async def test_spans_reach_an_otlp_http_receiver(aiohttp_server: Factory,
                                                 counter: TokenCounter) -> None:
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(content_type="application/x-protobuf")

    receiver = web.Application()
    receiver.router.add_post("/v1/traces", traces)
    collector = await aiohttp_server(receiver)
    server = await start(aiohttp_server, counter, FakeUpstream(),
                         endpoint=str(collector.make_url("/")))
    await sdk(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    await asyncio.get_running_loop().run_in_executor(None, tracer(server).flush)
    names = {span.name for message in received for resource in message.resource_spans
             for scope in resource.scope_spans for span in scope.spans}
    services = {attr.value.string_value for message in received
                for resource in message.resource_spans
                for attr in resource.resource.attributes if attr.key == "service.name"}
    assert {"chat m", "chat up-model"} <= names and services == {"proxy-under-test"}


def test_without_telemetry_nothing_of_opentelemetry_is_imported() -> None:
    code = ("import sys\n"
            "from proxy.http.server.app import build_app\n"
            "from tests.conftest import config_from\n"
            "app = build_app(config_from([{'name': 'up', 'base_url': 'http://127.0.0.1:9/v1',"
            " 'max_concurrency': 1}], {'m': [{'provider': 'up', 'model': 'x'}]}))\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"
