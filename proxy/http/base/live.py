"""Live numbers for the dashboard: what calls ended with, kept for the last minutes.

Memory is fixed whatever the load: one bucket per second for the last ``window_s``
seconds, each holding at most ``SAMPLES`` queue waits per tier (a uniform sample past
that), calls by status class and the gauges sampled once a second; one running total per
key and tier (names from the config); the last ``REJECTIONS`` refused calls.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from ...core.quantile import percentile
from .access import CallRecord

WINDOW_S = 300
SAMPLES = 128
REJECTIONS = 50


class _Second:
    __slots__ = ("calls", "depth", "inflight", "point", "seen", "t", "waits")

    def __init__(self, t: int) -> None:
        self.t = t
        self.calls: dict[str, int] = {}
        self.waits: dict[str, list[float]] = {}
        self.seen: dict[str, int] = {}
        self.depth: dict[str, int] | None = None
        self.inflight: dict[str, int] | None = None
        self.point: dict[str, object] | None = None  # the summary, until the bucket changes

    def summary(self) -> dict[str, object]:
        if self.point is None:
            point: dict[str, object] = {"t": self.t, "calls": self.calls}
            ordered = {tier: sorted(waits) for tier, waits in self.waits.items()}
            point["p50"] = {tier: percentile(w, 0.5) for tier, w in ordered.items()}
            point["p99"] = {tier: percentile(w, 0.99) for tier, w in ordered.items()}
            if self.depth is not None:
                point["depth"] = self.depth
            if self.inflight is not None:
                point["inflight"] = self.inflight
            self.point = point
        return self.point


@dataclass(slots=True)
class Totals:
    """What one key's calls in one tier used since the start (the dashboard's usage)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


class LiveStats:
    """Told about every proxied call when it ends (``call_ended``) and about the queue
    depths and slots in use once a second (``sample``, which also wakes ``next_sample``)."""

    def __init__(self, window_s: int = WINDOW_S, rng: random.Random | None = None) -> None:
        self.window_s = window_s
        self.stopped = False
        self._ring: list[_Second | None] = [None] * window_s
        self._first: int | None = None
        self._totals: dict[tuple[str, str], Totals] = {}
        self._rejections: deque[dict[str, object]] = deque(maxlen=REJECTIONS)
        self._rng = rng or random.Random()
        self._sampled = asyncio.Event()

    def _second(self, now: float) -> _Second:
        t = math.floor(now)
        second = self._ring[t % self.window_s]
        if second is None or second.t != t:
            second = self._ring[t % self.window_s] = _Second(t)
            if self._first is None:
                self._first = t
        second.point = None
        return second

    def call_ended(self, status: int, record: CallRecord, now: float) -> None:
        """``now``: the service clock's time (monotonic seconds)."""
        second = self._second(now)
        group = f"{status // 100}xx"
        second.calls[group] = second.calls.get(group, 0) + 1
        tier = record.tier
        if tier is not None and record.upstream is not None and record.queue_s is not None:
            seen = second.seen[tier] = second.seen.get(tier, 0) + 1
            waits = second.waits.setdefault(tier, [])
            if seen <= SAMPLES:
                waits.append(record.queue_s)
            else:
                replaced = int(self._rng.random() * seen)
                if replaced < SAMPLES:
                    waits[replaced] = record.queue_s
        label = (record.key or "-", tier or "-")
        totals = self._totals.get(label)
        if totals is None:
            totals = self._totals[label] = Totals()
        totals.calls += 1
        totals.prompt_tokens += record.prompt_tokens or 0
        totals.completion_tokens += record.completion_tokens or 0
        totals.cost_usd += record.cost_usd or 0.0
        if status >= 400 and record.code is not None:
            self._rejections.append({"at": record.arrived, "status": status,
                                     "code": record.code, "tier": tier, "key": record.key})

    def sample(self, now: float, depth: Mapping[str, int], inflight: Mapping[str, int]) -> None:
        """Queue depth per tier and calls in flight per provider, at ``now``."""
        second = self._second(now)
        second.depth, second.inflight = dict(depth), dict(inflight)
        sampled, self._sampled = self._sampled, asyncio.Event()
        sampled.set()

    async def next_sample(self) -> None:
        await self._sampled.wait()

    def stop(self) -> None:
        """No more samples: wake whoever waits for one."""
        self.stopped = True
        self._sampled.set()

    def points(self, now: float, after: int | None = None) -> list[dict[str, object]]:
        """One point per finished second of the window, oldest first; only those after
        ``after`` when given. A second with nothing recorded is ``{"t": t}``."""
        if self._first is None:
            return []
        current = math.floor(now)
        start = max(self._first, current - self.window_s + 1)
        if after is not None:
            start = max(start, after + 1)
        points: list[dict[str, object]] = []
        for t in range(start, current):
            second = self._ring[t % self.window_s]
            points.append({"t": t} if second is None or second.t != t else second.summary())
        return points

    def usage(self) -> list[dict[str, object]]:
        """Calls, tokens and cost per key and tier since the start, sorted by key, tier."""
        return [{"key": key, "tier": tier, "calls": u.calls, "prompt_tokens": u.prompt_tokens,
                 "completion_tokens": u.completion_tokens, "cost_usd": u.cost_usd}
                for (key, tier), u in sorted(self._totals.items())]

    def rejections(self) -> list[dict[str, object]]:
        """The last refused calls (status 400 or more, with a code), newest first."""
        return list(reversed(self._rejections))
