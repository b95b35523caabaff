"""Where waiting tickets live: FIFO lanes per (tier, level, candidate set), with lazy removal.

Every structure is a deque appended in time order, so aging, expiry and promotion only
ever look at heads. A ticket that leaves (dispatched, cancelled, rejected) or moves (level
or tier promotion) is not searched for; its old entries become stale and are skipped when
they reach a head. When stale entries outnumber live ones, everything is rebuilt once,
which keeps memory bounded and the cost amortised O(1). A ticket that moves is stamped
with the time its move fell due, not the time it was noticed, so a wait is never counted
twice; that can leave it a little out of order in its new aging deque, which delays its
next move by at most the gap between two looks.

Each queued ticket has one entry in a lane (tier, level, candidate set), one in an aging
deque (tier, level) when its level can still be promoted, and one in an arrival deque of
its current tier: ``native`` for tickets that arrived in that tier, ``promoted`` for
tickets that moved up into it. Both arrival deques are in deadline order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from .scheduler_types import Ticket, TicketState

Lane = deque[Ticket]
# Rebuild once the entries (at most three live ones per ticket) exceed twice that plus this.
_COMPACT_SLACK = 4096


class TicketQueues:
    def __init__(self, tiers: int, levels: int, promote_after_s: Sequence[float],
                 tier_promote_after_s: Sequence[float]) -> None:
        self._tiers = tiers
        self._levels = levels
        self._promote_after = tuple(promote_after_s)
        self._tier_promote_after = tuple(tier_promote_after_s)
        self._lanes: dict[tuple[int, int, frozenset[str]], Lane] = {}
        self._lanes_for: dict[str, list[list[list[Lane]]]] = {}
        self._cset: dict[tuple[str, ...], frozenset[str]] = {}
        self._aging = [[Lane() for _ in range(levels)] for _ in range(tiers)]
        self._native = [Lane() for _ in range(tiers)]
        self._promoted = [Lane() for _ in range(tiers)]
        self.depth = [0] * tiers
        self.level_depth = [[0] * levels for _ in range(tiers)]
        self.queued_s = [0.0] * tiers
        self._by_provider: dict[str, list[int]] = {}
        self._entries = 0
        self._queued = 0
        self._next_order = 0
        self._next_seq = 0
        self._next_aging = math.inf
        self._next_tier_promotion = math.inf

    @property
    def queued(self) -> int:
        return self._queued

    def count(self, provider: str, tier: int) -> int:
        """Queued tickets of ``tier`` that ``provider`` could serve."""
        counts = self._by_provider.get(provider)
        return 0 if counts is None else counts[tier]

    def add(self, ticket: Ticket) -> None:
        """Queue a ticket whose tier, level, times and state the caller has set."""
        ticket.order = self._next_order
        self._next_order += 1
        self._native[ticket.current_tier].append(ticket)
        self._next_tier_promotion = min(
            self._next_tier_promotion,
            ticket.arrived + self._tier_promote_after[ticket.current_tier],
        )
        self._entries += 1
        self._join(ticket)

    def discard(self, ticket: Ticket, state: TicketState) -> None:
        """Take a queued ticket out; its entries go stale."""
        ticket.state = state
        self._count(ticket, -1)
        self._queued -= 1
        if self._entries > 2 * 3 * self._queued + _COMPACT_SLACK:
            self._compact()

    def head(self, tier: int, provider: str) -> Ticket | None:
        """The ticket ``provider`` should take from ``tier``: top level first, then FIFO."""
        if self.count(provider, tier) == 0:
            return None
        for level, lanes in enumerate(self._lanes_for[provider][tier]):
            best: Ticket | None = None
            for lane in lanes:
                self._clean_lane(lane, tier, level)
                if lane and (best is None or lane[0].seq < best.seq):
                    best = lane[0]
            if best is not None:
                return best
        return None

    def age(self, now: float) -> None:
        """Move every ticket that waited long enough at its level up one level (bottom
        levels first, so a long wait can carry a ticket up several levels at once)."""
        if now < self._next_aging:
            return
        self._next_aging = math.inf
        soonest = math.inf
        for tier in range(self._tiers):
            for level in range(self._levels - 1, 0, -1):
                dq = self._aging[tier][level]
                after = self._promote_after[level]
                while dq:
                    self._clean_lane(dq, tier, level)
                    if not dq:
                        break
                    due = dq[0].entered_level + after
                    if due > now:
                        soonest = min(soonest, due)
                        break
                    self._entries -= 1
                    self._move(dq.popleft(), tier, level - 1, due)
        self._next_aging = min(self._next_aging, soonest)

    def promote_tiers(self, now: float) -> None:
        """Move every ticket that waited long enough in the tier it arrived in up one tier."""
        if now < self._next_tier_promotion:
            return
        for tier in range(1, self._tiers):
            after = self._tier_promote_after[tier]
            dq = self._native[tier]
            while True:
                self._clean_arrivals(dq)
                if not dq or dq[0].arrived + after > now:
                    break
                ticket = dq.popleft()
                self._promoted[tier - 1].append(ticket)
                self._move(ticket, tier - 1, ticket.level, ticket.entered_level)
        self._next_tier_promotion = self.next_tier_promotion()

    def next_tier_promotion(self, tier: int | None = None) -> float:
        """When the next ticket (of ``tier``, or of any tier) moves up a tier."""
        soonest = math.inf
        for t in range(1, self._tiers) if tier is None else (tier,):
            dq = self._native[t]
            self._clean_arrivals(dq)
            if dq:
                soonest = min(soonest, dq[0].arrived + self._tier_promote_after[t])
        return soonest

    def pop_expired(self, now: float) -> list[Ticket]:
        """Queued tickets whose deadline has passed; the caller must discard each."""
        out: list[Ticket] = []
        for dq in (*self._native, *self._promoted):
            while True:
                self._clean_arrivals(dq)
                if not dq or dq[0].deadline > now:
                    break
                out.append(dq.popleft())
                self._entries -= 1
        return out

    def next_deadline(self) -> float:
        soonest = math.inf
        for dq in (*self._native, *self._promoted):
            self._clean_arrivals(dq)
            if dq:
                soonest = min(soonest, dq[0].deadline)
        return soonest

    def oldest_arrival(self, tier: int) -> float:
        oldest = math.inf
        for dq in (self._native[tier], self._promoted[tier]):
            self._clean_arrivals(dq)
            if dq:
                oldest = min(oldest, dq[0].arrived)
        return oldest

    def newest(self, tier: int) -> Ticket | None:
        """The most recently queued ticket of ``tier``."""
        newest: Ticket | None = None
        for dq in (self._native[tier], self._promoted[tier]):
            while dq and dq[-1].state is not TicketState.QUEUED:
                dq.pop()
                self._entries -= 1
            if dq and (newest is None or dq[-1].order > newest.order):
                newest = dq[-1]
        return newest

    def _join(self, ticket: Ticket) -> None:
        """Put a ticket at the tail of the lane and aging deque of its tier and level."""
        tier, level = ticket.current_tier, ticket.level
        ticket.seq = self._next_seq
        self._next_seq += 1
        self._lane(tier, level, ticket.candidates).append(ticket)
        self._entries += 1
        if level > 0:
            self._aging[tier][level].append(ticket)
            self._entries += 1
            self._next_aging = min(self._next_aging,
                                   ticket.entered_level + self._promote_after[level])
        self._count(ticket, +1)
        self._queued += 1

    def _move(self, ticket: Ticket, tier: int, level: int, entered: float) -> None:
        """Re-queue at the tail of another (tier, level); ``entered`` is when the move
        became due, so a late look at the queue does not delay the next move."""
        self._count(ticket, -1)
        self._queued -= 1
        ticket.current_tier = tier
        ticket.level = level
        ticket.entered_level = entered
        self._join(ticket)

    def _count(self, ticket: Ticket, delta: int) -> None:
        tier = ticket.current_tier
        self.depth[tier] += delta
        self.level_depth[tier][ticket.level] += delta
        self.queued_s[tier] += delta * ticket.est_service_s
        for provider in self._cset[ticket.candidates]:
            self._by_provider[provider][tier] += delta

    def _lane(self, tier: int, level: int, candidates: tuple[str, ...]) -> Lane:
        cset = self._cset.get(candidates)
        if cset is None:
            cset = self._cset[candidates] = frozenset(candidates)
        lane = self._lanes.get((tier, level, cset))
        if lane is None:
            lane = self._lanes[(tier, level, cset)] = Lane()
            for provider in cset:
                per_tier = self._lanes_for.setdefault(
                    provider, [[[] for _ in range(self._levels)] for _ in range(self._tiers)]
                )
                per_tier[tier][level].append(lane)
                self._by_provider.setdefault(provider, [0] * self._tiers)
        return lane

    def _clean_lane(self, dq: Lane, tier: int, level: int) -> None:
        while dq and not _in_place(dq[0], tier, level):
            dq.popleft()
            self._entries -= 1

    def _clean_arrivals(self, dq: Lane) -> None:
        while dq and dq[0].state is not TicketState.QUEUED:
            dq.popleft()
            self._entries -= 1

    def _compact(self) -> None:
        for (tier, level, _), lane in self._lanes.items():
            self._keep(lane, tier, level)
        for tier in range(self._tiers):
            for level in range(1, self._levels):
                self._keep(self._aging[tier][level], tier, level)
            self._keep(self._native[tier], None, None)
            self._keep(self._promoted[tier], None, None)

    def _keep(self, dq: Lane, tier: int | None, level: int | None) -> None:
        """Drop stale entries: out of place for a lane (tier, level), or no longer queued."""
        if tier is None or level is None:
            kept = [t for t in dq if t.state is TicketState.QUEUED]
        else:
            kept = [t for t in dq if _in_place(t, tier, level)]
        self._entries += len(kept) - len(dq)
        dq.clear()
        dq.extend(kept)


def _in_place(ticket: Ticket, tier: int, level: int) -> bool:
    return (ticket.state is TicketState.QUEUED and ticket.current_tier == tier
            and ticket.level == level)
