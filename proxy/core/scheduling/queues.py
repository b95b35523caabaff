"""Where waiting tickets live: heaps with lazy removal, so every question is cheap.

- Cohorts, one per (tier, level, candidate tuple): heaps ordered by the calls' virtual
  starts (``shares``; arrival order for one key), and a call that comes back (a
  re-try) goes back to its place instead of the tail.
- A level ages as a whole: its *standing* rises one level each time its oldest call has
  waited there long enough, and it is then served in its own order. A call never leaves
  its level for a younger one of another key to wait behind it: moving an old call up
  alone would turn a key's backlog, once aged, into a queue ahead of every fresh call of
  its level, whatever the keys' shares.
- One heap each for tier promotion and deadlines, ordered by when they fall due, so
  expiry is exact whatever order calls entered in.
- Per tier, the newest arrival first (the eviction victim).

A ticket that leaves or moves is not searched for: every entry records the ticket's
``epoch`` (bumped on every move) or ``visit`` (bumped on every pass through the queue),
and an entry that no longer matches is skipped when it reaches the top. When stale
entries outnumber live ones the heaps are rebuilt from the live tickets, so memory stays
bounded and the cost amortised O(log n).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from .backlog import Backlog
from .capacity import Gate
from .tickets import QUEUED, Ticket, TicketState

# A queued ticket has at most seven live entries (three in its cohort, newest, promotion
# and two deadlines): rebuild once the entries exceed twice that per live
# ticket, plus a constant.
_STALE_FACTOR = 14
_COMPACT_SLACK = 4096

Entry = tuple[float, int, int, Ticket]  # (sort key, order, epoch or visit, ticket)
Row = tuple[str, list[int], list[float]]  # a pool's name, its counts and seconds per tier


class Cohort:
    """Tickets of one tier and level with the same candidates: by virtual start
    (``head``), by deadline (``earliest``) and, above level 0, by arrival (``oldest``)."""

    __slots__ = ("candidates", "climb", "due", "gates", "heap", "level", "old", "tier")

    def __init__(self, tier: int, level: int, candidates: tuple[str, ...],
                 gates: dict[str, tuple[Gate, ...]], climb: tuple[float, ...]) -> None:
        self.tier = tier
        self.level = level
        self.candidates = candidates
        self.gates = gates  # per pool, the candidates' gates in preference order
        # The waits of its oldest call at which the level stands one more level up.
        self.climb = climb
        self.heap: list[tuple[float, int, int, Ticket]] = []
        self.due: list[Entry] = []
        self.old: list[tuple[int, int, Ticket]] = []  # (order, epoch, ticket): by arrival

    def head(self) -> Ticket | None:
        """The earliest virtual start (of one key: the oldest arrival)."""
        heap = self.heap
        while heap:
            _, _, epoch, ticket = heap[0]
            if ticket.epoch == epoch and ticket.state is QUEUED:
                return ticket
            heapq.heappop(heap)
        return None

    def earliest(self) -> Ticket | None:
        """The earliest deadline."""
        due = self.due
        while due:
            _, _, epoch, ticket = due[0]
            if ticket.epoch == epoch and ticket.state is QUEUED:
                return ticket
            heapq.heappop(due)
        return None

    def pick(self, now: float) -> tuple[Ticket | None, int]:
        """The call to serve next and the level the cohort is served at now (its
        *standing*): its own level, less one for each step of ``climb`` its oldest call has
        waited. The earliest virtual start goes first, but a level that stands higher
        because a key's own oldest call aged serves that call (arrival order within a key,
        as before the level aged)."""
        heap = self.heap  # head(), inlined: this runs for every cohort on every pass
        while heap:
            _, _, epoch, head = heap[0]
            if head.epoch == epoch and head.state is QUEUED:
                break
            heapq.heappop(heap)
        else:
            return None, 0
        level = self.level
        if not level:
            return head, 0
        old = self.old
        while old:
            _, epoch, oldest = old[0]
            if oldest.epoch == epoch and oldest.state is QUEUED:
                standing = level - bisect.bisect_right(self.climb, now - oldest.arrived)
                return (oldest if standing < level and oldest.key == head.key else head,
                        standing)
            heapq.heappop(old)
        return head, level

GateResolver = Callable[[tuple[str, ...]], dict[str, tuple[Gate, ...]]]


class TicketQueues:
    def __init__(self, tiers: int, levels: int, promote_after_s: Sequence[Sequence[float]],
                 tier_promote_after_s: Sequence[float], resolve: GateResolver,
                 backlog: Backlog, on_count: Callable[[int, str, int], None] | None = None,
                 ) -> None:
        """``promote_after_s[tier][level]``: how long a level of a tier waits before it
        stands one level up (counted from its oldest call's arrival, level after level)."""
        self._tiers = tiers
        self._levels = levels
        self._climb = tuple(
            tuple(tuple(c for c in itertools.accumulate(after[level:0:-1]) if c < math.inf)
                  for level in range(levels))
            for after in promote_after_s)
        self._on_count = on_count  # (tier, key, +1 / -1) whenever a ticket joins or leaves
        # (pool, tier) whenever a ticket leaving a tier (served, cancelled, refused, moved up
        # a tier) leaves none of that tier waiting for the pool.
        self.on_emptied: Callable[[str, int], None] | None = None
        self._tier_promote_after = tuple(tier_promote_after_s)
        self._resolve = resolve
        self.backlog = backlog
        self._cohorts: dict[tuple[int, int, tuple[str, ...]], Cohort] = {}
        self._cohorts_for: dict[str, list[list[list[Cohort]]]] = {}
        self._rows_of: dict[tuple[str, ...], tuple[Row, ...]] = {}
        self._names_of: dict[tuple[str, ...], tuple[str, ...]] = {}  # the rows' pools
        self._promotions: list[Entry] = []
        self._deadlines: list[Entry] = []
        self._newest: list[list[tuple[int, int, Ticket]]] = [[] for _ in range(tiers)]
        self._due: list[list[Entry]] = [[] for _ in range(tiers)]  # deadlines per tier
        self._live: dict[Ticket, None] = {}
        self.queued = 0  # len(_live), kept as a plain attribute: it is read on every step
        self._entries = 0
        self.depth = [0] * tiers
        self.level_depth = [[0] * levels for _ in range(tiers)]
        self.queued_s = [0.0] * tiers
        self._pool_count: dict[str, list[int]] = {}
        self._pool_s: dict[str, list[float]] = {}

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._live))

    def count(self, pool: str, tier: int) -> int:
        """Queued tickets of ``tier`` that ``pool`` could serve."""
        counts = self._pool_count.get(pool)
        return 0 if counts is None else counts[tier]

    def counts(self, pool: str) -> list[int]:
        """Queued tickets per tier that ``pool`` could serve."""
        counts = self._pool_count.get(pool)
        return [0] * self._tiers if counts is None else counts

    def pool_seconds(self, pool: str, tier: int) -> float:
        """Estimated service seconds of the queued tickets of ``tier`` ``pool`` could serve."""
        seconds = self._pool_s.get(pool)
        return 0.0 if seconds is None else seconds[tier]

    def add(self, ticket: Ticket) -> None:
        """Queue a ticket whose tier, level, arrival order, times and state the caller has
        set."""
        self._live[ticket] = None
        self.queued = len(self._live)
        self._push(self._deadlines, ticket.deadline, ticket, ticket.order)
        if not ticket.promoted and ticket.current_tier > ticket.ceiling:
            due = ticket.arrived + self._tier_promote_after[ticket.current_tier]
            if math.isfinite(due):
                self._push(self._promotions, due, ticket, ticket.order)
        self._join(ticket)

    def discard(self, ticket: Ticket, state: TicketState) -> None:
        """Take a queued ticket out; its entries go stale."""
        ticket.state = state
        del self._live[ticket]
        self.queued = len(self._live)
        self._count(ticket, -1)
        self._emptied(ticket, ticket.current_tier)
        if self._entries > _STALE_FACTOR * self.queued + _COMPACT_SLACK:
            self._compact()

    def levels(self, pool: str, tier: int) -> list[list[Cohort]]:
        """Per level, top first, the cohorts of ``tier`` that ``pool`` could serve."""
        per_tier = self._cohorts_for.get(pool)
        return [] if per_tier is None else per_tier[tier]

    def promote_tiers(self, now: float, virtual: Sequence[float]) -> None:
        """Move every ticket that waited long enough in its own tier up one tier, once, and
        never above its ceiling; it starts there at the tier's virtual time ``virtual``."""
        heap = self._promotions
        while heap and heap[0][0] <= now:
            _, _, visit, ticket = heapq.heappop(heap)
            self._entries -= 1
            if (ticket.visit != visit or ticket.state is not QUEUED
                    or ticket.promoted or ticket.current_tier <= ticket.ceiling):
                continue
            ticket.promoted = True
            ticket.tag = virtual[ticket.current_tier - 1]
            self._move(ticket, ticket.current_tier - 1)

    def promotes(self, tier: int) -> bool:
        """Whether a call of ``tier`` may move up a tier before its deadline."""
        return self._tier_promote_after[tier] < math.inf

    def next_tier_promotion(self) -> float:
        return self._peek(self._promotions, promotion=True)

    def pop_expired(self, now: float) -> list[Ticket]:
        """Queued tickets whose deadline has passed, earliest first; the caller discards
        each."""
        out: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, visit, ticket = heapq.heappop(heap)
            self._entries -= 1
            if ticket.visit == visit and ticket.state is QUEUED:
                out.append(ticket)
        return out

    def next_deadline(self) -> float:
        return self._peek(self._deadlines)

    def newest(self, tier: int) -> Ticket | None:
        """The latest arrival still queued in ``tier``."""
        heap = self._newest[tier]
        while heap:
            _, epoch, ticket = heap[0]
            if ticket.epoch == epoch and ticket.state is QUEUED:
                return ticket
            heapq.heappop(heap)
            self._entries -= 1
        return None

    def overflow(self, ticket: Ticket, tier_limit: int | None, limit: int) -> Ticket | None:
        """Past a bound once ``ticket`` joined: the call to refuse — the latest arrival of
        the least urgent tier if that is less urgent than ``ticket`` and only the total
        bound is passed (evicted), else ``ticket`` itself (queue full); None: within."""
        tier = ticket.current_tier
        depth = self.depth
        over_tier = tier_limit is not None and depth[tier] > tier_limit
        if not over_tier and self.queued <= limit:
            return None
        if not over_tier:
            victim_tier = max(i for i, d in enumerate(depth) if d)
            victim = self.newest(victim_tier)
            if victim_tier > tier and victim is not None:
                return victim
        return ticket

    def earliest_deadline(self, tier: int) -> float:
        """The earliest deadline of a ticket queued in ``tier`` now."""
        heap = self._due[tier]
        while heap:
            deadline, _, epoch, ticket = heap[0]
            if ticket.epoch == epoch and ticket.state is QUEUED:
                return deadline
            heapq.heappop(heap)
            self._entries -= 1
        return math.inf

    def snapshot(self, tier: int, now: float) -> dict[str, object]:
        oldest = min((t.arrived for t in self._live if t.current_tier == tier), default=now)
        return {
            "depth": self.depth[tier],
            "by_level": list(self.level_depth[tier]),
            "oldest_wait_s": round(now - oldest, 3),
            "queued_service_s": round(self.queued_s[tier], 3),
        }

    def _peek(self, heap: list[Entry], promotion: bool = False) -> float:
        while heap:
            _, _, visit, ticket = heap[0]
            if ticket.visit == visit and ticket.state is QUEUED and not (
                    promotion and (ticket.promoted or ticket.current_tier <= ticket.ceiling)):
                return heap[0][0]
            heapq.heappop(heap)
            self._entries -= 1
        return math.inf

    def _push(self, heap: list[Entry], key: float, ticket: Ticket, order: int) -> None:
        heapq.heappush(heap, (key, order, ticket.visit, ticket))
        self._entries += 1

    def _join(self, ticket: Ticket) -> None:
        """Enter the cohort of the ticket's tier and level."""
        tier, level, order = ticket.current_tier, ticket.level, ticket.order
        epoch = ticket.epoch = ticket.epoch + 1
        cohort = self._cohort(tier, level, ticket.candidates)
        due = (ticket.deadline, order, epoch, ticket)  # one entry in two heaps
        heapq.heappush(cohort.heap, (ticket.tag, order, epoch, ticket))
        heapq.heappush(cohort.due, due)
        heapq.heappush(self._newest[tier], (-order, epoch, ticket))
        heapq.heappush(self._due[tier], due)
        self._entries += 4
        if level > 0 and cohort.climb:
            heapq.heappush(cohort.old, (order, epoch, ticket))
            self._entries += 1
        self._count(ticket, +1)

    def _move(self, ticket: Ticket, tier: int) -> None:
        self._count(ticket, -1)
        self._emptied(ticket, ticket.current_tier)
        ticket.current_tier = tier
        self._join(ticket)

    def _count(self, ticket: Ticket, delta: int) -> None:
        tier = ticket.current_tier
        if self._on_count is not None:
            self._on_count(tier, ticket.key, delta)
        self.depth[tier] += delta
        self.level_depth[tier][ticket.level] += delta
        seconds = delta * ticket.est_service_s
        self.queued_s[tier] += seconds
        rows = self._rows_of.get(ticket.candidates)
        if rows is None:
            rows = self._rows(ticket.candidates)
        for _, counts, pool_s in rows:
            counts[tier] += delta
            pool_s[tier] += seconds
        self.backlog.count(ticket, self._names_of[ticket.candidates], delta)

    def _emptied(self, ticket: Ticket, tier: int) -> None:
        """``ticket`` has just left ``tier``: tell ``on_emptied`` of the pools it left with
        none of the tier waiting."""
        if self.on_emptied is not None:
            for pool, counts, _ in self._rows_of[ticket.candidates]:
                if not counts[tier]:
                    self.on_emptied(pool, tier)

    def _rows(self, candidates: tuple[str, ...]) -> tuple[Row, ...]:
        """Per pool the candidates could use: its name, counts and seconds per tier."""
        rows = []
        for pool in self._resolve(candidates):
            rows.append((pool, self._pool_count.setdefault(pool, [0] * self._tiers),
                         self._pool_s.setdefault(pool, [0.0] * self._tiers)))
        found = self._rows_of[candidates] = tuple(rows)
        self._names_of[candidates] = tuple(row[0] for row in rows)
        return found

    def _cohort(self, tier: int, level: int, candidates: tuple[str, ...]) -> Cohort:
        cohort = self._cohorts.get((tier, level, candidates))
        if cohort is None:
            gates = self._resolve(candidates)
            cohort = Cohort(tier, level, candidates, gates, self._climb[tier][level])
            self._cohorts[(tier, level, candidates)] = cohort
            for pool in gates:
                per_tier = self._cohorts_for.setdefault(
                    pool, [[[] for _ in range(self._levels)] for _ in range(self._tiers)]
                )
                per_tier[tier][level].append(cohort)
        return cohort

    def _compact(self) -> None:
        """Rebuild every heap from the live tickets (each in one pass)."""
        self._due = [[] for _ in range(self._tiers)]
        for cohort in self._cohorts.values():
            cohort.heap = [entry for entry in cohort.heap
                         if entry[3].epoch == entry[2] and entry[3].state is QUEUED]
            heapq.heapify(cohort.heap)
            cohort.due = [entry for entry in cohort.due
                        if entry[3].epoch == entry[2] and entry[3].state is QUEUED]
            self._due[cohort.tier] += cohort.due  # the same live entries
            heapq.heapify(cohort.due)
            cohort.old = [entry for entry in cohort.old
                          if entry[2].epoch == entry[1] and entry[2].state is QUEUED]
            heapq.heapify(cohort.old)
        for due in self._due:
            heapq.heapify(due)
        self._newest = [[] for _ in range(self._tiers)]
        for t in self._live:
            self._newest[t.current_tier].append((-t.order, t.epoch, t))
        for heap in self._newest:
            heapq.heapify(heap)
        for name in ("_promotions", "_deadlines"):
            kept = [e for e in getattr(self, name)
                    if e[3].visit == e[2] and e[3].state is QUEUED]
            heapq.heapify(kept)
            setattr(self, name, kept)
        self._entries = (sum(len(c.heap) + len(c.due) + len(c.old)
                             for c in self._cohorts.values())
                         + sum(map(len, self._newest)) + sum(map(len, self._due))
                         + len(self._promotions) + len(self._deadlines))
