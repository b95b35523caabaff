"""The proxied call over HTTP: a thin driver of the pure attempt policy.

The handler parses and plans the call, then carries out what ``proxy.core.call.attempts``
commands: wait in the scheduler, send to a deployment, back off, answer. Every decision
(what to try next after a 429, a 5xx or a 401, when a deadline passes) is the policy's;
this module only does the I/O and reports what happened.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from ...core.call.attempts import (
    Attempts,
    Command,
    Done,
    Fail,
    PassThrough,
    Queue,
    Result,
    Send,
    Wait,
    tier_declined,
)
from ...core.call.budgets import Reservation
from ...core.call.classify import RequestFacts, upstream_service_tier
from ...core.call.plan import Plan
from ...core.call.retry import parse_retry_after
from ...core.call.route import Deployment
from ...core.errors import InvalidRequest, ShuttingDown, UpstreamError
from ...core.formats.endpoints import ENDPOINTS
from ...core.formats.request import Kind
from ...core.health.fleet import ABANDONED, AUTH, DECLINED, FAILURE, SUCCESS, THROTTLED
from ...core.scheduling.scheduler import Rejection
from ...state.base import Lease
from ..base.appkeys import BACKGROUND, COMMITTED, LIFECYCLE, RECORD, REQUEST_ID
from ..base.drain import uncancel
from ..base.edge import Incoming, read_call, upstream_headers
from ..upstream.upstream import UpstreamRequest, UpstreamResponse
from .accounting import record_usage
from .auth import ON_BEHALF
from .budget import arrival, hold, reserve, settle
from .cache import MAX_ENTRY_BYTES, Entry, assemble, fingerprint_of
from .hits import cache_hit, fleet_cache_hit, follow
from .homes import find_home, remember_home
from .relay import answer_headers, relay, usage_counts
from .replicas import end_attempt, grant, make_room, reconcile_key, take_key
from .semantic_cache import Pending
from .service import SERVICE, Service
from .tracing import TRACE

FORWARDED_REQUEST_HEADERS = ("openai-beta", "user-agent")


@dataclass(slots=True)
class Exchange:
    """One call's HTTP side: what the client will get, once there is something."""

    request: Incoming
    plan: Plan
    attempts: Attempts
    answer: web.StreamResponse | None = None
    failure: web.Response | None = None  # the last upstream failure, kept to pass through
    fingerprint: bytes | None = None  # a cacheable call that missed: its answer is kept
    lease: Lease | None = None  # the provider slot held across replicas (redis backend)
    semantic: Pending | None = None  # a semantic cache miss: its answer is kept
    reservation: Reservation | None = None  # the attempt's hold on its key's budget


async def forward(request: Incoming, path: str, kind: Kind) -> web.StreamResponse:
    service = request.app[SERVICE]
    arrived = service.clock.now()
    record = request[RECORD]
    principal = service.auth.authenticate(request.headers)
    record.key = principal.name
    call = await read_call(request, kind, service.config.limits.body, service.counter)
    record.model = call.model
    if call.background:  # stored and answered at once; the proxy's own calls never are
        if ON_BEHALF in request.headers:
            raise InvalidRequest("background: not allowed on a call the proxy makes itself.",
                                 param="background")
        return await request.app[BACKGROUND](request, principal.name, call)
    if call.previous_response_id is not None and service.shared.answers is not None:
        await find_home(service, call)
    facts = RequestFacts(
        headers=request.headers,
        model=call.model,
        prompt_tokens=call.prompt_tokens,
        last_user_message=call.last_user_message,
        stream=call.stream,
        service_tier=call.service_tier,
    )
    plan = service.engine.plan(call, facts, principal, arrived)
    record.tier = plan.tier_name
    exchange = Exchange(request, plan, Attempts(service.engine, plan))
    flight: asyncio.Event | None = None
    if service.cache.applies(call):
        exchange.fingerprint = fingerprint_of(principal.name, call)
        record.cache = "miss"
        hit = cache_hit(service, exchange, plan.tier_name) or await follow(service, exchange)
        if hit is not None:
            return hit
    looked = service.semantic.applies(call, request.headers)
    if looked:  # a hit lands no flight: before it
        found = await service.semantic.look_up(request, plan)
        if isinstance(found, web.Response):
            return found
        if found is not None:  # a miss: its answer is kept whole (in _send)
            exchange.semantic = found
            exchange.fingerprint = exchange.fingerprint or found.fingerprint
    fingerprint = exchange.fingerprint
    if fingerprint is not None and service.cache.applies(call):
        if looked:  # an identical call may have taken off while this one looked by meaning
            hit = await follow(service, exchange)
            if hit is not None:
                return hit
        if service.cache.flight(fingerprint) is None:
            flight = service.cache.take_off(fingerprint)
    lifecycle = request.app[LIFECYCLE]
    key_taken = False
    try:
        if flight is not None and service.cache.across_replicas:  # the fleet's, before the upstream
            hit = await fleet_cache_hit(service, exchange)
            if hit is not None:
                return hit
        if exchange.fingerprint is not None and service.cache.applies(call):
            service.metrics.cache_lookups.get(call.model, "miss").inc()
        arrival(service, plan)
        key_taken = service.shared.across_replicas and await take_key(service, principal, plan)
        with lifecycle.call():
            return await _drive(service, exchange, path)
    except asyncio.CancelledError:
        if lifecycle.expired and not request.get(COMMITTED) and uncancel():
            raise ShuttingDown() from None  # ended by the drain, not by the client: a 503
        raise
    finally:
        if flight is not None and exchange.fingerprint is not None:
            service.cache.land(exchange.fingerprint, flight)
        record.queue_s = exchange.attempts.queue_s
        in_flight = exchange.attempts.deployment
        if in_flight is not None:  # the client left (or an error escaped) mid-attempt
            service.metrics.attempts.get(in_flight.provider, "abandon").inc()
        exchange.attempts.abandon(service.clock.now())
        settle(service, exchange, in_flight, None)  # sent and left: at its estimate
        service.admission.act_on_decisions()
        if exchange.lease is not None:
            service.shared.release(exchange.lease)
        if key_taken:
            usage = exchange.attempts.usage
            reconcile_key(service, principal, plan, exchange.attempts.attempts > 0,
                       usage.total if usage is not None else None)


# Each endpoint's handler (POST): partials, so a queued call holds no extra coroutine frame.
# aiohttp's router and the fast lane (``proxy.http.lane.front``) serve these.
HANDLERS: dict[str, Callable[[Incoming], Awaitable[web.StreamResponse]]] = {
    e.path: functools.partial(forward, path=e.path.removeprefix("/v1"), kind=e.kind)
    for e in ENDPOINTS
}




def _tier(service: Service, exchange: Exchange) -> tuple[int, str]:
    """The call's tier now (index, name): a reload may have moved it since it arrived."""
    ticket = exchange.attempts.ticket
    tier = exchange.plan.tier if ticket is None else ticket.tier
    names = service.engine.tier_names
    return (tier, names[tier]) if tier < len(names) else (
        exchange.plan.tier, exchange.plan.tier_name)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _drive(service: Service, exchange: Exchange, path: str) -> web.StreamResponse:
    attempts = exchange.attempts
    command: Command = attempts.start(service.clock.now())
    trace = exchange.request[TRACE]
    while True:
        service.admission.act_on_decisions()
        match command:
            case Queue(ticket=ticket):
                make_room(service, attempts, ticket)
                decision = service.admission.enter(ticket)
                if decision is None:
                    if trace is not None:
                        trace.queued()
                    decision = await service.admission.decision(ticket)
                now = service.clock.now()
                if trace is not None:
                    trace.dispatched(getattr(decision, "code", "granted"))
                if isinstance(decision, Rejection):
                    command = attempts.refused(decision.code, decision.retry_after_s, now,
                                               decision.message)
                else:
                    tier_name = _tier(service, exchange)[1]
                    exchange.request[RECORD].tier = tier_name
                    waited = ticket.dispatched_at - ticket.queued_at
                    service.metrics.queue_wait.get(tier_name).observe(waited)
                    if ticket.queued_at == ticket.arrived:  # its first pass: as foreseen
                        service.metrics.predicted_wait.get(tier_name).observe(
                            ticket.predicted_s)
                        service.metrics.forecast_error.get(tier_name).observe(
                            abs(ticket.predicted_s - waited))
                    service.metrics.key_wait.get(exchange.plan.caller).observe(waited)
                    # While it waited, an identical call may have filled the cache, or the
                    # key spent its budget: the slot then goes back unused.
                    hit = cache_hit(service, exchange, tier_name)
                    if hit is not None:
                        return hit
                    if exchange.plan.caller in service.budgets.budgets and not await reserve(
                            service, exchange, decision.deployment):
                        command = await hold(service, exchange, ticket)
                        continue
                    if service.shared.across_replicas:
                        command, exchange.lease = await grant(service, attempts,
                                                              decision.deployment)
                    else:
                        command = attempts.granted(decision.deployment, now)
                    if exchange.reservation is not None and not isinstance(command, Send):
                        settle(service, exchange, None, 0.0)  # not sent after all
            case Send(deployment=deployment):
                record = exchange.request[RECORD]
                record.upstream = deployment.id
                sent = service.clock.now()
                result = await _send(service, exchange, path, deployment)
                service.metrics.attempts.get(deployment.provider, result.verdict.value).inc()
                if trace is not None:
                    trace.attempted(result.verdict.value, result.status)
                predicted = attempts.ticket.est_service_s if attempts.ticket else 0.0
                now = service.clock.now()
                command = attempts.finished(result, now)
                end_attempt(service, deployment, attempts.tokens(deployment), attempts.used,
                            exchange.lease, result.verdict)
                exchange.lease = None
                record.upstream_s, record.ttft_s = now - sent, result.ttft_s
                labels = (deployment.provider, deployment.id, exchange.plan.call.model)
                if result.verdict is not ABANDONED:
                    service.metrics.upstream_latency.get(*labels).observe(now - sent)
                if result.ttft_s is not None:
                    service.metrics.ttft.get(*labels).observe(result.ttft_s)
                cost = None  # not known: its estimate if it may have used tokens
                if isinstance(command, Done) and attempts.usage is not None:
                    usage = attempts.usage
                    record.prompt_tokens = usage.prompt_tokens
                    record.completion_tokens = usage.completion_tokens
                    cost = record.cost_usd = record_usage(service, exchange.plan, deployment,
                                                          usage, predicted, now - sent,
                                                          attempts.service_tier)
                settle(service, exchange, deployment if attempts.used is not None else None, cost)
            case Wait(until=until):
                await asyncio.sleep(max(until - service.clock.now(), 0.0))
                command = attempts.resume(service.clock.now())
            case Fail(error=error):
                try:
                    raise error
                finally:  # else this frame holds the error whose traceback holds the frame
                    del error, command
            case PassThrough():
                assert exchange.failure is not None
                exchange.failure.headers["x-proxy-queue-ms"] = str(
                    round(attempts.queue_s * 1000))
                return exchange.failure
            case Done():
                assert exchange.answer is not None
                return exchange.answer


async def _send(service: Service, exchange: Exchange, path: str,
                deployment: Deployment) -> Result:
    """One upstream attempt, relayed to the client if it succeeds."""
    plan, request = exchange.plan, exchange.request
    call = plan.call
    provider = service.engine.providers[deployment.provider]
    # Chat and completions streams report usage only when asked: the proxy asks, and hides
    # the answer from a client that did not. Responses streams always report it.
    strip_usage = call.stream and call.kind in ("chat", "completions") and not call.wants_usage
    body = dict(call.body)
    body["model"] = deployment.model
    tier, tier_name = _tier(service, exchange)
    service_tier = upstream_service_tier(call.service_tier, tier)
    if exchange.attempts.service_tier is not None:  # the deployment's, for this tier
        body["service_tier"] = exchange.attempts.service_tier
    elif service_tier is None or not provider.accepts_service_tier or exchange.attempts.declined:
        body.pop("service_tier", None)
    if strip_usage:
        body["stream_options"] = {**(call.body.get("stream_options") or {}),
                                  "include_usage": True}
    # x-request-id only if the client sent one: some servers refuse one not a UUID.
    forwarded = {"x-client-request-id": request[REQUEST_ID]}
    if request.headers.get("x-request-id") == request[REQUEST_ID]:  # the client's, valid
        forwarded["x-request-id"] = request[REQUEST_ID]
    for name in FORWARDED_REQUEST_HEADERS:
        if name in request.headers:
            forwarded[name] = request.headers[name]
    trace = request[TRACE]
    if trace is not None:
        trace.attempt(deployment, provider.kind, forwarded)
    upstream_request = UpstreamRequest(
        path=path, body=orjson.dumps(body), model=deployment.model, stream=call.stream,
        headers=forwarded,
    )
    started = service.clock.now()
    try:
        response = await service.upstreams[deployment.provider].send(
            upstream_request, provider.timeouts)
    except UpstreamError as exc:
        return Result(FAILURE, error=exc)
    try:
        headers = response.headers
        if "x-ratelimit-remaining-requests" in headers or "x-ratelimit-remaining-tokens" in headers:
            service.engine.fleet.observe_quota(deployment.provider, headers, service.clock.now())
            service.admission.act_on_decisions()
        status = response.status
        if status in (429, 498) or status >= 500 or status in (401, 403):
            return await _upstream_failure(service, exchange, response, deployment)
        headers = answer_headers(request, tier_name, exchange.attempts, deployment, response)
        fingerprint = exchange.fingerprint
        if fingerprint is not None:
            headers["x-proxy-cache"] = "miss"
        if not call.stream or status != 200:
            data = await response.read()
            exchange.answer = web.Response(body=data, status=status, headers=headers)
            prompt, completion, response_id, served_at = _answer_facts(data) if (
                status == 200) else (None, None, None, None)
            remember_home(service, call, response_id, deployment)
            if fingerprint is not None and status == 200:
                entry = Entry(data, deployment.id, _count(prompt), _count(completion))
                service.cache.put(call.model, fingerprint, entry)
                service.semantic.keep(exchange.semantic, entry)
            return Result(SUCCESS, status=status, prompt_tokens=prompt,
                          completion_tokens=completion, service_tier=served_at)
        chunks = response.chunks()
        first = await anext(chunks, b"")
        if not first:
            return Result(FAILURE,
                          error=UpstreamError("upstream stream ended before any data"))
        ttft = service.clock.now() - started
        exchange.answer, result = await relay(service, request, headers, deployment, response,
                                              chunks, first, strip_usage,
                                              keep_bytes=MAX_ENTRY_BYTES if fingerprint else 0)
        remember_home(service, call, result.response_id, deployment)
        whole = (assemble(call.kind, result.kept)
                 if result.kept and result.verdict is SUCCESS else None)
        if fingerprint is not None and whole is not None:
            entry = Entry(whole, deployment.id, _count(result.prompt_tokens),
                          _count(result.completion_tokens))
            service.cache.put(call.model, fingerprint, entry)
            service.semantic.keep(exchange.semantic, entry)
        return Result(result.verdict, status=200, committed=True,
                      prompt_tokens=result.prompt_tokens,
                      completion_tokens=result.completion_tokens, ttft_s=ttft,
                      service_tier=result.service_tier)
    except UpstreamError as exc:
        return Result(FAILURE, error=exc)
    finally:
        response.close()


async def _upstream_failure(service: Service, exchange: Exchange,
                            response: UpstreamResponse, deployment: Deployment) -> Result:
    """A 429, 5xx, 401 or 403. A 5xx is kept, to be passed through if every attempt fails;
    a 429 never reaches the client (the call waits for the pause instead) and an auth
    failure's body may quote the provider's key."""
    body = await response.read()
    status = response.status
    retry_after = parse_retry_after(response.headers, service.clock.wall())
    if status in (401, 403):
        return Result(AUTH, status=status)
    if tier_declined(exchange.attempts.service_tier, status, body):
        return Result(DECLINED, status=status)
    if status == 429:
        return Result(THROTTLED, status=status, retry_after_s=retry_after)
    headers = upstream_headers(response.headers, error=True)
    headers["x-proxy-upstream"] = deployment.id
    headers["x-proxy-tier"] = _tier(service, exchange)[1]
    exchange.failure = web.Response(body=body, status=status, headers=headers)
    return Result(FAILURE, status=status, retry_after_s=retry_after)


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
