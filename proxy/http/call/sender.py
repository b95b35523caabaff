"""One attempt: the call's request to one deployment (its model, service tier, stream
options and ``priority``, in the provider's format, with the client's headers passed on),
and what comes back: an answer relayed to the client and kept for the caches, or a failure
told to the attempt policy (``failures``)."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

from ...config.load import Limits
from ...core.call.attempts import Attempts
from ...core.call.classify import upstream_service_tier
from ...core.call.commands import Result
from ...core.call.route import Deployment
from ...core.clock import Clock
from ...core.engine import Engine
from ...core.errors import UpstreamError
from ...core.formats.endpoints import ANTHROPIC_PREFIX, Endpoint
from ...core.formats.request import Call
from ...core.formats.wires import MESSAGES_PATH, WIRE_OF, translation
from ...core.health.fleet import DECLINED, FAILURE, SUCCESS
from ...core.health.provider import Provider
from ..base.appkeys import REQUEST_ID
from ..base.edge import Incoming, upstream_headers
from ..base.metrics import Metrics
from ..upstream import anthropic
from ..upstream.upstream import Upstream, UpstreamRequest, UpstreamResponse
from . import translate
from .admission import Admission
from .cache import MAX_ENTRY_BYTES, Entry, ResponseCache, assemble
from .exchange import Exchange
from .failures import upstream_failure
from .homes import Homes
from .priority import confirm_refusal, prioritise, refused_priority
from .relay import relay, usage_counts
from .semantic_cache import SemanticCache
from .tally import MessagesTally, StreamTally, Tally
from .tracing import TRACE

# The client's headers an upstream of each wire gets (a provider's anthropic-version is its
# own: configured, never the client's).
FORWARDED_REQUEST_HEADERS = {"openai": ("openai-beta", "user-agent"),
                             "messages": ("anthropic-beta", "user-agent")}


class Sender:
    """Sends each attempt of every proxied call, given the objects it uses."""

    def __init__(self, *, clock: Clock, engine: Engine, admission: Admission,
                 cache: ResponseCache, semantic: SemanticCache, homes: Homes,
                 metrics: Metrics, upstreams: Mapping[str, Upstream]) -> None:
        self._clock = clock
        self._engine = engine
        self._admission = admission
        self._cache = cache
        self._semantic = semantic
        self._homes = homes
        self._metrics = metrics
        self._upstreams = upstreams  # a reload changes the mapping in place

    def reconfigure(self, limits: Limits) -> None:
        """A reload's limits, for the attempts sent from now."""
        self._limits = limits

    def _outgoing(self, exchange: Exchange, endpoint: Endpoint, deployment: Deployment,
                  provider: Provider, direction: str | None) -> UpstreamRequest:
        """The attempt's request: the call's body for ``deployment`` (its model, service
        tier and stream options), in the provider's format, and the headers passed on."""
        plan, request = exchange.plan, exchange.request
        call = plan.call
        body = dict(call.body)
        body["model"] = deployment.model
        wire = WIRE_OF.get(provider.kind, "openai")
        path = endpoint.path.removeprefix("/v1")
        exchange.translation = None  # an earlier attempt's, to another provider
        if direction is not None:
            path, exchange.translation = translate.outgoing(body, direction)
            body = exchange.translation.body
        elif wire == "messages":
            path = MESSAGES_PATH
        if wire == "openai":
            tier = exchange.tier(self._engine.tier_names)[0]
            service_tier = upstream_service_tier(call.service_tier, tier)
            if exchange.attempts.service_tier is not None:  # the deployment's, for this tier
                body["service_tier"] = exchange.attempts.service_tier
            elif (service_tier is None or not provider.accepts_service_tier
                  or exchange.attempts.declined):
                body.pop("service_tier", None)
            # Chat and completions streams report usage only when asked: the proxy asks
            # (and hides the answer from a client that did not). Responses streams always
            # report it; a translated stream's encoder honours the client's own ask.
            if call.stream and (direction is not None or _strips_usage(call)):
                body["stream_options"] = {**(body.get("stream_options") or {}),
                                          "include_usage": True}
        exchange.sent_priority = False
        if provider.priority_order is not None:
            prioritise(self._engine, body, exchange, deployment, provider.priority_order)
        elif "priority" in body:
            del body["priority"]  # only a server that schedules by it gets one, the proxy's
        # x-request-id only if the client sent one: some servers refuse one not a UUID.
        forwarded = {"x-client-request-id": request[REQUEST_ID]}
        if request.headers.get("x-request-id") == request[REQUEST_ID]:  # the client's, valid
            forwarded["x-request-id"] = request[REQUEST_ID]
        for name in FORWARDED_REQUEST_HEADERS[wire]:
            if name in request.headers:
                forwarded[name] = request.headers[name]
        trace = request[TRACE]
        if trace is not None:
            trace.attempt(deployment, provider.kind, forwarded)
        return UpstreamRequest(path=path, body=orjson.dumps(body), model=deployment.model,
                               stream=call.stream, headers=forwarded)

    async def send(self, exchange: Exchange, endpoint: Endpoint,
                   deployment: Deployment) -> Result:
        """One upstream attempt, relayed to the client if it succeeds."""
        plan, request = exchange.plan, exchange.request
        call = plan.call
        provider = self._engine.providers[deployment.provider]
        direction = translation(provider.kind, call.kind)
        upstream_request = self._outgoing(exchange, endpoint, deployment, provider, direction)
        started = self._clock.now()
        try:
            response = await self._upstreams[deployment.provider].send(
                upstream_request, provider.timeouts)
        except UpstreamError as exc:
            return Result(FAILURE, error=exc)
        try:
            self._observe_quota(deployment, response.headers)
            status = response.status
            if status in (429, 498) or status >= 500 or status in (401, 403):
                return await upstream_failure(exchange, response, deployment, direction,
                                              self._clock, self._engine.tier_names)
            headers = answer_headers(request, exchange.tier(self._engine.tier_names)[1],
                                     exchange.attempts, deployment, response)
            if exchange.translation is not None:
                headers.update(translate.translation_headers(exchange.translation))
            fingerprint = exchange.fingerprint
            if fingerprint is not None:
                headers["x-proxy-cache"] = "miss"
            confirm_refusal(self._engine, exchange, deployment, status)
            if not call.stream or status != 200:
                data = await response.read()
                if status == 400 and refused_priority(exchange, status, data):
                    exchange.failure = web.Response(body=data, status=status, headers=headers)
                    return Result(DECLINED, status=status)
                if direction is not None:
                    data = translate.answer(direction, data, status, call.prompt_tokens,
                                            request[REQUEST_ID])
                    headers["content-type"] = "application/json"
                exchange.answer = web.Response(body=data, status=status, headers=headers)
                prompt, completion, response_id, served_at = _answer_facts(data) if (
                    status == 200) else (None, None, None, None)
                self._homes.remember(call, response_id, deployment)
                if fingerprint is not None and status == 200:
                    entry = Entry(data, deployment.id, _count(prompt), _count(completion))
                    self._cache.put(call.model, fingerprint, entry)
                    self._semantic.keep(exchange.semantic, entry)
                return Result(SUCCESS, status=status, prompt_tokens=prompt,
                              completion_tokens=completion, service_tier=served_at)
            chunks = response.chunks()
            first = await anext(chunks, b"")
            if not first:
                return Result(FAILURE,
                              error=UpstreamError("upstream stream ended before any data"))
            ttft = self._clock.now() - started
            keep = MAX_ENTRY_BYTES if fingerprint else 0
            tally: Tally
            if direction is not None:
                tally = translate.Translating(
                    direction, include_usage=call.wants_usage, input_tokens=call.prompt_tokens,
                    request_id=request[REQUEST_ID], keep_bytes=keep)
            elif call.kind == "messages":
                tally = MessagesTally(keep, request[REQUEST_ID])
            else:
                tally = StreamTally(_strips_usage(call), keep)
            exchange.answer, result = await relay(
                self._metrics, self._limits.write_timeout_s, request, headers, deployment,
                response, chunks, first, tally)
            self._homes.remember(call, result.response_id, deployment)
            whole = (assemble(call.kind, result.kept)
                     if result.kept and result.verdict is SUCCESS else None)
            if fingerprint is not None and whole is not None:
                entry = Entry(whole, deployment.id, _count(result.prompt_tokens),
                              _count(result.completion_tokens))
                self._cache.put(call.model, fingerprint, entry)
                self._semantic.keep(exchange.semantic, entry)
            return Result(result.verdict, status=200, committed=True,
                          prompt_tokens=result.prompt_tokens,
                          completion_tokens=result.completion_tokens, ttft_s=ttft,
                          service_tier=result.service_tier)
        except UpstreamError as exc:
            return Result(FAILURE, error=exc)
        finally:
            response.close()

    def _observe_quota(self, deployment: Deployment, headers: Mapping[str, str]) -> None:
        """The provider's rate-limit headers, Anthropic's read as everyone else's."""
        if ("x-ratelimit-remaining-requests" not in headers
                and "x-ratelimit-remaining-tokens" not in headers):
            if (anthropic.PREFIX + "requests-remaining" not in headers
                    and anthropic.PREFIX + "tokens-remaining" not in headers):
                return
            headers = anthropic.quota_headers(headers, self._clock.wall())
        self._engine.fleet.observe_quota(deployment.provider, headers, self._clock.now())
        self._admission.act_on_decisions()


def _strips_usage(call: Call) -> bool:
    """A chat or completions stream the proxy asks for usage the client did not ask for:
    the usage-only chunk is taken out of what the client gets."""
    return call.stream and call.kind in ("chat", "completions") and not call.wants_usage


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _answer_facts(data: bytes) -> tuple[object, object, str | None, object]:
    """(prompt tokens, completion tokens, response id, service tier) an answer reports,
    where it does."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, None, None, None
    if not isinstance(answer, dict):
        return None, None, None, None
    usage = answer.get("usage")
    prompt, completion = usage_counts(usage) if isinstance(usage, dict) else (None, None)
    response_id = answer.get("id") if answer.get("object") == "response" else None
    return (prompt, completion, response_id if isinstance(response_id, str) else None,
            answer.get("service_tier"))


def answer_headers(
    request: Incoming, tier_name: str, attempts: Attempts, deployment: Deployment,
    response: UpstreamResponse,
) -> dict[str, str]:
    """The answer's headers: the upstream's allowed ones and the proxy's own; the queue's
    as foreseen when the call arrived (calls ahead, wait) beside its real wait."""
    headers = upstream_headers(response.headers)
    headers["x-request-id"] = request[REQUEST_ID]
    if request.path.startswith(ANTHROPIC_PREFIX):  # where Anthropic's SDKs look for it
        headers["request-id"] = request[REQUEST_ID]
    headers["x-proxy-tier"] = tier_name
    headers["x-proxy-queue-ms"] = str(round(attempts.queue_s * 1000))
    ticket = attempts.ticket
    if ticket is not None:
        headers["x-proxy-queue-position"] = str(ticket.position)
        headers["x-proxy-queue-predicted-ms"] = str(round(ticket.predicted_s * 1000))
    headers["x-proxy-upstream"] = deployment.id
    return headers
