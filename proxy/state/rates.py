"""Shared rpm/tpm buckets: one pair per provider and per key in Redis (the ``RATE``
script), a replica's share of each while Redis is away, and what this replica took over
the last minute (``core.health.ledger``), charged again if Redis loses the buckets."""

from __future__ import annotations

import time

from ..core.errors import StateUnavailable
from ..core.health.ledger import Ledger
from ..core.health.limits import RateLimits
from . import scripts
from .link import REDIS_ERRORS, Link


class LocalRates:
    """A replica's share of each shared rpm/tpm limit while Redis is away: the limit over
    the replicas alive."""

    def __init__(self) -> None:
        self._buckets: dict[str, RateLimits] = {}

    def take(self, name: str, rpm: int | None, tpm: int | None, replicas: int, tokens: int,
             now: float) -> float:
        """0.0, or the seconds to wait (nothing taken)."""
        share = max(replicas, 1)
        rates = (None if rpm is None else max(rpm // share, 1),
                 None if tpm is None else max(tpm // share, 1))
        found = self._buckets.get(name)
        if found is None or found.rates != rates:
            found = self._buckets[name] = RateLimits(*rates)
        return found.take(tokens, now)


class SharedRates:
    def __init__(self, link: Link) -> None:
        self._link = link
        self._script = link.client.register_script(scripts.RATE)
        self._local = LocalRates()
        self._ledger = Ledger()

    async def take(self, name: str, rpm: int | None, tpm: int | None, tokens: int) -> float:
        """Take one request and ``tokens`` from ``name``'s shared buckets: 0.0, or the
        seconds to wait (nothing taken). Raises StateUnavailable in reject mode."""
        link = self._link
        if not rpm and not tpm:
            return 0.0
        if link.mode == "shared":
            try:
                ms = await self._script(args=[link.prefix, name, rpm or 0, tpm or 0, 1,
                                              tokens, 1])
            except REDIS_ERRORS as exc:
                link.failed(exc)
            else:
                if not ms:
                    self._ledger.add(name, rpm or 0, tpm or 0, 1, tokens, time.monotonic())
                return int(ms) / 1000
        if link.mode == "reject":
            raise StateUnavailable()
        return self._local.take(name, rpm, tpm, link.alive, tokens, time.monotonic())

    def reconcile(self, name: str, rpm: int | None, tpm: int | None, requests: int,
                  tokens: int) -> None:
        """Give back ``requests`` and ``tokens`` (negative: charge more) to the buckets."""
        if (rpm or tpm) and (requests or tokens) and self._link.mode == "shared":
            self._ledger.add(name, rpm or 0, tpm or 0, -requests, -tokens, time.monotonic())
            self._link.spawn(self._link.call(self._script(
                args=[self._link.prefix, name, rpm or 0, tpm or 0, requests, tokens, 0])))

    def recharge(self) -> int:
        """Redis lost the buckets: charge the fresh ones with what this replica still owes
        them. Answers how many buckets it charged."""
        owed = self._ledger.owed(time.monotonic())
        for entry in owed:
            self._link.spawn(self._link.call(self._script(
                args=[self._link.prefix, entry.name, entry.rpm, entry.tpm, -entry.requests,
                      -entry.tokens, 0])))
        return len(owed)
