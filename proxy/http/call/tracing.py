"""OpenTelemetry traces of the calls, when ``telemetry.otlp_endpoint`` is set (the ``otel``
extra; spans go out over OTLP/HTTP from a background thread, in batches).

A call is one span (kind SERVER) from its arrival to its last byte; a child span covers each
wait in the queue, and one (kind CLIENT) each upstream attempt, with the GenAI semantic
conventions' attributes (``gen_ai.system``, ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` …) beside the proxy's own (tier, the
key's name — never the key —, queue ms, cache outcome). An incoming ``traceparent`` is
continued, and each attempt sends its own upstream. Unset, nothing of OpenTelemetry is
imported and a call costs an attribute read and a few ``is None`` checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ...config.telemetry import TelemetrySettings
from ...core.call.route import Deployment
from ...core.formats.endpoints import BY_PATH
from ..base.access import CallRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span



class CallTrace:
    """One call's spans; every one still open is ended with the call."""

    __slots__ = ("_attempt", "_queue", "_tracing", "operation", "span")

    def __init__(self, tracing: Tracing, span: Span, operation: str) -> None:
        self._tracing = tracing
        self.span = span
        self.operation = operation  # GenAI's name of what the endpoint does
        self._queue: Span | None = None
        self._attempt: Span | None = None

    def queued(self) -> None:
        """The call starts to wait for a slot."""
        if self._queue is None:
            self._queue = self._tracing.child("queue", self.span)

    def dispatched(self, outcome: str) -> None:
        """Its wait ended: ``granted``, or the code it was refused with."""
        if self._queue is not None:
            self._queue.set_attribute("triage.queue.outcome", outcome)
            self._queue.end()
            self._queue = None

    def attempt(self, deployment: Deployment, provider_kind: str,
                headers: dict[str, str]) -> None:
        """An upstream attempt starts; its ``traceparent`` goes into ``headers``."""
        self.attempted("abandoned")
        span = self._tracing.child(f"{self.operation} {deployment.model}", self.span,
                                   client=True)
        span.set_attributes({
            "gen_ai.system": provider_kind, "gen_ai.provider.name": provider_kind,
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": deployment.model, "triage.deployment": deployment.id})
        self._tracing.inject(span, headers)
        self._attempt = span

    def attempted(self, verdict: str, status: int | None = None) -> None:
        """The attempt ended: its verdict (success, failure, throttled …) and status."""
        span, self._attempt = self._attempt, None
        if span is None:
            return
        span.set_attribute("triage.verdict", verdict)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if verdict != "success":
            span.set_attribute("error.type", str(status or verdict))
        span.end()

    def end(self, status: int, record: CallRecord) -> None:
        self.dispatched("abandoned")
        self.attempted("abandoned")
        span = self.span
        if record.model is not None:
            span.update_name(f"{self.operation} {record.model}")
        found: dict[str, Any] = {
            "http.response.status_code": status, "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": record.model, "triage.tier": record.tier,
            "triage.key": record.key, "triage.upstream": record.upstream,
            "triage.cache": record.cache, "error.type": record.code,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "triage.cost_usd": record.cost_usd,
            "triage.queue_ms": None if record.queue_s is None else round(
                record.queue_s * 1000, 3)}
        span.set_attributes({name: value for name, value in found.items() if value is not None})
        if status >= 500 or status == 499:
            self._tracing.failed(span, record.code or str(status))
        span.end()


class Tracing:
    """The tracer of one process: its spans, sampled and exported as ``settings`` say
    (``exporter``: where they go instead of OTLP/HTTP, for tests)."""

    def __init__(self, settings: TelemetrySettings,
                 exporter: SpanExporter | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample)))
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter or OTLPSpanExporter(endpoint=settings.traces_url, timeout=10)))
        self._tracer = self._provider.get_tracer("triage-proxy")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = SpanKind
        self._in_context = set_span_in_context
        self._error = (Status, StatusCode.ERROR)

    def begin(self, path: str, headers: Mapping[str, str]) -> CallTrace | None:
        """A proxied call's trace, continuing the client's ``traceparent`` (None: not a
        proxied path)."""
        endpoint = BY_PATH.get(path)
        if endpoint is None:
            return None
        parent = self._propagator.extract({k.lower(): v for k, v in headers.items()
                                           if k.lower() in ("traceparent", "tracestate")})
        span = self._tracer.start_span(endpoint.operation, context=parent,
                                       kind=self._kinds.SERVER,
                                       attributes={"url.path": path})
        return CallTrace(self, span, endpoint.operation)

    def child(self, name: str, parent: Span, client: bool = False) -> Span:
        return self._tracer.start_span(
            name, context=self._in_context(parent),
            kind=self._kinds.CLIENT if client else self._kinds.INTERNAL)

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        self._propagator.inject(headers, context=self._in_context(span))

    def failed(self, span: Span, description: str) -> None:
        status, error = self._error
        span.set_status(status(error, description))

    def flush(self) -> None:
        self._provider.force_flush()

    def close(self) -> None:
        self._provider.shutdown()


# A proxied call's trace: set on every one (None when tracing is off), so reading it costs
# no failed lookup.
TRACE: web.RequestKey[CallTrace | None] = web.RequestKey("trace")
