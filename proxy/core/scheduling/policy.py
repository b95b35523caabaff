"""Which waiting call a free slot of a provider goes to.

For each free slot of a provider, among the calls that may use it:

1. *Floors* (``floors``). A tier owed its floor (at least one longest call
   behind its weight's share of the provider's slot-seconds) goes first, the most owed
   first; but while the most urgent waiting tier keeps calls waiting, floors are granted
   ahead of it at most the slot-seconds its share lets them beside what it was granted
   meanwhile (``w_others / w_urgent`` times it), so a debt is paid between its calls, not
   as a run of calls ahead of all of them (what a call took beyond its claim counts when
   its slot comes back, ``repace``). A floor ahead of its pace is offered the slot after
   the urgent tier: it takes one the headroom keeps from urgent if its own call may pass
   the hold (rule 4).
2. *Urgency.* Otherwise the most urgent tier with a call waiting (tiers of weight 0, the
   background, after every other).
3. *Within a tier*: a call at risk (less than ``rescue_fraction`` of its ``max_wait_s``
   left) first, in deadline order, unless its key started more than one of the tier's
   longest calls after the key that would go next (a burst past its share is not rescued
   ahead of a key within it); else the top level (short calls first), and within a
   level the key with the earliest virtual start (``shares``), so keys share
   the tier by weight; a level stands one higher each time its oldest call has waited
   ``promote_after_s[level]`` or ``LEVEL_AGING`` of its tier's ``max_wait_s``, whichever
   is sooner (``parts``), and is served there in its own order, so aging
   never puts one key's old calls ahead of another key's fresh ones of the same size; a
   call moves up one tier after ``tier_promote_after_s`` (off by default), once, never
   above its ``ceiling``.
4. *Headroom* (``headroom``): a call that has used less than half of its
   ``max_wait_s`` may not take the last free slots held for more urgent arrivals; never
   every slot, and never beyond the more urgent tiers' floors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from .capacity import Gate, Pool
from .floors import CAP_CALLS, Floors
from .headroom import Headroom
from .queues import Cohort, TicketQueues
from .tickets import SchedulerSettings, Ticket

# A headroom hold keeps a free slot from a waiting call only until the call has used this
# fraction of its tier's max_wait_s.
HOLD_PATIENCE = 0.5
# Weight of the newest sample in the means of observed service times.
_SERVICE_EWMA_ALPHA = 0.1
# The longest recent service time: the largest seen, shrinking by half every this many
# seconds (so a long call is remembered for some minutes, however many short ones follow).
LONGEST_HALF_LIFE_S = 300.0
_LONGEST_REFRESH_S = 1.0
# Until its slot comes back, a call is charged at most this many times its provider's mean.
CLAIM_FACTOR = 4.0

Choice = tuple[Ticket, Gate]


class Policy:
    def __init__(self, settings: SchedulerSettings, queues: TicketQueues, floors: Floors,
                 headroom: Headroom) -> None:
        self.settings = settings
        self.reserves: list[int | None] = [t.reserve for t in settings.tiers]
        self._tiers = settings.tiers
        self._queues = queues
        self.floors = floors
        self._headroom = headroom
        self.means: dict[str, float] = {}  # mean service seconds, per provider
        # The longest recent service seconds of each tier's calls, per provider, and when
        # each was last updated.
        self.longest: dict[str, list[float]] = {}
        self._longest_at_stamp: dict[str, list[float]] = {}
        self._longest_cache: dict[str, tuple[float, list[float]]] = {}
        self.holding = 0  # free slots the last choose() kept for an adaptive hold
        # Per provider, while its most urgent waiting tier stays the same: [that tier,
        # slot-seconds granted to floors ahead of it, slot-seconds granted to it].
        self._paced: dict[str, list[float]] = {}
        # Per provider and tier, what the calls running claimed beyond the cap they were
        # charged (``claim``), at most one of the tier's longest calls each: a tier is not
        # owed on credit they are about to use.
        self.uncharged: dict[str, list[float]] = {}
        self.set_weights([t.weight for t in settings.tiers])

    def set_weights(self, weights: Sequence[float]) -> None:
        self.floors.weights = weights
        self._headroom.shares = list(self.floors.shares)
        # The order urgency serves tiers in: the list's, the background (weight 0) last.
        self.urgency = sorted(range(len(weights)), key=lambda t: (not weights[t], t))
        self._paced.clear()  # an episode's pace was set by the shares before

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
            waiting = [t for t in self.urgency if queues.count(pool.name, t)]
            if not waiting:
                continue
            soonest = min(soonest, pool.next_change(now),
                          *(g.next_change(now) for g in pool.deployments))
            held_tier = next((t for t in waiting if self.head(pool, t, now)), None)
            if pool.free(now) <= 0 or held_tier is None:
                continue
            # A free slot and a call that could take it: only a hold keeps them apart, from
            # the most urgent tier and from the one owed its floor.
            soonest = min(soonest, queues.next_tier_promotion())
            owed = self.owed_tier(pool, queues.counts(pool.name), held_tier, now)
            for tier in (held_tier,) if owed is None else (held_tier, owed):
                lapse = self.hold_lapse(pool, tier, now)
                if lapse is not None:
                    soonest = min(soonest, lapse)
        return soonest if math.isfinite(soonest) else None

    def choose(self, pool: Pool, now: float) -> Choice | None:
        """The call ``pool``'s next free slot goes to, with its gate; None: none may have it
        now (nothing eligible, or a hold keeps the slot)."""
        self.holding = 0
        counts = self._queues.counts(pool.name)
        urgent_head: Choice | None = None
        for urgent in self.urgency:
            if counts[urgent]:
                urgent_head = self.head(pool, urgent, now)
                if urgent_head is not None:
                    break
        if urgent_head is None:
            return None
        order: tuple[tuple[int, Choice], ...] = ((urgent, urgent_head),)
        paced = self._paced.get(pool.name)
        if paced is None or paced[0] != urgent:
            paced = self._paced[pool.name] = [urgent, 0.0, 0.0]
        owed = self.owed_tier(pool, counts, urgent, now)
        if owed is not None:
            owed_head = self.head(pool, owed, now)
            if owed_head is not None:  # else its calls cannot use this provider now
                share = self.floors.shares[urgent]
                if not share or paced[1] * share <= paced[2] * (1.0 - share):
                    order = ((owed, owed_head), (urgent, urgent_head))
                else:  # ahead of its pace: only a slot the headroom keeps from urgent
                    order = ((urgent, urgent_head), (owed, owed_head))
        free = pool.free(now)
        headroom, reserves, running, limit = self._headroom, self.reserves, pool.running, pool.limit
        for tier, head in order:
            left = self._queues.earliest_deadline(tier) - now  # of its most pressed call
            max_wait_s = self._tiers[tier].max_wait_s
            if (free > headroom.held_against(pool.name, tier, now, reserves, running, limit)
                    or 1.0 - left / max_wait_s >= HOLD_PATIENCE):
                if left < self.settings.rescue_fraction * max_wait_s:  # at risk
                    # ... unless its key is past another's share by more than _behind allows
                    rescue = self.head(pool, tier, now, earliest=True)
                    if rescue is not None and (rescue[0].key == head[0].key or not self._behind(
                            pool, tier, head[0], rescue[0], now)):
                        head = rescue
                ticket = head[0]
                counted = 1 if tier != urgent else 2
                paced[counted] += self.claim(pool.name, ticket)  # and what it took: repace
                ticket.paced_in, ticket.paced_as = paced, counted
                return head
        # Keep the slot for the more urgent arrivals the headroom expects; note how many of
        # the free slots the adaptive part keeps (its allowance counts what it idles; what a
        # fixed reserve keeps is free of it).
        fixed = headroom.held_against(pool.name, urgent, now, reserves, running, limit,
                                      adaptive=False)
        self.holding = free - fixed if free > fixed else 0
        return None

    def emptied(self, pool: str, tier: int) -> None:
        """No call of ``tier`` waits for ``pool`` any more (served, cancelled, refused or
        moved up a tier): a pace against it ends; its next call to wait starts afresh."""
        paced = self._paced.get(pool)
        if paced is not None and paced[0] == tier:
            del self._paced[pool]

    def repace(self, ticket: Ticket, pool: str, delta_s: float, refund: bool) -> None:
        """``ticket``'s slot of ``pool`` came back having taken ``delta_s`` more than it
        claimed: the pace it counted in, if that episode goes on, counts the rest. A call
        that took less is not refunded (a claim too large is capped when it is made), but
        one that gave its slot back unused is (``refund``)."""
        episode, ticket.paced_in = ticket.paced_in, None
        if (delta_s > 0.0 or refund) and episode is not None and episode is self._paced.get(
                pool):
            value = episode[ticket.paced_as] + delta_s
            episode[ticket.paced_as] = value if value > 0.0 else 0.0

    def owed_tier(self, pool: Pool, counts: Sequence[int], urgent: int,
                  now: float) -> int | None:
        """The waiting tier other than ``urgent`` that is most behind its floor on ``pool``,
        if one is at least one of its longest calls behind."""
        credits = self.floors.credits(pool.name)
        if credits is None:
            return None
        owed: int | None = None
        most = 1.0
        longest: list[float] | None = None
        uncharged = self.uncharged.get(pool.name)
        for tier, credit in enumerate(credits):
            if uncharged is not None:
                credit -= uncharged[tier]
            if credit > 0.0 and counts[tier] and tier != urgent:
                if longest is None:
                    longest = self._longest_now(pool.name, now)
                behind = credit / self._unit(longest, tier)
                if behind >= most:
                    owed, most = tier, behind
        return owed

    def head(self, pool: Pool, tier: int, now: float, earliest: bool = False) -> Choice | None:
        """The ticket of ``tier`` that ``pool`` should take, with the first open gate of its
        candidates in this pool: the top standing first (a level stands higher as its oldest
        call ages) and the earliest virtual start within it — unless another key's call
        started more than one of the tier's longest calls earlier (``_behind``); or
        (``earliest``) the earliest deadline whatever the level."""
        if earliest:
            return self._earliest(pool, tier, now)
        name = pool.name
        best: Ticket | None = None
        gate: Gate | None = None
        best_standing = 0
        first: Ticket | None = None  # the earliest virtual start of any level
        first_gate: Gate | None = None
        first_standing = 0
        for cohorts in self._queues.levels(name, tier):
            for cohort in cohorts:
                if not cohort.heap:  # most are empty: not even a call
                    continue
                ticket, standing = cohort.pick(now)
                if ticket is None:
                    continue
                tag, order = ticket.tag, ticket.order  # plain comparisons: hot path
                if best is None or first is None:
                    better = earlier = True
                else:
                    better = standing < best_standing or (standing == best_standing and (
                        tag < best.tag or (tag == best.tag and order < best.order)))
                    earlier = tag < first.tag or (tag == first.tag and order < first.order)
                    if not (better or earlier):
                        continue
                found = _open_gate(cohort, name, now)
                if found is None:
                    continue
                if better:
                    best, gate, best_standing = ticket, found, standing
                if earlier:
                    first, first_gate, first_standing = ticket, found, standing
        if best is None or gate is None:
            return None
        if (first is not None and first_gate is not None and first is not best
                and first.key != best.key and self._behind(pool, tier, first, best, now)):
            best, gate, best_standing = first, first_gate, first_standing
        best.standing = best_standing
        return best, gate

    def _behind(self, pool: Pool, tier: int, first: Ticket, best: Ticket, now: float) -> bool:
        """Whether ``first``'s key started more than one of the tier's longest calls (in
        its virtual time) before ``best``'s call: shorter calls of other keys may go ahead
        of a key only that far, so a key of long calls beside another key's burst of short
        ones waits about one call, not until its level ages."""
        return best.tag - first.tag > self.unit(pool, tier, now)

    def _earliest(self, pool: Pool, tier: int, now: float) -> Choice | None:
        """``head``'s earliest deadline of ``tier`` whatever the level."""
        name = pool.name
        best: Ticket | None = None
        gate: Gate | None = None
        for cohorts in self._queues.levels(name, tier):
            for cohort in cohorts:
                if not cohort.due:
                    continue
                ticket = cohort.earliest()
                if ticket is None:
                    continue
                if best is not None:
                    deadline, best_deadline = ticket.deadline, best.deadline
                    if deadline > best_deadline or (
                            deadline == best_deadline and ticket.order >= best.order):
                        continue
                found = _open_gate(cohort, name, now)
                if found is not None:
                    best, gate = ticket, found
        return None if best is None or gate is None else (best, gate)

    def unit(self, pool: Pool, tier: int, now: float) -> float:
        """One of ``tier``'s longest recent calls on ``pool`` (the provider's, until the
        tier has one): the scale of its floor, served call by call."""
        return self._unit(self._longest_now(pool.name, now), tier)

    def _unit(self, longest: list[float], tier: int) -> float:
        own = longest[tier]
        return own if own else self._longest_of(longest)

    def longest_call(self, pool: Pool, now: float) -> float:
        """The longest recent call of any tier on ``pool``."""
        return self._longest_of(self._longest_now(pool.name, now))

    def _longest_of(self, longest: list[float]) -> float:
        return max(longest) or self.settings.level_bounds_s[0]

    def credit_cap(self, pool: Pool, now: float) -> float:
        """No tier's floor credit grows past this many slot-seconds on ``pool``."""
        return CAP_CALLS * self.longest_call(pool, now)

    def _longest_now(self, pool: str, now: float) -> list[float]:
        """Each tier's longest call on ``pool``, halved for every half-life since it was
        seen; worked out again at most once a second (the half-life is minutes)."""
        cached = self._longest_cache.get(pool)
        if cached is not None and 0.0 <= now - cached[0] < _LONGEST_REFRESH_S:
            return cached[1]
        per_tier = self.longest.get(pool)
        if per_tier is None:
            values = [0.0] * len(self._tiers)
        else:
            values = list(per_tier)
            for tier, at in enumerate(self._longest_at_stamp[pool]):  # a loop: no frame
                if now > at:
                    values[tier] *= 0.5 ** ((now - at) / LONGEST_HALF_LIFE_S)
        self._longest_cache[pool] = (now, values)
        return values

    def claim(self, pool: str, ticket: Ticket) -> float:
        """What a call is charged until its real service time is known: its estimate, but
        never more than ``CLAIM_FACTOR`` times the provider's mean (the longest level's
        bound until a mean is known), so a call that lies about its size cannot borrow
        against its tier's floor or the headroom."""
        typical = self.means.get(pool)
        cap = (self.settings.level_bounds_s[-1] if typical is None
               else CLAIM_FACTOR * (1.0 if typical < 1.0 else typical))
        estimate = ticket.est_service_s  # conditions, not min()/max(): hot path
        return cap if cap < estimate else estimate

    def mean_service(self, pool: str) -> float | None:
        return self.means.get(pool)

    def served(self, pool: str, tier: int, service_s: float, now: float) -> None:
        """A call of ``tier`` held a slot of ``pool`` for ``service_s`` until ``now``."""
        old = self.means.get(pool, service_s)
        self.means[pool] = old + _SERVICE_EWMA_ALPHA * (service_s - old)
        per_tier = self.longest.get(pool)
        if per_tier is None:
            per_tier = self.longest[pool] = [0.0] * len(self._tiers)
            self._longest_at_stamp[pool] = [now] * len(self._tiers)
        stamps = self._longest_at_stamp[pool]
        age = now - stamps[tier]
        kept = per_tier[tier] * 0.5 ** (age / LONGEST_HALF_LIFE_S) if age > 0.0 else (
            per_tier[tier])
        per_tier[tier] = service_s if service_s > kept else kept
        stamps[tier] = now
        self._longest_cache.pop(pool, None)

    def held_against(self, pool: Pool, tier: int, now: float) -> int:
        return self._headroom.held_against(pool.name, tier, now, self.reserves, pool.running,
                                           pool.limit)

    def held(self, pool: Pool, now: float) -> list[int]:
        return self._headroom.held(pool.name, now, self.reserves, pool.running, pool.limit)

    def hold_lapse(self, pool: Pool, tier: int, now: float) -> float | None:
        """When a hold on ``pool``'s free slots against ``tier`` may next stop applying:
        it lapses, its allowance is spent, or the tier's most pressed call has used
        ``HOLD_PATIENCE`` of its wait."""
        free = pool.free(now)
        soonest = self._headroom.lapse_time(pool.name, tier, free - 1, now, self.reserves,
                                            pool.running, pool.limit)
        if soonest is not None and soonest <= now:
            soonest = None
        spent = self._headroom.allowance_end(pool.name, now, pool.limit)
        if spent is not None and spent > now and free > self._headroom.held_against(
                pool.name, tier, now, self.reserves, pool.running, pool.limit, adaptive=False):
            soonest = spent if soonest is None else min(soonest, spent)
        spec = self._tiers[tier]
        patient = self._queues.earliest_deadline(tier) - (1.0 - HOLD_PATIENCE) * spec.max_wait_s
        if now < patient < math.inf:
            soonest = patient if soonest is None else min(soonest, patient)
        return soonest

    def override(self, weights: Mapping[int, float], reserves: Mapping[int, int]) -> None:
        """Weights and fixed reserves in force: the configured ones, but those given."""
        new_weights = [weights.get(i, spec.weight) for i, spec in enumerate(self._tiers)]
        new_reserves = [reserves.get(i, spec.reserve) for i, spec in enumerate(self._tiers)]
        if any(not (w >= 0 and math.isfinite(w)) for w in new_weights):
            raise ValueError("weights must be finite and not negative")
        if any(r is not None and r < 0 for r in new_reserves):
            raise ValueError("reserves must not be negative")
        self.set_weights(new_weights)
        self.reserves = new_reserves


def _open_gate(cohort: Cohort, pool: str, now: float) -> Gate | None:
    for gate in cohort.gates[pool]:
        if gate.open(now):
            return gate
    return None
