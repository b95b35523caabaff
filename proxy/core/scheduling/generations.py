"""Tier numbering across reloads: a reload may drop, add or reorder tiers, so every ticket
remembers which configuration its tier indexes belong to, and is brought up to date (old
tier -> new tier, one reload at a time) whenever the scheduler touches it again."""

from __future__ import annotations

from collections.abc import Sequence

from .tickets import Ticket


class TierMaps:
    def __init__(self) -> None:
        self._maps: list[tuple[int, ...]] = []  # per reload: old tier -> new tier

    @property
    def generation(self) -> int:
        """The configuration in force (0 until the first reload)."""
        return len(self._maps)

    def add(self, tier_map: Sequence[int]) -> None:
        self._maps.append(tuple(tier_map))

    def bring_up(self, ticket: Ticket, levels: int) -> None:
        """The ticket's tiers and level in the configuration in force (a ticket released
        before a reload comes back after it, e.g. to be re-tried)."""
        while ticket.generation < len(self._maps):
            tier_map = self._maps[ticket.generation]
            ticket.tier = tier_map[ticket.tier]
            ticket.ceiling = min(tier_map[ticket.ceiling], ticket.tier)
            ticket.current_tier = max(tier_map[ticket.current_tier], ticket.ceiling)
            ticket.generation += 1
        ticket.level = min(ticket.level, levels - 1)
