"""The life of one call, from admission to answer, as a pure policy: events in, commands out.

A driver (``proxy.http.call.forward`` over sockets, or a simulator on a virtual clock) asks
``start`` for the first command, carries each command out, and reports what happened::

    start ─▶ Queue(ticket) ─granted─▶ Send(deployment) ─finished─▶ Done
               ▲      │ refused             │
               │      ▼                     ├─ 429: its deployment pauses; queued again, in
               │    Fail(error)             │        its place, until the tier's deadline
               │                            ├─ flex 429 "resource unavailable": queued
               │                            │        again, sent without service_tier
               │                            ├─ 5xx, timeout: the next candidate, or the same
               └── Wait(backoff) ◀──────────┤        one after a backoff (retry allowance)
                                            └─ 401/403: the next candidate, else 502
                                                     upstream_auth_error

Before the first byte reaches the client a failed attempt may move on (bounded by
``retry.max_attempts``); after it (``Result.committed``), never. Whatever path a call
takes, its key's rate-limit share is reconciled exactly once: with the usage if it went
upstream, refunded if it never did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..engine import Engine, Usage
from ..errors import (
    Evicted,
    KeyBacklog,
    ProxyError,
    QueueFull,
    QueueTimeout,
    RateLimited,
    Shed,
    UpstreamAuthError,
    UpstreamUnavailable,
)
from ..health.fleet import (
    ABANDONED,
    AUTH,
    DECLINED,
    DOWN,
    GO,
    RATE_LIMITED,
    SUCCESS,
    THROTTLED,
)
from ..scheduling.tickets import DISPATCHED, QUEUED, Ticket
from . import leases
from .budgets import HELD, Refusal, Reservation, budget_exceeded, call_cost
from .commands import (
    Command,
    Done,
    Fail,
    Hold,
    LeaseSlot,
    PassThrough,
    Queue,
    Reserve,
    Result,
    Send,
    Wait,
)
from .plan import Plan
from .retry import backoff_s
from .route import Deployment, degrade, rank

# A call its key's budget holds waits at most this long before it queues again (another
# replica's settle wakes no one here), and is refused this long before its deadline.
HELD_POLL_S = 0.5
HELD_MARGIN_S = 0.05
# What the driver reports of a lease (``LeaseSlot``): the slot is held across replicas; the
# wait for it passed the call's deadline; the shared state went away. A number: the
# provider's shared rpm/tpm is spent for that many seconds.
LEASED, LEASE_TIMED_OUT, LEASE_LOST = "leased", "timed_out", "lost"

_REFUSALS: dict[str, tuple[type[ProxyError], str]] = {
    "queue_full": (QueueFull, "The proxy's queue is full; retry later."),
    "evicted": (Evicted, "A more urgent call took this call's place in the queue; retry later."),
    "queue_timeout": (QueueTimeout, "The call waited longer than its tier allows; retry later."),
    "key_backlog": (KeyBacklog, "This key's calls queued ahead would keep the call waiting "
                    "longer than its tier allows; retry later."),
    "upstream_unavailable": (UpstreamUnavailable, "Every provider for this model is unavailable."),
}

_NONE: frozenset[str] = frozenset()


def tier_declined(service_tier: str | None, status: int, body: bytes) -> bool:
    """Whether an upstream refusal is the provider declining the service tier the call was
    sent with, not limiting the proxy: a flex 429 "resource unavailable" (OpenAI), or a
    498 "capacity exceeded" (Groq's flex)."""
    if service_tier != "flex":
        return False
    if status == 498:
        return True
    text = body[:4096].lower()
    return status == 429 and (b"resource_unavailable" in text or b"resource unavailable" in text)


class Attempts:
    __slots__ = ("_excluded", "_failed", "_failed_providers", "_key_open", "_pending",
                 "_sent", "_started", "attempts", "declined", "deployment", "engine", "last",
                 "plan", "reservation", "service_tier", "ticket", "usage", "used")

    def __init__(self, engine: Engine, plan: Plan) -> None:
        self.engine = engine
        self.plan = plan
        self.ticket: Ticket | None = None
        self.deployment: Deployment | None = None  # the attempt in flight
        self.attempts = 0
        self.last: Result | None = None  # the last failure, passed through if nothing better
        self.usage: Usage | None = None
        self.used: int | None = None  # tokens the last attempt may have used (None: none)
        self._started = math.nan
        # Grown only on failures (rare): one shared empty set (``frozenset()`` makes a new
        # object each time) costs a call nothing.
        self._failed = _NONE  # deployments that failed: tried last
        self._failed_providers = _NONE  # an attempt there is a re-try
        self._excluded = _NONE  # deployments that refused the key
        self._pending: tuple[Deployment, ...] = ()
        self._key_open = False  # the key's share is taken and not yet reconciled
        self._sent = False
        self.service_tier: str | None = None  # the provider tier the last attempt was sent with
        self.declined = False  # the provider declined its tier once: sent without from then
        # The attempt's hold on its key's budget (``Reserve``), which the driver settles.
        self.reservation: Reservation | None = None

    @property
    def queue_s(self) -> float:
        return 0.0 if self.ticket is None else self.ticket.waited_s

    # --- events -------------------------------------------------------------------------

    def start(self, now: float) -> Command:
        plan = self.plan
        wait_s = self.engine.fleet.take_key(plan.caller, plan.tokens, now)
        if wait_s > 0:
            return Fail(RateLimited(f"The key '{plan.caller}' is over its rate limit.",
                                    retry_after=wait_s))
        self._key_open = True
        return self._route(now)

    def granted(self, deployment_id: str, now: float) -> Command:
        """The scheduler gave ``ticket`` a slot through ``deployment_id``: its key's budget
        is reserved first (``Reserve``), then a slot across replicas leased (``LeaseSlot``),
        where each applies, then it is sent."""
        deployment = self.candidate(deployment_id)
        if self.plan.budget is not None:
            estimate, maximum = call_cost(self.plan, deployment, self.tier_for(deployment))
            return Reserve(deployment, estimate, maximum)
        return self._lease(deployment, now)

    def reserved(self, deployment: Deployment, got: Reservation | Refusal | None,
                 now: float) -> Command:
        """What the key's budget answered a ``Reserve`` (None: no budget any more)."""
        if got is None or isinstance(got, Reservation):
            self.reservation = got
            return self._lease(deployment, now)
        ticket = self._ticket()
        self.engine.scheduler.give_back(ticket, now)
        if got.reason != HELD:
            self._reconcile_key(self.plan.tokens if self._sent else None, now)
            return Fail(budget_exceeded(got))
        left = ticket.deadline - now - HELD_MARGIN_S
        if not left > 0:
            self._reconcile_key(self.plan.tokens if self._sent else None, now)
            return Fail(budget_exceeded(got))
        return Hold(self.plan.caller, now + (HELD_POLL_S if left > HELD_POLL_S else left))

    def held_over(self, now: float) -> Command:
        """A ``Hold`` is over: the call queues again in its place."""
        return Queue(self._ticket())

    def leased(self, deployment: Deployment, outcome: str | float, now: float) -> Command:
        """What the shared state answered a ``LeaseSlot``: ``LEASED``, ``LEASE_TIMED_OUT``,
        ``LEASE_LOST``, or the seconds the provider's shared rpm/tpm is spent for."""
        if outcome == LEASED:
            return self._begin(deployment, now)
        if outcome == LEASE_TIMED_OUT:
            return leases.lease_timed_out(self, now)
        if outcome == LEASE_LOST:
            return leases.lease_lost(self, now)
        assert isinstance(outcome, float | int)
        return leases.rate_spent(self, deployment.provider, float(outcome), now)

    def _lease(self, deployment: Deployment, now: float) -> Command:
        if self.engine.across_replicas:
            return LeaseSlot(deployment, leases.lease_ask(self, deployment, now))
        return self._begin(deployment, now)

    def _begin(self, deployment: Deployment, now: float) -> Command:
        """Every gate is passed: the fleet's own (breakers, retry allowance, rpm/tpm)."""
        ticket = self._ticket()
        retry = deployment.provider in self._failed_providers
        start = self.engine.fleet.begin(deployment, retry, self.tokens(deployment), now)
        if start is GO:
            self.deployment = deployment
            self._started = now
            self.attempts += 1
            self._sent = True
            self.service_tier = self.tier_for(deployment)
            return Send(deployment)
        self.engine.scheduler.give_back(ticket, now)
        if start is RATE_LIMITED:  # its provider is paused now; wait in place
            return Queue(ticket)
        if start is DOWN:
            return self._route(now)
        return self._give_up(now)

    def refused(self, code: str, retry_after_s: float, now: float,
                message: str | None = None) -> Command:
        """The scheduler refused the ticket (``Rejection.code``, its ``message`` if any)."""
        if code == "upstream_unavailable" and self.last is not None:
            return self._give_up(now)
        error_type, default = _REFUSALS[code]
        self._reconcile_key(self.plan.tokens if self._sent else None, now)
        return Fail(error_type(message or default, retry_after=retry_after_s))

    def finished(self, result: Result, now: float) -> Command:
        """The ``Send`` is over: its slot comes back and the fleet learns the verdict."""
        deployment = self.deployment
        ticket = self._ticket()
        if deployment is None:
            raise RuntimeError("finished without an attempt in flight")
        self.deployment = None
        verdict = result.verdict
        usage = self.engine.usage(self.plan, deployment, result.prompt_tokens,
                                  result.completion_tokens)
        succeeded = verdict is SUCCESS
        # Tokens the call may have used: what it reported, what it was estimated at once
        # output may have flowed (a stream cut or left), nothing for a refusal.
        spent = self.tokens(deployment)
        used = (usage.total if succeeded
                else spent if result.committed or verdict is ABANDONED else None)
        self.used = used
        self.engine.fleet.end(deployment, verdict, now, self._started, spent, used,
                              result.retry_after_s, ticket.beside)
        self.engine.scheduler.release(ticket, now, now - self._started)
        if succeeded or result.committed or verdict is ABANDONED:
            if succeeded:
                self.usage = usage
                if isinstance(result.service_tier, str) and result.service_tier:
                    self.service_tier = result.service_tier[:64]  # what is priced
                self.engine.learn(self.plan, deployment, usage, result.ttft_s,
                                  now - self._started)
                self.engine.fleet.answered(deployment.provider, now - self._started,
                                           usage.completion_tokens, now)
            self._reconcile_key(usage.total if succeeded else self.plan.tokens, now)
            return Done()
        if verdict is THROTTLED:
            self.attempts -= 1  # throttling spends no attempt: the deadline bounds it
            return Queue(ticket)  # its deployment is paused; it goes again when that ends
        if verdict is DECLINED and not self.declined:
            self.declined = True  # once: its next attempt is sent without service_tier
            self.attempts -= 1
            return Queue(ticket)
        self.last = result
        if verdict is AUTH:
            self._excluded |= {deployment.id}
        else:
            self._failed |= {deployment.id}
            self._failed_providers |= {deployment.provider}
        if self.attempts >= self.engine.retry.max_attempts:
            return self._give_up(now)
        return self._route(now)

    def resume(self, now: float) -> Command:
        """The backoff of a ``Wait`` is over."""
        if now >= self.plan.deadline:
            return self._give_up(now)
        return self._queue(self._pending, now)

    def abandon(self, now: float) -> None:
        """The driver stops (the client left, or an error escaped): give back whatever the
        call still holds. Safe to call at any time, more than once."""
        ticket = self.ticket
        if ticket is not None and ticket.state is QUEUED:
            self.engine.scheduler.cancel(ticket, now)
        if self.deployment is not None:
            self.finished(Result(ABANDONED), now)
        elif ticket is not None and ticket.state is DISPATCHED:
            self.engine.scheduler.give_back(ticket, now)
        self._reconcile_key(self.plan.tokens if self._sent else None, now)

    # --- decisions ----------------------------------------------------------------------

    def _route(self, now: float) -> Command:
        plan, engine = self.plan, self.engine
        candidates = plan.route.candidates
        if len(candidates) == 1:  # nothing to rank (rank() would keep it unless it is down)
            only = candidates[0]
            ranked = [] if engine.fleet.breakers[only.id].down(now) else [only]
        else:
            ranked = rank(plan.route, plan.tier_name, plan.prompt_tokens,
                          plan.output_tokens * plan.call.choices,
                          engine.stats(candidates, now), engine.rng)
        usable = [d for d in ranked if d.id not in self._excluded]
        if not usable:
            return self._give_up(now)
        fresh = [d for d in usable if d.id not in self._failed]
        if fresh:
            return self._degrade(fresh, now)
        # Only deployments that already failed this call are left: the same provider again
        # after a backoff, if the deadline leaves room (the retry allowance is asked at grant).
        last = self.last
        pause = backoff_s(self.attempts, engine.rng, base=engine.retry.backoff_base_s,
                          cap=engine.retry.backoff_max_s,
                          retry_after_s=last.retry_after_s if last else None)
        if now + pause >= plan.deadline:
            return self._give_up(now)
        self._pending = tuple(usable)
        return Wait(now + pause)

    def _degrade(self, ranked: list[Deployment], now: float) -> Command:
        plan = self.plan
        if plan.route.degradation is None:
            return self._queue(ranked, now)
        scheduler = self.engine.scheduler
        waits = {d.id: scheduler.expected_wait_s(d.id, plan.tier,
                                                 self.engine.service_s(plan, d)[0], now)
                 for d in ranked}
        decision = degrade(plan.route, plan.tier_name, ranked, waits)
        if decision.action == "shed":
            self._reconcile_key(self.plan.tokens if self._sent else None, now)
            return Fail(Shed(f"The '{plan.tier_name}' tier is shed: the expected wait is "
                             "too long.", retry_after=decision.retry_after_s))
        return self._queue(list(decision.deployments), now)

    def _queue(self, candidates: Sequence[Deployment], now: float) -> Command:
        plan = self.plan
        estimate, size = self.engine.service_s(plan, candidates[0])
        ids = tuple(d.id for d in candidates)
        if self.ticket is None:
            self.ticket = Ticket(plan.tier, ids, estimate, size_s=size, ceiling=plan.ceiling,
                                 max_wait_s=plan.deadline - now, key=plan.caller,
                                 key_weight=plan.caller_weight)
        else:
            self.ticket.candidates = ids
            self.ticket.est_service_s = estimate
        return Queue(self.ticket)

    def _give_up(self, now: float) -> Command:
        self._reconcile_key(self.plan.tokens if self._sent else None, now)
        last = self.last
        if last is None:
            return Fail(self._unavailable(now))
        if last.verdict is AUTH:
            return Fail(UpstreamAuthError(
                "Every provider for this model refused the proxy's credentials."))
        if last.status is not None:
            return PassThrough()
        return Fail(last.error or self._unavailable(now))

    def _unavailable(self, now: float) -> UpstreamUnavailable:
        breakers = self.engine.fleet.breakers
        retry_at = min((breakers[d.id].retry_at(now) for d in self.plan.route.candidates),
                       default=now + 1.0)
        return UpstreamUnavailable(
            f"Every provider for '{self.plan.call.model}' is unavailable.",
            retry_after=max(retry_at - now, 1.0) if math.isfinite(retry_at) else 1.0,
        )

    def _reconcile_key(self, actual: int | None, now: float) -> None:
        if self._key_open:
            self._key_open = False
            self.engine.fleet.reconcile_key(self.plan.caller, self.plan.tokens, actual, now)

    def candidate(self, deployment_id: str) -> Deployment:
        for deployment in self.plan.route.candidates:
            if deployment.id == deployment_id:
                return deployment
        raise ValueError(f"{deployment_id!r} is not a candidate of this call")

    def tier_for(self, deployment: Deployment) -> str | None:
        """The provider tier a call through ``deployment`` goes with now (None: none)."""
        if self.declined or not deployment.service_tiers:  # most have no tier table
            return None
        names = self.engine.tier_names
        return deployment.service_tier(names[min(self._ticket().tier, len(names) - 1)])

    def tokens(self, deployment: Deployment) -> int:
        """What a call through ``deployment`` is charged to its rpm/tpm before it answers."""
        output = deployment.output_cap(self.plan.output_tokens)
        return self.plan.prompt_tokens + output * self.plan.call.choices

    def _ticket(self) -> Ticket:
        if self.ticket is None:
            raise RuntimeError("no ticket yet")
        return self.ticket
