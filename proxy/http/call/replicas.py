"""The driver's side of shared state (``proxy.state``): with the redis backend, a call
the local scheduler grants a slot also needs one of its provider's slots leased across
replicas and room in the provider's and its key's shared rpm/tpm buckets. What to ask and
what each answer means are the attempt policy's (a ``Lease`` command, ``Attempts.leased``,
``proxy.core.call.leases``); here they are asked and carried out.
With the memory backend nothing here awaits anything."""

from __future__ import annotations

from ...core.call import leases
from ...core.call.attempts import LEASE_LOST, LEASE_TIMED_OUT, LEASED, Attempts
from ...core.call.classify import Principal
from ...core.call.commands import LeaseAsk
from ...core.call.plan import Plan
from ...core.call.route import Deployment
from ...core.clock import Clock
from ...core.engine import Engine
from ...core.errors import RateLimited
from ...core.health.fleet import Verdict
from ...core.scheduling.capacity import GROW_EVERY_S
from ...core.scheduling.scheduler import Ticket
from ...state.base import Lease, State
from ..base.metrics import Metrics


class Replicas:
    """What a call asks of the state shared across replicas (see the module)."""

    def __init__(self, shared: State, engine: Engine, metrics: Metrics, clock: Clock) -> None:
        self.shared = shared
        self.across_replicas = shared.across_replicas  # a backend's, for good
        self._engine = engine
        self._metrics = metrics
        self._clock = clock

    async def lease(self, deployment: Deployment, ask: LeaseAsk, tokens: int
                    ) -> tuple[str | float, Lease | None]:
        """Carry out a ``LeaseSlot``: what to report to ``Attempts.leased``, and the lease
        while the call is sent (None unless ``LEASED``)."""
        shared, clock = self.shared, self._clock
        now = clock.now()
        try:
            lease = await shared.lease(ask.provider, ask.limit, ask.rank, ask.waited_s,
                                       ask.max_wait_s, ask.key, ask.key_weight, ask.charged_s)
        except TimeoutError:
            return LEASE_TIMED_OUT, None
        finally:
            self._metrics.shared_wait.observe(clock.now() - now)
        if lease is None:
            return LEASE_LOST, None
        provider = self._engine.providers[deployment.provider]
        kept = False
        try:
            wait_s = await shared.take_rate("provider:" + provider.name, provider.rpm,
                                            provider.tpm, tokens)
            kept = wait_s <= 0
        finally:
            if not kept:  # spent, cancelled, or refused (reject mode): the slot goes back
                shared.release(lease)
        if not kept:
            return wait_s, None
        return LEASED, lease

    def make_room(self, attempts: Attempts, ticket: Ticket) -> None:
        """Before ``ticket`` queues here: a less urgent waiter in Redis sent back to its
        local queue where ``leases.withdrawals`` says so."""
        if not self.shared.across_replicas:
            return
        for provider, below in leases.withdrawals(attempts, ticket):
            if self.shared.withdraw_below(provider, below):
                return

    def end_attempt(self, deployment: Deployment, tokens: int, used: int | None,
                    lease: Lease | None, verdict: Verdict | None) -> None:
        """An attempt is over: its slot back, its buckets reconciled
        (``leases.reconciliation``), a 429's cut told to every replica."""
        shared = self.shared
        if not shared.across_replicas:
            return
        if lease is not None:
            shared.release(lease)
        provider = self._engine.providers[deployment.provider]
        reconciled = leases.reconciliation(tokens, used, verdict)
        shared.reconcile_rate("provider:" + provider.name, provider.rpm, provider.tpm,
                              reconciled.requests, reconciled.tokens)
        if reconciled.cut_limit:
            shared.limit_cut(provider.name, self._engine.scheduler.capacity(provider.name),
                             GROW_EVERY_S)

    async def take_key(self, principal: Principal, plan: Plan) -> bool:
        """With shared state (the caller checks), the key's share of its shared rpm/tpm:
        True if taken (reconcile it with ``reconcile_key``); RateLimited if the key is over
        its limit."""
        if principal.rpm is None and principal.tpm is None:
            return False
        wait_s = await self.shared.take_rate("key:" + principal.name, principal.rpm,
                                             principal.tpm, plan.tokens)
        if wait_s > 0:
            raise RateLimited(f"The key '{principal.name}' is over its rate limit.",
                              retry_after=wait_s)
        return True

    def reconcile_key(self, principal: Principal, plan: Plan, sent: bool,
                      used: int | None) -> None:
        self.shared.reconcile_rate("key:" + principal.name, principal.rpm, principal.tpm,
                                   0 if sent else 1, plan.tokens - (used or 0) if sent
                                   else plan.tokens)
