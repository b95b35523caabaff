"""Provider health and limits, and what they mean for the scheduler's capacity.

- A breaker per deployment: when it opens, the scheduler sends nothing through the
  deployment until its cooldown ends, then at most ``half_open_probes`` calls at once until
  it closes (``Scheduler.set_down`` / ``set_up``).
- A 429 cuts the provider's adaptive concurrency limit to what it was seen to bear and,
  unless other calls were running (the provider's concurrency showing), pauses the
  deployment for its ``retry-after`` (or ``THROTTLE_DEFAULT_S``); it never counts against
  its health. A 529 (overloaded) pauses the deployment the same way, with no cut: the
  provider as a whole is busy.
- rpm/tpm buckets per provider are taken only when a call really goes upstream, and
  refunded or reconciled with the actual usage afterwards; a spent bucket pauses the
  provider until it refills. A key's own buckets work the same way, taken when its call
  is admitted.
- A retry allowance per provider keeps re-tries within a fraction of first attempts.
- A self-hosted server's own figures (``engines``) bound its calls (the pool's room); where it
  cannot be read and its limit is learned (``max_concurrency: auto``), the latency its
  answers show does (``gradient``). A server that refuses the ``priority`` field is not
  sent it again (``priority_refused``).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from ..call.classify import Principal
from ..call.retry import RetryAllowance
from ..call.route import Deployment
from ..scheduling.scheduler import Scheduler
from .breaker import CLOSED, OPEN, Breaker, BreakerState
from .engines import EngineView, Figures
from .gradient import LatencyLimit
from .limits import RateLimits
from .provider import Provider

# A 429 without retry-after pauses its deployment this long. Whatever retry-after says, the
# pause is at least THROTTLE_MIN_S doubled for every 429 in a row from the deployment (so
# an upstream that keeps saying "retry now" is not hammered), and at most THROTTLE_MAX_S.
THROTTLE_DEFAULT_S = 1.0
THROTTLE_MIN_S = 0.05
THROTTLE_MAX_S = 60.0
# A server's figures count as full once older than this many reads (at least GRACE_MIN_S),
# and the server as unreadable (its limit falls back) once not read for UNREADABLE_S.
GRACE_READS = 3
GRACE_MIN_S = 2.0
UNREADABLE_S = 15.0

TransitionHook = Callable[[Deployment, BreakerState, BreakerState], None]


class Verdict(enum.Enum):
    SUCCESS = "success"  # answered: a 2xx, or a 4xx that is the client's own
    FAILURE = "failure"  # connect error, timeout, 5xx, a stream broken by the upstream
    THROTTLED = "throttle"  # 429
    # A 529 (Anthropic's overloaded_error): the provider as a whole is busy, not limiting
    # the proxy; no verdict on health nor on the concurrency it bears: the deployment
    # pauses and the call falls back to another candidate.
    OVERLOADED = "overloaded"
    AUTH = "auth"  # 401/403: the provider's key is wrong; a failure of the deployment
    ABANDONED = "abandon"  # the client left
    # A 429 "resource unavailable" to a call sent with a provider service tier (flex): the
    # provider is not limiting the proxy, that tier is full; sent again without it.
    DECLINED = "declined"


class Start(enum.Enum):
    """Whether a granted call may go upstream."""

    GO = "go"
    RATE_LIMITED = "rate_limited"  # the provider's rpm/tpm is spent: it is paused, queue again
    DOWN = "down"  # the breaker opened while the call waited: route again
    RETRIES_SPENT = "retries_spent"  # a re-try the provider's retry allowance refuses


# The members under plain names, for the hot paths (why: see scheduling/tickets.py).
SUCCESS: Final = Verdict.SUCCESS
FAILURE: Final = Verdict.FAILURE
THROTTLED: Final = Verdict.THROTTLED
OVERLOADED: Final = Verdict.OVERLOADED
AUTH: Final = Verdict.AUTH
ABANDONED: Final = Verdict.ABANDONED
DECLINED: Final = Verdict.DECLINED
GO: Final = Start.GO
RATE_LIMITED: Final = Start.RATE_LIMITED
DOWN: Final = Start.DOWN
RETRIES_SPENT: Final = Start.RETRIES_SPENT


class Fleet:
    def __init__(
        self,
        scheduler: Scheduler,
        providers: Mapping[str, Provider],
        deployments: Iterable[Deployment],
        principals: Iterable[Principal],
        retry_ratio: float,
        rng: random.Random,
        on_transition: TransitionHook | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._rng = rng
        self._on_transition = on_transition
        self.breakers: dict[str, Breaker] = {}
        self.retry_allowances: dict[str, RetryAllowance] = {}
        self.provider_rates: dict[str, RateLimits] = {}
        self.key_rates: dict[str, RateLimits] = {}
        self._throttles: dict[str, int] = {}
        self.engines: dict[str, EngineView] = {}
        self.latency: dict[str, LatencyLimit] = {}
        self.priority_refused: set[str] = set()
        self._learned_for: dict[str, Provider] = {}  # each provider's settings they are for
        self.reconfigure(providers, deployments, principals, retry_ratio)

    def reconfigure(self, providers: Mapping[str, Provider], deployments: Iterable[Deployment],
                    principals: Iterable[Principal], retry_ratio: float) -> None:
        """Providers, deployments and keys as configured now. What exists already keeps its
        state (breakers, retry allowances, rpm/tpm buckets whose limits did not change);
        nothing is forgotten, so a call still running on a provider that left the config
        finishes with it. ``providers`` must name every provider ever configured."""
        self._providers = providers
        for deployment in deployments:
            settings = providers[deployment.provider].breaker
            breaker = self.breakers.get(deployment.id)
            if breaker is None:
                self.breakers[deployment.id] = Breaker(settings, self._rng,
                                                       self._hook(deployment))
            else:
                breaker.retune(settings)
        for name, provider in providers.items():
            allowance = self.retry_allowances.setdefault(name, RetryAllowance(ratio=retry_ratio))
            allowance.ratio = retry_ratio
            self._keep_rates(self.provider_rates, name, provider.rpm, provider.tpm)
            self._keep_learners(name, provider)
        for principal in principals:
            if principal.rpm is not None or principal.tpm is not None:
                self._keep_rates(self.key_rates, principal.name, principal.rpm,
                                 principal.tpm)
            else:
                self.key_rates.pop(principal.name, None)

    @staticmethod
    def _keep_rates(buckets: dict[str, RateLimits], name: str, rpm: int | None,
                    tpm: int | None) -> None:
        found = buckets.get(name)
        if found is None or found.rates != (rpm, tpm):
            buckets[name] = RateLimits(rpm, tpm)

    def _keep_learners(self, name: str, provider: Provider) -> None:
        """The provider's engine view and latency limit, kept across reloads while it
        keeps its engine, address and read interval (the view) and its cap (the latency
        limit); a provider changed in any way may take ``priority`` again."""
        before = self._learned_for.get(name)
        self._learned_for[name] = provider
        if before is not None and before != provider:
            self.priority_refused.discard(name)  # another server, or restarted otherwise
        if provider.engine is None:
            self.engines.pop(name, None)
        elif before is None or _read_as(before) != _read_as(provider):
            grace = max(GRACE_READS * provider.read_every_s, GRACE_MIN_S)
            self.engines[name] = EngineView(grace, max(grace, UNREADABLE_S))
            self._scheduler.lower_room(name, 0, "engine")  # full until first read
        found = self.latency.get(name)
        if not provider.auto:
            self.latency.pop(name, None)
        elif found is None or found.cap != provider.max_concurrency:
            found = self.latency[name] = LatencyLimit(provider.max_concurrency)
            if provider.engine is None:
                self._scheduler.lower_room(name, found.limit, "latency")

    def down(self, deployment: str, now: float) -> bool:
        """The deployment's breaker is open (half-open counts as up: probes may go)."""
        return self.breakers[deployment].down(now)

    # --- keys ---------------------------------------------------------------------------

    def take_key(self, key: str, tokens: int, now: float) -> float:
        """Take a call's share of its key's own limits: 0.0, or the seconds to wait."""
        rates = self.key_rates.get(key)
        return 0.0 if rates is None else rates.take(tokens, now)

    def reconcile_key(self, key: str, estimated: int, actual: int | None, now: float) -> None:
        """Reconcile the key's buckets with what the call used (None: it never went
        upstream, so the request comes back too)."""
        rates = self.key_rates.get(key)
        if rates is None:
            return
        if actual is None:
            rates.refund(estimated, now)
        else:
            rates.reconcile(estimated, actual, now)

    # --- one attempt ----------------------------------------------------------------------

    def begin(self, deployment: Deployment, retry: bool, tokens: int, now: float) -> Start:
        """A slot was granted for ``deployment``: may the call go? Takes the provider's
        rpm/tpm share, a retry from its allowance and a breaker probe, or nothing."""
        name = deployment.provider
        breaker = self.breakers[deployment.id]
        if breaker.down(now):
            return DOWN
        rates = self.provider_rates[name]
        wait_s = rates.take(tokens, now)
        if wait_s > 0:
            self._scheduler.pause(name, now + wait_s, now)
            return RATE_LIMITED
        allowance = self.retry_allowances[name]
        if retry and not allowance.try_retry(now):
            rates.refund(tokens, now)
            return RETRIES_SPENT
        if not retry:
            allowance.on_call(now)
        # Half-open, the scheduler's gate already admits no more calls than the breaker has
        # probes; acquiring here does the breaker's own probe accounting.
        breaker.acquire(now)
        return GO

    def end(self, deployment: Deployment, verdict: Verdict, now: float, started: float,
            tokens: int, used: int | None, retry_after_s: float | None = None,
            beside: int = 0) -> None:
        """What became of an attempt ``begin`` let go: health, capacity and buckets.
        ``used`` is the tokens the upstream reported (None: unknown or nothing useful);
        ``beside``: the other calls in flight on the provider when this one was sent.
        Call it before the attempt's slot is released, so its verdict shapes who gets the
        slot next."""
        breaker = self.breakers[deployment.id]
        name = deployment.provider
        if verdict is SUCCESS:
            breaker.on_success(now, started)
            self._throttles.pop(deployment.id, None)
        elif verdict in (FAILURE, AUTH):
            breaker.on_failure(now, started)
        elif verdict is THROTTLED:
            breaker.on_throttle(now, started)
            self._throttle(deployment, now, retry_after_s, beside)
        elif verdict is OVERLOADED:
            breaker.on_throttle(now, started)
            self._pause(deployment, now, retry_after_s)
        else:
            breaker.on_abandon(now, started)
        if used is None:
            self.provider_rates[name].refund(tokens, now, request=False)
        else:
            self.provider_rates[name].reconcile(tokens, used, now)

    def _throttle(self, deployment: Deployment, now: float, retry_after_s: float | None,
                  beside: int) -> None:
        """A 429 with other calls still running is the provider's concurrency showing: the
        limit comes down to what it bore, at most the calls in flight when the refused one
        was sent (``beside``; counting at the 429 instead would miss calls that ended since
        and count others of a burst that are refused too), and the refused call waits for
        one of theirs to finish. A 429 with nothing else running is a rate limit: the
        deployment pauses."""
        name = deployment.provider
        others = self._scheduler.inflight(name) - 1  # the refused call still holds its slot
        self._scheduler.cut(name, now, beside)
        if others > 0:
            return
        self._pause(deployment, now, retry_after_s)

    def _pause(self, deployment: Deployment, now: float, retry_after_s: float | None) -> None:
        """The deployment pauses for ``retry_after_s`` (or ``THROTTLE_DEFAULT_S``), at least
        a span that doubles with each refusal in a row."""
        streak = self._throttles[deployment.id] = self._throttles.get(deployment.id, 0) + 1
        shortest = THROTTLE_MIN_S * 2.0 ** min(streak - 1, 30)
        pause = THROTTLE_DEFAULT_S if retry_after_s is None else retry_after_s
        self._scheduler.pause(deployment.id, now + min(max(pause, shortest), THROTTLE_MAX_S), now)

    # --- self-hosted servers ------------------------------------------------------------

    def engine_read(self, provider: str, figures: Figures, now: float) -> None:
        """Fresh figures from the provider's server."""
        view = self.engines.get(provider)
        if view is not None:
            view.read(figures, self._scheduler.inflight(provider), now)
            self.settle_room(provider, now)

    def engine_failed(self, provider: str, reason: str, now: float) -> None:
        view = self.engines.get(provider)
        if view is not None:
            view.failed(reason, now)
            self.settle_room(provider, now)

    def answered(self, provider: str, seconds: float, tokens: int, now: float) -> None:
        """A call there was answered in ``seconds`` with ``tokens`` of output: a latency
        sample for a learned limit."""
        latency = self.latency.get(provider)
        if latency is not None:
            latency.sample(seconds, tokens, self._scheduler.inflight(provider))
            self.settle_room(provider, now)

    def settle_room(self, provider: str, now: float) -> None:
        """The provider's room at ``now``: its server's figures while they can be read,
        else its latency-learned limit, else none (configured and 429s alone)."""
        view = self.engines.get(provider)
        room = None if view is None else view.room(now)
        if room is not None:
            self._scheduler.set_room(provider, room, "engine", now)
            return
        latency = self.latency.get(provider)
        if latency is not None:
            self._scheduler.set_room(provider, latency.limit, "latency", now)
        else:
            self._scheduler.set_room(provider, math.inf, "engine", now)

    def refuse_priority(self, provider: str) -> bool:
        """The provider's server refused the ``priority`` field: not sent there again.
        True the first time (to say so once)."""
        first = provider not in self.priority_refused
        self.priority_refused.add(provider)
        return first

    def observe_quota(self, provider: str, headers: Mapping[str, str], now: float) -> None:
        """Pause a provider that reports its quota spent, before it starts answering 429."""
        rates = self.provider_rates[provider]
        rates.observe_headers(headers, now)
        until = rates.paused_until(now)
        if until > now:
            self._scheduler.pause(provider, until, now)

    def _hook(self, deployment: Deployment) -> Callable[[BreakerState, BreakerState, float], None]:
        probes = self._providers[deployment.provider].breaker.half_open_probes

        def on_transition(old: BreakerState, new: BreakerState, at: float) -> None:
            if new is OPEN:
                breaker = self.breakers[deployment.id]
                self._scheduler.set_down(deployment.id, breaker.open_until, probes, at)
            elif new is CLOSED:
                self._scheduler.set_up(deployment.id, at)
            if self._on_transition is not None:
                self._on_transition(deployment, old, new)

        return on_transition


def _read_as(provider: Provider) -> tuple[object, ...]:
    """What a server's view is read by: a change in any of it starts the view over."""
    return provider.engine, provider.base_url, provider.read_every_s
