"""Which waiting call a free slot of a provider goes to.

For each free slot of a provider, among the calls that may use it:

1. *Priority within fair share.* The most urgent tier goes first unless it is more than
   ``quantum_s`` of slot-seconds per unit of weight ahead of the most under-served
   waiting tier (``proxy.core.sharing``); otherwise the most under-served one goes.
2. *Lending.* A tier served for its share, with no call at risk, lends its turn to the
   most urgent of the more urgent tiers that need it: at once to one whose recent load,
   with the tiers above it, fits the provider (lending saves its calls); to others only
   while their most pressed call has used more of its ``max_wait_s`` than the lender's
   and what the lender is owed stays within ``lend_s``. So a tier that fits is served as
   if by priority, while a tier within its share keeps it against an urgent overload.
3. *Rescue.* A call with less than ``rescue_fraction`` of its ``max_wait_s`` left is at
   risk: the at-risk calls of the chosen tier go first, in deadline order.
4. *Levels.* Within a tier, a call joins the level its stable size puts it in (short
   calls first), oldest arrival first within a level, and moves up a level after
   ``promote_after_s[level]``; after ``tier_promote_after_s`` (off by default) it moves
   up one tier, once, never above its ``ceiling``.
5. *Headroom* (``proxy.core.headroom``): while no more urgent call waits for the provider,
   a call that has used less than half of its ``max_wait_s`` may not take the last free
   slots held for more urgent arrivals; never every slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .capacity import Gate, Pool
from .headroom import Headroom
from .scheduler_queues import Lane, TicketQueues
from .scheduler_types import SchedulerSettings, Ticket
from .sharing import FairShare

# A headroom hold keeps a free slot from a waiting call only until the call has used this
# fraction of its tier's max_wait_s.
HOLD_PATIENCE = 0.5
# Weight of the newest sample in the means of observed service times.
_SERVICE_EWMA_ALPHA = 0.1
# Until its slot comes back, a call is charged at most this many times its provider's mean.
CLAIM_FACTOR = 4.0

Choice = tuple[Ticket, Gate]


class Policy:
    def __init__(self, settings: SchedulerSettings, queues: TicketQueues, share: FairShare,
                 headroom: Headroom) -> None:
        self.settings = settings
        self.reserves: list[int | None] = [t.reserve for t in settings.tiers]
        self._tiers = settings.tiers
        self._queues = queues
        self._share = share
        self._headroom = headroom
        self._served: dict[str, list[float | None]] = {}  # per provider, per tier
        self.means: dict[str, float] = {}  # mean service seconds, per provider

    def next_wakeup(self, pools: Iterable[Pool], now: float) -> float | None:
        """When time alone may next change a decision: a deadline; or, for a provider with
        a call waiting for it, a pause or breaker that ends, a limit that grows back, or
        (while a free slot is held back from a waiting call) a hold that lapses or a tier
        promotion."""
        queues = self._queues
        if not queues.queued:
            return None  # every wake-up is for a call that waits
        soonest = queues.next_deadline()
        for pool in pools:
            waiting = [t for t in range(len(self._tiers)) if queues.count(pool.name, t)]
            if not waiting:
                continue
            soonest = min(soonest, pool.next_change(now),
                          *(g.next_change(now) for g in pool.deployments))
            held_tier = next((t for t in waiting if self.head(pool, t, now)), None)
            if pool.free(now) <= 0 or held_tier is None:
                continue
            # A free slot and a call that could take it: only a hold keeps them apart.
            soonest = min(soonest, queues.next_tier_promotion())
            lapse = self.hold_lapse(pool, held_tier, now)
            if lapse is not None:
                soonest = min(soonest, lapse)
        return soonest if math.isfinite(soonest) else None

    def choose(self, pool: Pool, now: float) -> Choice | None:
        """The call ``pool``'s next free slot goes to, with its gate; None: none may have it
        now (nothing eligible, or a hold keeps the slot)."""
        share = self._share
        line = share.sync(self._queues.depth) + self.settings.quantum_s
        heads: dict[int, Choice] = {}
        chosen: int | None = None
        for tier in range(len(self._tiers)):
            if not self._queues.count(pool.name, tier):
                continue
            head = self.head(pool, tier, now)
            if head is None:
                continue
            heads[tier] = head
            if share.virtual[tier] < line:
                chosen = tier
                break
        if not heads:
            return None
        most_urgent = min(heads)
        if chosen is None:
            chosen = min(heads, key=lambda t: share.virtual[t])
        due: dict[int, Choice] = {}

        def earliest(tier: int) -> Choice:
            """The call of ``tier`` this pool can serve whose deadline comes first."""
            if tier not in due:
                due[tier] = self.head(pool, tier, now, earliest=True) or heads[tier]
            return due[tier]

        def used(tier: int) -> float:
            """How much of its max_wait_s the most pressed call of ``tier`` has used."""
            return self.used(tier, now)

        def at_risk(tier: int) -> bool:
            if not self.at_risk(tier, self._queues.earliest_deadline(tier), now):
                return False  # cheap: nothing in the tier, on any provider, is near
            return self.at_risk(tier, earliest(tier)[0].deadline, now)

        if chosen != most_urgent and not at_risk(chosen):
            # Its share's turn goes to a more urgent tier that needs it more: at once to
            # one whose load fits the provider (lending saves its calls), to others while
            # what the lender is owed stays within lend_s.
            lend = self.settings.lend_s
            pressed = [t for t in heads if t < chosen and (
                self.fits(pool, t, now)
                or (share.virtual[t] - share.virtual[chosen] < lend
                    and (at_risk(t) or used(t) > used(chosen))))]
            if pressed:
                chosen = min(pressed)
        if (chosen == most_urgent
                and pool.free(now) <= self.held_against(pool, chosen, now)
                and used(chosen) < HOLD_PATIENCE):
            return None  # keep the slot for the more urgent arrivals the headroom expects
        return earliest(chosen) if at_risk(chosen) else heads[chosen]

    def head(self, pool: Pool, tier: int, now: float, earliest: bool = False) -> Choice | None:
        """The ticket of ``tier`` that ``pool`` should take, with the first open gate of its
        candidates in this pool: the top level first and the oldest arrival within it, or
        (``earliest``) the earliest deadline whatever the level."""
        best: Choice | None = None
        for level in range(self.settings.levels):
            for lane in self._queues.lanes(pool.name, tier, level):
                ticket = lane.earliest() if earliest else lane.head()
                if ticket is None or (best is not None and (
                        (ticket.deadline, ticket.order) >= (best[0].deadline, best[0].order)
                        if earliest else ticket.order >= best[0].order)):
                    continue
                gate = _open_gate(lane, pool.name, now)
                if gate is not None:
                    best = (ticket, gate)
            if best is not None and not earliest:
                return best
        return best

    def used(self, tier: int, now: float) -> float:
        """How much of its ``max_wait_s`` the most pressed queued call of ``tier`` (on any
        provider) has used."""
        left = self._queues.earliest_deadline(tier) - now
        return 1.0 - left / self._tiers[tier].max_wait_s

    def at_risk(self, tier: int, deadline: float, now: float) -> bool:
        """Less than ``rescue_fraction`` of the tier's ``max_wait_s`` is left."""
        return deadline - now < self.settings.rescue_fraction * self._tiers[tier].max_wait_s

    def fits(self, pool: Pool, tier: int, now: float) -> bool:
        """The recent offered load of ``tier`` and the more urgent tiers fits the
        provider's slots: lending to it can save its calls, not merely delay others'.
        Load is arrivals x the service time calls of the tier really took (what they
        claimed until one came back)."""
        served = self._served.get(pool.name)
        load = 0.0
        for t in range(tier + 1):
            typical = None if served is None else served[t]
            load += (self._headroom.offered(pool.name, t, now) if typical is None
                     else self._headroom.rate(pool.name, t, now) * typical)
        return load <= pool.limit

    def claim(self, pool: str, ticket: Ticket) -> float:
        """What a call is charged until its real service time is known: its estimate, but
        never more than ``CLAIM_FACTOR`` times the provider's mean (the longest level's
        bound until a mean is known), so a call that lies about its size cannot borrow
        against its tier's share or the headroom."""
        typical = self.means.get(pool)
        cap = (self.settings.level_bounds_s[-1] if typical is None
               else CLAIM_FACTOR * (1.0 if typical < 1.0 else typical))
        estimate = ticket.est_service_s  # conditions, not min()/max(): 5x cheaper on 3.11
        return cap if cap < estimate else estimate

    def mean_service(self, pool: str) -> float | None:
        return self.means.get(pool)

    def served(self, pool: str, tier: int, service_s: float) -> None:
        """A call of ``tier`` held a slot of ``pool`` for ``service_s``."""
        old = self.means.get(pool, service_s)
        self.means[pool] = old + _SERVICE_EWMA_ALPHA * (service_s - old)
        per_tier = self._served.get(pool)
        if per_tier is None:
            per_tier = self._served[pool] = [None] * len(self._tiers)
        seen = per_tier[tier]
        per_tier[tier] = (service_s if seen is None
                          else seen + _SERVICE_EWMA_ALPHA * (service_s - seen))

    def held_against(self, pool: Pool, tier: int, now: float) -> int:
        return self._headroom.held_against(pool.name, tier, now, self.reserves, pool.running,
                                           pool.limit)

    def held(self, pool: Pool, now: float) -> list[int]:
        return self._headroom.held(pool.name, now, self.reserves, pool.running, pool.limit)

    def hold_lapse(self, pool: Pool, tier: int, now: float) -> float | None:
        """When a hold on ``pool``'s free slots against ``tier`` may next stop applying:
        it lapses, or the tier's most pressed call has used ``HOLD_PATIENCE`` of its wait."""
        free = pool.free(now)
        soonest = self._headroom.lapse_time(pool.name, tier, free - 1, now, self.reserves,
                                            pool.running, pool.limit)
        if soonest is not None and soonest <= now:
            soonest = None
        spec = self._tiers[tier]
        patient = self._queues.earliest_deadline(tier) - (1.0 - HOLD_PATIENCE) * spec.max_wait_s
        if now < patient < math.inf:
            soonest = patient if soonest is None else min(soonest, patient)
        return soonest

    def set_reserves(self, reserves: Sequence[int | None]) -> None:
        self.reserves = list(reserves)


def _open_gate(lane: Lane, pool: str, now: float) -> Gate | None:
    for gate in lane.gates[pool]:
        if gate.open(now):
            return gate
    return None
