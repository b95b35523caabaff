"""What each call is charged to: its tier's floor (``floors``), its key's share
of the tier (``shares``), the headroom's record of demand
(``headroom``) and its provider's service times (``policy``).

A call is charged its claim (its estimate, capped: ``Policy.claim``) when it arrives
(its key's virtual start, the demand) and when it gets a slot (its tier's floor), and
corrected by what it really took when its slot comes back; one that leaves without ever
having a slot costs its key nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .capacity import Pool
from .floors import Floors
from .headroom import Headroom
from .policy import Policy
from .queues import TicketQueues
from .shares import KeyStats, KeyTags
from .tickets import Ticket


class Charges:
    def __init__(self, policy: Policy, queues: TicketQueues, floors: Floors,
                 headroom: Headroom, keys: KeyTags, stats: KeyStats) -> None:
        self._policy = policy
        self._queues = queues
        self._floors = floors
        self._headroom = headroom
        self.keys = keys
        self.stats = stats

    def arrived(self, ticket: Ticket, likely: str, now: float) -> None:
        """A new call, most likely for provider ``likely``: its key's virtual start, and
        the demand the headroom expects."""
        claim = ticket.key_claim_s = self._policy.claim(likely, ticket)
        ticket.tag = self.keys.arrive(ticket.tier, ticket.key, ticket.key_weight, claim)
        self._headroom.record(likely, ticket.tier, claim, now)

    def retag(self, queued: Iterable[Ticket], running: Iterable[Ticket], likely: dict[
            Ticket, str]) -> None:
        """After a reload (keys' shares start over): running calls go back to the front
        if they are re-tried, queued ones are tagged anew in arrival order; what running
        calls claimed beyond their charge is noted again (``started``)."""
        for ticket in running:
            ticket.tag = 0.0
            if ticket.over_s and ticket.pool is not None:
                self._uncharged(ticket.pool)[ticket.current_tier] += ticket.over_s
        for ticket in sorted(queued, key=lambda t: t.order):
            ticket.key_claim_s = self._policy.claim(likely[ticket], ticket)
            ticket.tag = self.keys.arrive(ticket.current_tier, ticket.key, ticket.key_weight,
                                          ticket.key_claim_s)

    def started(self, ticket: Ticket, pool: Pool, now: float) -> None:
        """``ticket`` got a slot of ``pool``."""
        tier = ticket.current_tier
        ticket.charged_s = charged = self._policy.claim(pool.name, ticket)
        ticket.over_s = 0.0
        if ticket.est_service_s > charged:  # capped: the rest, as far as its tier's calls go
            unit = self._policy.unit(pool, tier, now)
            over = (unit if unit < ticket.est_service_s else ticket.est_service_s) - charged
            if over > 0.0:
                ticket.over_s = over
                self._uncharged(pool.name)[tier] += over
        ticket.floor_paid_s = 0.0
        if self._queues.queued:  # floors only move while calls wait
            ticket.floor_paid_s = self._floors.serve(
                pool.name, tier, charged, self._queues.counts(pool.name),
                self._policy.credit_cap(pool, now))
        self.keys.started(tier, ticket.tag)
        self.stats.served(tier, ticket.key, charged, now, now - ticket.queued_at)

    def ended(self, ticket: Ticket, pool: Pool, service_s: float | None, used: bool,
              now: float) -> None:
        """``ticket``'s slot of ``pool`` came back after ``service_s`` (if known), or
        unused: every charge is corrected by the difference from what it claimed."""
        delta = 0.0
        if ticket.over_s:
            self._uncharged(pool.name)[ticket.current_tier] -= ticket.over_s
            ticket.over_s = 0.0
        if not used:
            delta = -ticket.charged_s
        elif service_s is not None and math.isfinite(service_s) and service_s >= 0:
            delta = service_s - ticket.charged_s
            self._headroom.correct(pool.name, ticket.tier, delta, ticket.arrived, now)
            self._policy.served(pool.name, ticket.current_tier, service_s, now)
        if ticket.paced_in is not None:
            self._policy.repace(ticket, pool.name, delta, refund=not used)
        if delta:
            tier = ticket.current_tier
            self._floors.serve(pool.name, tier, delta, self._queues.counts(pool.name),
                               self._policy.credit_cap(pool, now), ticket.floor_paid_s)
            self.keys.correct(tier, ticket.key, ticket.key_weight, delta)
            self.stats.served(tier, ticket.key, delta, now)

    def _uncharged(self, pool: str) -> list[float]:
        found = self._policy.uncharged.get(pool)
        if found is None:
            found = self._policy.uncharged[pool] = [0.0] * len(self._queues.depth)
        return found

    def unclaim(self, ticket: Ticket) -> None:
        """``ticket`` leaves without having been served: its key is not charged."""
        if math.isnan(ticket.dispatched_at) and ticket.key_claim_s:
            self.keys.correct(ticket.current_tier, ticket.key, ticket.key_weight,
                              -ticket.key_claim_s)
            ticket.key_claim_s = 0.0
