"""The proxied call over HTTP: a thin driver of the pure attempt policy.

The handler parses and plans the call, then carries out what ``proxy.core.call.attempts``
commands: wait in the scheduler, send to a deployment, back off, answer. Every decision
(what to try next after a 429, a 5xx or a 401, when a deadline passes) is the policy's;
this module only does the I/O and reports what happened. The ``Forwarder`` is given the
objects it uses when the app starts (``Service`` builds it); each endpoint's handler reaches
it through ``FORWARDER``. What a call holds (its key's rate-limit share, a cache flight,
a budget reservation, a lease across replicas) is given back from one stack, in reverse,
whatever way the call ends.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from ...config.load import Limits
from ...core.call.attempts import Attempts
from ...core.call.classify import Principal, RequestFacts
from ...core.call.commands import (
    Command,
    Done,
    Fail,
    Hold,
    LeaseSlot,
    PassThrough,
    Queue,
    Reserve,
    Send,
    Wait,
)
from ...core.call.route import Deployment
from ...core.call.tokens import TokenCounter
from ...core.clock import Clock
from ...core.engine import Engine
from ...core.errors import InvalidRequest, ModelNotFound, ShuttingDown
from ...core.formats.endpoints import COUNT_TOKENS_PATH, ENDPOINTS, Endpoint
from ...core.formats.request import count_message_tokens
from ...core.health.fleet import ABANDONED
from ...core.scheduling.scheduler import Rejection
from ..base.appkeys import BACKGROUND, COMMITTED, LIFECYCLE, RECORD, REQUEST_ID
from ..base.drain import uncancel
from ..base.edge import OFFLOAD_BYTES, Incoming, read_body, read_call
from ..base.metrics import Metrics
from ..upstream.upstream import Upstream
from .accounting import record_usage
from .admission import Admission
from .auth import ON_BEHALF, Authenticator
from .budget import BudgetGate
from .cache import ResponseCache, fingerprint_of
from .exchange import Exchange
from .hits import CacheHits
from .homes import Homes
from .replicas import Replicas
from .semantic_cache import SemanticCache
from .sender import Sender
from .tracing import TRACE


class Forwarder:
    """Every proxied call's driver, given the objects it uses."""

    def __init__(self, *, clock: Clock, counter: TokenCounter, auth: Authenticator,
                 limits: Limits, engine: Engine, admission: Admission, cache: ResponseCache,
                 semantic: SemanticCache, budgets: BudgetGate, replicas: Replicas,
                 homes: Homes, metrics: Metrics, upstreams: Mapping[str, Upstream]) -> None:
        self._clock = clock
        self._counter = counter
        self._engine = engine
        self._admission = admission
        self._cache = cache
        self._semantic = semantic
        self._budgets = budgets
        self._replicas = replicas
        self._homes = homes
        self._metrics = metrics
        self._hits = CacheHits(cache, metrics, clock)
        self._sender = Sender(clock=clock, engine=engine, admission=admission, cache=cache,
                              semantic=semantic, homes=homes, metrics=metrics,
                              upstreams=upstreams)
        # Told the provider of every answered attempt (a self-hosted server is read again).
        self.answered: Callable[[str], None] = _nothing
        self.reconfigure(auth, limits)

    def reconfigure(self, auth: Authenticator, limits: Limits) -> None:
        """A reload's keys and limits, for the calls that arrive from now."""
        self._auth = auth
        self._limits = limits
        self._sender.reconfigure(limits)

    async def forward(self, request: Incoming, endpoint: Endpoint) -> web.StreamResponse:
        clock = self._clock
        arrived = clock.now()
        record = request[RECORD]
        principal = self._auth.authenticate(request.headers)
        record.key = principal.name
        call = await read_call(request, endpoint.kind, self._limits.body, self._counter)
        record.model = call.model
        if call.background:  # stored and answered at once; the proxy's own calls never are
            if ON_BEHALF in request.headers:
                raise InvalidRequest("background: not allowed on a call the proxy makes "
                                     "itself.", param="background")
            return await request.app[BACKGROUND](request, principal.name, call)
        if call.previous_response_id is not None:
            await self._homes.find(call)
        facts = RequestFacts(
            headers=request.headers,
            model=call.model,
            prompt_tokens=call.prompt_tokens,
            last_user_message=call.last_user_message,
            stream=call.stream,
            service_tier=call.service_tier,
        )
        plan = self._engine.plan(call, facts, principal, arrived)
        record.tier = plan.tier_name
        exchange = Exchange(request, plan, Attempts(self._engine, plan))
        cache = self._cache
        cacheable = cache.applies(call)
        if cacheable:
            exchange.fingerprint = fingerprint_of(principal.name, call)
            record.cache = "miss"
            hit = (self._hits.hit(request, plan, exchange.fingerprint, plan.tier_name, 0.0)
                   or await self._hits.follow(request, plan, exchange.fingerprint))
            if hit is not None:
                return hit
        looked = self._semantic.applies(call, request.headers)
        if looked:  # a hit lands no flight: before it
            found = await self._semantic.look_up(request, plan)
            if isinstance(found, web.Response):
                return found
            if found is not None:  # a miss: its answer is kept whole (in _send)
                exchange.semantic = found
                exchange.fingerprint = exchange.fingerprint or found.fingerprint
        held: list[Callable[[], object]] = []  # what the call holds: given back in reverse
        try:
            fingerprint = exchange.fingerprint
            if fingerprint is not None and cacheable:
                if looked:  # an identical call may have taken off while this one looked
                    hit = await self._hits.follow(request, plan, fingerprint)
                    if hit is not None:
                        return hit
                if cache.flight(fingerprint) is None:
                    held.append(functools.partial(cache.land, fingerprint,
                                                  cache.take_off(fingerprint)))
                    if cache.across_replicas:  # the fleet's, before the upstream
                        hit = await self._hits.fleet_hit(request, plan, fingerprint)
                        if hit is not None:
                            return hit
                self._metrics.cache_lookups.get(call.model, "miss").inc()
            self._budgets.arrival(plan)
            held.append(functools.partial(self._ended, exchange))
            if self._replicas.across_replicas and await self._replicas.take_key(principal,
                                                                                 plan):
                held.append(functools.partial(self._reconcile_key, exchange, principal))
            lifecycle = request.app[LIFECYCLE]
            with lifecycle.call():
                return await self._drive(exchange, endpoint)
        except asyncio.CancelledError:
            if request.app[LIFECYCLE].expired and not request.get(COMMITTED) and uncancel():
                raise ShuttingDown() from None  # ended by the drain, not by the client
            raise
        finally:
            while held:
                held.pop()()

    async def count_tokens(self, request: Incoming) -> web.StreamResponse:
        """``POST /v1/messages/count_tokens``: the prompt's tokens as the proxy counts them
        (estimated where the text is long), for a model of the routing table. Answered
        here: never queued nor sent upstream."""
        record = request[RECORD]
        record.key = self._auth.authenticate(request.headers).name
        raw = await read_body(request)
        count = functools.partial(count_message_tokens, raw, self._limits.body, self._counter)
        model, tokens = count() if len(raw) <= OFFLOAD_BYTES else await asyncio.to_thread(
            count)
        record.model = model
        if model not in self._engine.models:
            raise ModelNotFound(f"The model '{model}' does not exist on this proxy.",
                                param="model")
        return web.json_response({"input_tokens": tokens},
                                 headers={"request-id": request[REQUEST_ID]})

    def _ended(self, exchange: Exchange) -> None:
        """The call is over, however it ended: what its attempt in flight held goes back."""
        attempts = exchange.attempts
        exchange.request[RECORD].queue_s = attempts.queue_s
        in_flight = attempts.deployment
        if in_flight is not None:  # the client left (or an error escaped) mid-attempt
            self._metrics.attempts.get(in_flight.provider, "abandon").inc()
        attempts.abandon(self._clock.now())
        self._settle(exchange, in_flight, None)  # sent and left: at its estimate
        self._admission.act_on_decisions()
        if exchange.lease is not None:
            self._replicas.shared.release(exchange.lease)
            exchange.lease = None

    def _reconcile_key(self, exchange: Exchange, principal: Principal) -> None:
        usage = exchange.attempts.usage
        self._replicas.reconcile_key(principal, exchange.plan, exchange.attempts.attempts > 0,
                                     usage.total if usage is not None else None)

    def _settle(self, exchange: Exchange, deployment: Deployment | None,
                cost: float | None) -> None:
        attempts = exchange.attempts
        reservation, attempts.reservation = attempts.reservation, None
        if reservation is not None or exchange.plan.caller in self._budgets.book.budgets:
            self._budgets.settle(attempts, reservation, deployment, cost)

    async def _drive(self, exchange: Exchange, endpoint: Endpoint) -> web.StreamResponse:
        attempts, clock, admission = exchange.attempts, self._clock, self._admission
        metrics, request = self._metrics, exchange.request
        command: Command = attempts.start(clock.now())
        trace = request[TRACE]
        while True:
            admission.act_on_decisions()
            match command:
                case Queue(ticket=ticket):
                    self._replicas.make_room(attempts, ticket)
                    decision = admission.enter(ticket)
                    if decision is None:
                        if trace is not None:
                            trace.queued()
                        decision = await admission.decision(ticket)
                    now = clock.now()
                    if trace is not None:
                        trace.dispatched(getattr(decision, "code", "granted"))
                    if isinstance(decision, Rejection):
                        command = attempts.refused(decision.code, decision.retry_after_s, now,
                                                   decision.message)
                        continue
                    tier_name = exchange.tier(self._engine.tier_names)[1]
                    request[RECORD].tier = tier_name
                    waited = ticket.dispatched_at - ticket.queued_at
                    metrics.queue_wait.get(tier_name).observe(waited)
                    if ticket.queued_at == ticket.arrived:  # its first pass: as foreseen
                        metrics.predicted_wait.get(tier_name).observe(ticket.predicted_s)
                        metrics.forecast_error.get(tier_name).observe(
                            abs(ticket.predicted_s - waited))
                    metrics.key_wait.get(exchange.plan.caller).observe(waited)
                    # While it waited, an identical call may have filled the cache, or the
                    # key spent its budget: the slot then goes back unused.
                    hit = self._hits.hit(request, exchange.plan, exchange.fingerprint,
                                         tier_name, attempts.queue_s)
                    if hit is not None:
                        return hit
                    command = attempts.granted(decision.deployment, now)
                case Reserve(deployment=deployment, estimate=estimate, maximum=maximum):
                    got = await self._budgets.book.reserve(exchange.plan.caller, estimate,
                                                           maximum, clock.wall())
                    command = attempts.reserved(deployment, got, clock.now())
                    if not isinstance(command, Send | LeaseSlot):
                        self._settle(exchange, None, 0.0)  # not sent after all
                case LeaseSlot(deployment=deployment, ask=ask):
                    tokens = attempts.tokens(deployment)
                    outcome, exchange.lease = await self._replicas.lease(deployment, ask,
                                                                         tokens)
                    command = attempts.leased(deployment, outcome, clock.now())
                    if not isinstance(command, Send):
                        self._replicas.end_attempt(deployment, tokens, None, exchange.lease,
                                                   None)
                        exchange.lease = None
                        self._settle(exchange, None, 0.0)  # not sent after all
                case Hold(key=key, until=until):
                    await self._budgets.wait(key, until - clock.now())
                    command = attempts.held_over(clock.now())
                case Send(deployment=deployment):
                    command = await self._attempt(exchange, endpoint, deployment)
                case Wait(until=until):
                    await asyncio.sleep(max(until - clock.now(), 0.0))
                    command = attempts.resume(clock.now())
                case Fail(error=error):
                    try:
                        raise error
                    finally:  # else this frame holds the error whose traceback holds it
                        del error, command
                case PassThrough():
                    assert exchange.failure is not None
                    exchange.failure.headers["x-proxy-queue-ms"] = str(
                        round(attempts.queue_s * 1000))
                    return exchange.failure
                case Done():
                    assert exchange.answer is not None
                    return exchange.answer

    async def _attempt(self, exchange: Exchange, endpoint: Endpoint,
                       deployment: Deployment) -> Command:
        """One ``Send``: the attempt, what it took, and the policy's next command."""
        attempts, clock, metrics = exchange.attempts, self._clock, self._metrics
        record = exchange.request[RECORD]
        record.upstream = deployment.id
        sent = clock.now()
        result = await self._sender.send(exchange, endpoint, deployment)
        metrics.attempts.get(deployment.provider, result.verdict.value).inc()
        trace = exchange.request[TRACE]
        if trace is not None:
            trace.attempted(result.verdict.value, result.status)
        predicted = attempts.ticket.est_service_s if attempts.ticket else 0.0
        now = clock.now()
        command = attempts.finished(result, now)
        self.answered(deployment.provider)
        self._replicas.end_attempt(deployment, attempts.tokens(deployment), attempts.used,
                                   exchange.lease, result.verdict)
        exchange.lease = None
        record.upstream_s, record.ttft_s = now - sent, result.ttft_s
        labels = (deployment.provider, deployment.id, exchange.plan.call.model)
        if result.verdict is not ABANDONED:
            metrics.upstream_latency.get(*labels).observe(now - sent)
        if result.ttft_s is not None:
            metrics.ttft.get(*labels).observe(result.ttft_s)
        cost = None  # not known: its estimate if it may have used tokens
        if isinstance(command, Done) and attempts.usage is not None:
            usage = attempts.usage
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            cost = record.cost_usd = record_usage(metrics, exchange.plan, deployment, usage,
                                                  predicted, now - sent, attempts.service_tier)
        self._settle(exchange, deployment if attempts.used is not None else None, cost)
        return command


def _nothing(provider: str) -> None:
    """No one listens for answers."""


FORWARDER = web.AppKey("forwarder", Forwarder)


def _handle(request: Incoming, endpoint: Endpoint) -> Awaitable[web.StreamResponse]:
    return request.app[FORWARDER].forward(request, endpoint)  # no frame of its own


async def _routed(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    return await request.app[FORWARDER].forward(request, endpoint)


# Each endpoint's handler (POST), for the fast lane (``proxy.http.lane.front``): partials
# of a plain function, so a queued call holds no extra coroutine frame; and the same for
# aiohttp's router, which wants coroutine functions.
HANDLERS: dict[str, Callable[[Incoming], Awaitable[web.StreamResponse]]] = {
    e.path: functools.partial(_handle, endpoint=e) for e in ENDPOINTS
}
ROUTED: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
    e.path: functools.partial(_routed, endpoint=e) for e in ENDPOINTS
}


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    return await request.app[FORWARDER].count_tokens(request)


ROUTED[COUNT_TOKENS_PATH] = _count_tokens
