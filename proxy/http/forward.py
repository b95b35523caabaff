"""The proxied call: classify, estimate, route, wait for a slot, forward, relay.

Before the first byte reaches the client a failed attempt may move on to the next
candidate (bounded by ``retry.max_attempts`` and the provider's retry budget); after it,
never: a broken upstream ends the stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from ..core.classify import RequestFacts, classify, upstream_service_tier
from ..core.errors import (
    ModelNotFound,
    ProxyError,
    RateLimited,
    Shed,
    UpstreamError,
    UpstreamUnavailable,
)
from ..core.plan import Plan
from ..core.request import Call, parse_call
from ..core.retry import backoff_s, parse_retry_after
from ..core.route import Deployment, degrade, rank
from ..core.scheduler import Ticket
from .accounting import account_json
from .relay import answer_headers, passthrough_headers, relay
from .service import ProviderRuntime, Service
from .state import SERVICE, TIER
from .upstream import UpstreamRequest, UpstreamResponse

FORWARDED_REQUEST_HEADERS = ("openai-beta", "user-agent", "x-request-id")
MAX_REQUEUES = 20  # re-queued for rate limits at most this often; the tier's deadline still holds


@dataclass
class Failure:
    """An attempt that failed before anything reached the client."""

    error: ProxyError
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None
    deployment: str = ""


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/chat/completions", chat=True)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await forward(request, "/embeddings", chat=False)


async def forward(request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
    service = request.app[SERVICE]
    arrived = service.clock.now()
    principal = service.auth.authenticate(request.headers)
    call = parse_call(await request.read(), chat=chat)
    route = service.config.models.get(call.model)
    if route is None:
        raise ModelNotFound(
            f"The model '{call.model}' does not exist on this proxy.", param="model"
        )
    messages = call.body.get("messages")
    exact_chars = service.config.limits.exact_token_chars
    prompt_tokens = (
        service.counter.count_messages(messages, exact_chars) if chat
        else service.counter.count_input(call.body.get("input"), exact_chars)
    )
    facts = RequestFacts(
        headers=request.headers,
        model=call.model,
        prompt_tokens=prompt_tokens,
        last_user_message=service.counter.last_user_message(messages) if chat else "",
        stream=call.stream,
        service_tier=call.service_tier,
    )
    tier = classify(facts, principal, service.config.classify).tier
    tier_name = service.config.tier_names[tier]
    request[TIER] = tier_name
    output_tokens = (
        service.outputs.expect(principal.name, call.model, call.max_tokens) if chat else 0
    )
    key_limits = service.key_limits.get(principal.name)
    if key_limits is not None:
        wait_s = key_limits.check(prompt_tokens + output_tokens, arrived)
        if wait_s > 0:
            raise RateLimited(
                f"The key '{principal.name}' is over its rate limit.", retry_after=wait_s
            )
    deadline = arrived + service.config.tiers[tier].max_wait_s
    plan = Plan(call, route, tier, tier_name, prompt_tokens, output_tokens, principal.name,
                deadline)
    return await _attempts(service, request, path, plan)


class Skip(enum.Enum):
    """An attempt that did not reach the upstream."""

    BUDGET_SPENT = "budget_spent"  # a retry the provider's retry budget refused
    RATE_LIMITED = "rate_limited"  # the provider's rpm/tpm allows no call now: queue again
    BREAKER_OPEN = "breaker_open"  # the breaker opened while the call waited: route again


async def _attempts(
    service: Service, request: web.Request, path: str, plan: Plan
) -> web.StreamResponse:
    retry = service.config.retry
    last: Failure | None = None
    attempt = requeued = 0
    while attempt < retry.max_attempts and requeued <= MAX_REQUEUES:
        now = service.clock.now()
        usable = rank(plan.route, plan.tier_name, plan.prompt_tokens, plan.output_tokens,
                      service.deployment_stats(plan.route.candidates, now), service.rng)
        fresh = [d for d in usable if d.id not in plan.tried]
        if not fresh and attempt and usable:
            # Only the deployments already tried are left: back off, then try again, if
            # the budget allows a retry and the wait fits before the deadline.
            pause_s = backoff_s(
                attempt, service.rng, base=retry.backoff_base_s, cap=retry.backoff_max_s,
                retry_after_s=last.retry_after_s if last else None,
            )
            budget = service.providers[usable[0].provider].budget
            if now + pause_s >= plan.deadline or budget.available(now) < 1:
                break
            await asyncio.sleep(pause_s)
            fresh = usable
        if not fresh:
            break
        if plan.route.degradation is not None:
            fresh = _degrade(service, plan, fresh)
        outcome = await _one_attempt(service, request, path, plan, fresh)
        if outcome is Skip.RATE_LIMITED or outcome is Skip.BREAKER_OPEN:
            requeued += 1
            continue
        if outcome is Skip.BUDGET_SPENT:
            break
        if not isinstance(outcome, Failure):
            return outcome
        attempt += 1
        last = outcome
    if last is not None:
        return _final_failure(last, plan)
    raise _unavailable(service, plan)


def _degrade(service: Service, plan: Plan, ranked: list[Deployment]) -> list[Deployment]:
    """Apply the model's degradation policy: wait, move to a backup, or shed now."""
    waits = {
        d.id: service.expected_wait_s(d, plan.tier, service.latency.expect_service_s(
            d.id, plan.prompt_tokens, plan.output_tokens))
        for d in ranked
    }
    decision = degrade(plan.route, plan.tier_name, ranked, waits)
    if decision.action == "shed":
        raise Shed(
            f"The '{plan.tier_name}' tier is shed: the expected wait is too long.",
            retry_after=decision.retry_after_s,
        )
    return list(decision.deployments)


def _unavailable(service: Service, plan: Plan) -> UpstreamUnavailable:
    now = service.clock.now()
    retry_at = min(
        (service.breakers[d.id].retry_at(now) for d in plan.route.candidates), default=now + 1
    )
    return UpstreamUnavailable(
        f"Every provider for '{plan.call.model}' is unavailable.",
        retry_after=max(retry_at - now, 1.0) if math.isfinite(retry_at) else 1.0,
    )


async def _one_attempt(
    service: Service,
    request: web.Request,
    path: str,
    plan: Plan,
    ranked: list[Deployment],
) -> web.StreamResponse | Failure | Skip:
    """One attempt through admission.

    Moving on to another provider is a fallback and free; only a second attempt on a
    provider this call already tried spends that provider's retry budget.
    """
    providers = tuple(dict.fromkeys(d.provider for d in ranked))
    estimate = service.latency.expect_service_s(ranked[0].id, plan.prompt_tokens,
                                                plan.output_tokens)
    ticket = Ticket(tier=plan.tier, candidates=providers, est_service_s=estimate,
                    max_wait_s=plan.deadline - service.clock.now())
    async with service.admission.slot(ticket) as provider_name:
        plan.queue_s += ticket.dispatched_at - ticket.arrived
        service.metrics.queue_wait.get(plan.tier_name).observe(
            ticket.dispatched_at - ticket.arrived
        )
        deployment = next(d for d in ranked if d.provider == provider_name)
        provider = service.providers[provider_name]
        started = service.clock.now()
        wait_s = provider.limits.check(plan.prompt_tokens + plan.output_tokens, started)
        if wait_s > 0:
            service.pause(provider_name, wait_s)
            return Skip.RATE_LIMITED
        breaker = service.breakers[deployment.id]
        if not breaker.available(started):
            return Skip.BREAKER_OPEN
        retry = any(key.startswith(provider_name + "/") for key in plan.tried)
        if retry and not provider.budget.try_retry(started):
            return Skip.BUDGET_SPENT
        if not retry:
            provider.budget.on_call(started)
        plan.tried.add(deployment.id)
        breaker.acquire(started)
        result: tuple[web.StreamResponse | Failure, str] | None = None
        try:
            result = await _call(service, request, path, plan, provider, deployment)
            return result[0]
        finally:
            outcome, verdict = result if result is not None else (None, "abandon")
            retry_after = outcome.retry_after_s if isinstance(outcome, Failure) else None
            _record_verdict(service, provider, deployment, verdict, retry_after, started)


def _record_verdict(
    service: Service, provider: ProviderRuntime, deployment: Deployment, verdict: str,
    retry_after_s: float | None, started: float,
) -> None:
    now = service.clock.now()
    breaker = service.breakers[deployment.id]
    service.metrics.attempts.get(deployment.provider, verdict).inc()
    limit = provider.concurrency.limit
    if verdict == "success":
        breaker.on_success(now, started)
        provider.concurrency.on_success(now)
    elif verdict == "failure":
        breaker.on_failure(now, started)
    elif verdict == "throttle":
        breaker.on_throttle(now, retry_after_s, started)
        provider.concurrency.on_throttle(now)
    else:
        breaker.on_abandon(now, started)
    if provider.concurrency.limit != limit:
        service.set_limit(deployment.provider, provider.concurrency.limit)


async def _call(
    service: Service,
    request: web.Request,
    path: str,
    plan: Plan,
    provider: ProviderRuntime,
    deployment: Deployment,
) -> tuple[web.StreamResponse | Failure, str]:
    """One upstream attempt; returns what to answer (or the failure) and the breaker verdict."""
    call = plan.call
    strip_usage = call.stream and path == "/chat/completions" and not call.wants_usage
    upstream_request = UpstreamRequest(
        path=path,
        body=_upstream_body(call, plan.tier, deployment, provider, strip_usage),
        model=deployment.model,
        stream=call.stream,
        headers={h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers},
    )
    started = service.clock.now()
    try:
        response = await provider.upstream.send(upstream_request, provider.config.timeouts)
    except UpstreamError as exc:
        return Failure(exc), "failure"
    _observe_quota(service, provider, deployment, response)
    try:
        if response.status == 429 or response.status >= 500:
            return await _failed_response(response, service.clock.wall(), deployment.id), (
                "throttle" if response.status == 429 else "failure"
            )
        if not call.stream or response.status != 200:
            data = await response.read()
            answer = web.Response(body=data, status=response.status,
                                  headers=answer_headers(request, plan, deployment, response))
            if response.status == 200:
                account_json(service, plan, deployment, data, started)
            return answer, "success"
        chunks = response.chunks()
        first = await anext(chunks, b"")
        if not first:
            return Failure(UpstreamError("upstream stream ended before any data")), "failure"
        ttft = service.clock.now() - started
        return await relay(service, request, plan, deployment, response, chunks, first,
                           strip_usage, started, ttft, expect_done=path == "/chat/completions")
    except UpstreamError as exc:
        return Failure(exc), "failure"
    finally:
        response.close()


def _observe_quota(
    service: Service, provider: ProviderRuntime, deployment: Deployment,
    response: UpstreamResponse,
) -> None:
    """Pause a provider that reports its quota spent, before it starts answering 429."""
    headers = response.headers
    if ("x-ratelimit-remaining-requests" not in headers
            and "x-ratelimit-remaining-tokens" not in headers):
        return
    now = service.clock.now()
    provider.limits.observe_headers(headers, now)
    until = provider.limits.paused_until(now)
    if until > now:
        service.pause(deployment.provider, until - now)


def _upstream_body(
    call: Call, tier: int, deployment: Deployment, provider: ProviderRuntime, add_usage: bool
) -> bytes:
    body = dict(call.body)
    body["model"] = deployment.model
    service_tier = upstream_service_tier(call.service_tier, tier)
    if service_tier is None or not provider.config.accepts_service_tier:
        body.pop("service_tier", None)
    if add_usage:
        body["stream_options"] = {**(call.body.get("stream_options") or {}), "include_usage": True}
    return orjson.dumps(body)


async def _failed_response(
    response: UpstreamResponse, wall_now: float, deployment: str
) -> Failure:
    body = await response.read()
    headers = passthrough_headers(response.headers)
    return Failure(
        UpstreamError(f"upstream answered {response.status}"),
        status=response.status,
        body=body,
        headers=headers,
        retry_after_s=parse_retry_after(response.headers, wall_now),
        deployment=deployment,
    )


def _final_failure(last: Failure, plan: Plan) -> web.StreamResponse:
    if last.status is None:
        raise last.error
    headers = dict(last.headers)
    headers["x-proxy-upstream"] = last.deployment
    headers["x-proxy-tier"] = plan.tier_name
    headers["x-proxy-queue-ms"] = str(round(plan.queue_s * 1000))
    return web.Response(body=last.body, status=last.status, headers=headers)


