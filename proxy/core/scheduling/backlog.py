"""What waits ahead of a new call, kept as calls join and leave the queue, so a forecast
(``forecast``) reads sums instead of walking the queue.

- Per provider: calls and estimated seconds queued per tier and level.
- Per (tier, key, candidates): calls and seconds queued per level, and the keys waiting in
  each tier.
- Per (tier, key, candidates): its *chain*, the calls that arrived one after another, each
  within a small gap of the one before, and still wait. A call arriving at the end of a
  chain has a deadline just after each of theirs: they block it until they start, and
  only in those gaps, if a slot frees there, could it start before one of them is gone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

from .tickets import Ticket

Group = tuple[int, str, tuple[str, ...]]  # (tier, key, candidates)


class _Chain:
    __slots__ = ("id", "last", "live", "seconds")

    def __init__(self, chain_id: int, levels: int) -> None:
        self.id = chain_id
        self.last = -math.inf  # the latest arrival
        self.live = 0  # calls of it still waiting
        self.seconds = [0.0] * levels


class Backlog:
    def __init__(self, tiers: int, levels: int) -> None:
        self._tiers = tiers
        self._levels = levels
        self._pools: dict[str, tuple[list[int], list[float]]] = {}  # by tier * levels + level
        self._groups: dict[Group, tuple[list[int], list[float]]] = {}  # by level
        self._chains: dict[Group, _Chain] = {}
        self._chain_ids = itertools.count(1)
        self.keys_waiting: list[dict[str, int]] = [{} for _ in range(tiers)]

    def count(self, ticket: Ticket, pools: Iterable[str], delta: int) -> None:
        """``ticket`` joined (+1) or left (-1) the queue of its current tier."""
        tier, level, levels = ticket.current_tier, ticket.level, self._levels
        seconds = delta * ticket.est_service_s
        at = tier * levels + level
        for pool in pools:
            found = self._pools.get(pool)
            if found is None:
                found = self._pools[pool] = ([0] * (self._tiers * levels),
                                             [0.0] * (self._tiers * levels))
            _add(found, at, delta, seconds)
        group = (tier, ticket.key, ticket.candidates)
        mine = self._groups.get(group)
        if mine is None:
            mine = self._groups[group] = ([0] * levels, [0.0] * levels)
        _add(mine, level, delta, seconds)
        if not any(mine[0]):
            del self._groups[group]
        waiting = self.keys_waiting[tier]
        left = waiting.get(ticket.key, 0) + delta
        if left > 0:
            waiting[ticket.key] = left
        else:
            waiting.pop(ticket.key, None)
        if delta < 0 and ticket.chain:
            self._unchain(ticket)

    def ahead(self, pool: str, tier: int, level: int) -> tuple[int, float, int, float]:
        """Calls and seconds queued for ``pool`` in more urgent tiers, then in ``tier`` at
        ``level`` or above."""
        found = self._pools.get(pool)
        if found is None:
            return 0, 0.0, 0, 0.0
        counts, seconds = found
        start, upto = tier * self._levels, tier * self._levels + level + 1
        return (sum(counts[:start]), sum(seconds[:start]), sum(counts[start:upto]),
                sum(seconds[start:upto]))

    def below(self, pool: str, tier: int) -> list[int]:
        """The tiers less urgent than ``tier`` with calls queued for ``pool``."""
        found = self._pools.get(pool)
        if found is None:
            return []
        counts, levels = found[0], self._levels
        return [t for t in range(tier + 1, self._tiers)
                if any(counts[t * levels:(t + 1) * levels])]

    def of_group(self, ticket: Ticket) -> tuple[int, float]:
        """Calls and seconds of ``ticket``'s key, tier and candidates queued at its level or
        above."""
        found = self._groups.get((ticket.current_tier, ticket.key, ticket.candidates))
        if found is None:
            return 0, 0.0
        upto = ticket.level + 1
        return sum(found[0][:upto]), sum(found[1][:upto])

    def chained(self, ticket: Ticket, now: float, gap_s: float) -> float:
        """Seconds of ``ticket``'s group's chain still waiting at its level or above, if
        ``ticket`` arrives within ``gap_s`` of its latest call; else none."""
        chain = self._chains.get((ticket.current_tier, ticket.key, ticket.candidates))
        if chain is None or now - chain.last > gap_s:
            return 0.0
        return sum(chain.seconds[:ticket.level + 1])

    def refused(self, ticket: Ticket, now: float) -> None:
        """``ticket`` was refused at once, its chain ahead of it: the next call is as far
        behind that chain as this one was."""
        chain = self._chains.get((ticket.current_tier, ticket.key, ticket.candidates))
        if chain is not None:
            chain.last = now

    def arrived(self, ticket: Ticket, now: float, gap_s: float, seconds: float) -> None:
        """``ticket`` queued now, with its tier's whole wait, counted for ``seconds``: it
        extends its group's chain (arriving within ``gap_s`` of its latest call) or starts
        one."""
        group = (ticket.current_tier, ticket.key, ticket.candidates)
        chain = self._chains.get(group)
        if chain is None or now - chain.last > gap_s:
            chain = self._chains[group] = _Chain(next(self._chain_ids), self._levels)
        chain.last = now
        chain.live += 1
        chain.seconds[ticket.level] += seconds
        ticket.chain, ticket.chain_s = chain.id, seconds

    def _unchain(self, ticket: Ticket) -> None:
        group = (ticket.current_tier, ticket.key, ticket.candidates)
        chain_id, ticket.chain = ticket.chain, 0
        chain = self._chains.get(group)
        if chain is None or chain.id != chain_id:
            return  # its chain was broken since: a later one took its place
        chain.live -= 1
        if chain.live:
            chain.seconds[ticket.level] -= ticket.chain_s
        else:
            del self._chains[group]


def _add(found: tuple[list[int], list[float]], at: int, delta: int, seconds: float) -> None:
    counts, sums = found
    counts[at] += delta
    sums[at] = sums[at] + seconds if counts[at] else 0.0  # no float drift left behind

