"""What one replica took from each shared rpm/tpm bucket over the last minute.

A bucket refills its whole size in a minute, so of what was taken ``age`` seconds ago the
part ``1 - age/60`` is not back yet. When Redis loses the buckets (an empty restart, a
flush, a failover to an older copy) each replica charges a fresh bucket with what it still
owes, and the fleet's sum is what the lost bucket held (exactly, unless it had hit its cap
meanwhile; never more). Kept in one-second bins: at most 60 per bucket, whatever the rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0  # a bucket's whole size refills in a minute


@dataclass(slots=True)
class _Bin:
    second: int
    requests: float = 0.0
    tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Owed:
    name: str
    rpm: int
    tpm: int
    requests: int
    tokens: int


class Ledger:
    def __init__(self) -> None:
        self._bins: dict[str, deque[_Bin]] = {}
        self._rates: dict[str, tuple[int, int]] = {}

    def add(self, name: str, rpm: int, tpm: int, requests: float, tokens: float,
            now: float) -> None:
        """``requests`` and ``tokens`` taken from ``name`` at ``now`` (negative: given back)."""
        self._rates[name] = (rpm, tpm)
        bins = self._bins.setdefault(name, deque())
        second = int(now)
        if not bins or bins[-1].second != second:
            bins.append(_Bin(second))
        bins[-1].requests += requests
        bins[-1].tokens += tokens
        while bins and bins[0].second <= second - WINDOW_S:
            bins.popleft()

    def owed(self, now: float) -> list[Owed]:
        """What each bucket would still be short of, had it kept what this replica took."""
        found = []
        for name, bins in list(self._bins.items()):
            requests = tokens = 0.0
            for entry in bins:
                left = 1.0 - min(max(now - entry.second - 0.5, 0.0), WINDOW_S) / WINDOW_S
                requests += entry.requests * left
                tokens += entry.tokens * left
            if requests <= 0 and tokens <= 0:
                del self._bins[name]
                continue
            rpm, tpm = self._rates[name]
            found.append(Owed(name, rpm, tpm, max(round(requests), 0), max(round(tokens), 0)))
        return found
