"""What a self-hosted inference server can start now, from its own figures.

A server that queues calls inside (vLLM, SGLang, llama.cpp's ``llama-server``) never
answers 429: past its capacity it takes calls into its own first-come queue, where tiers do
not apply. The driver reads its figures (``Figures``) on a timer and after answers; an
``EngineView`` turns them into the *room* left for the proxy's calls there: the server's
capacity less what runs and waits there on others' behalf (other replicas, other clients:
the most of the last ``OTHERS_READS`` reads).

- Capacity is told where the server says it (llama.cpp's ``total_slots``), else learned:
  calls waiting inside while its KV cache is nearly full (or says nothing), or at two reads
  running, mean it runs all it can (capacity = what runs; one read with the cache mostly
  free may catch a burst before the server's next step takes it); nothing waiting
  while every slot the proxy may use is used, and the KV cache not nearly full, means it
  may take more (half again where the cache is mostly free, an eighth where it is not;
  not within ``REGROW_S`` of calls seen waiting).
- Figures are only as good as their age: older than ``grace_s`` they count as full
  (room 0), never as free; a server not read for ``unreadable_s`` is *unreadable*
  (``room`` None): the pool falls back to its configured or latency-learned limit.

Pure: told the time, never does I/O.
"""

from __future__ import annotations

import math
from collections import deque

from ..value import value

ENGINES = ("vllm", "sglang", "llama.cpp")
KV_HIGH = 0.9  # at or above this KV-cache use, a server takes no more than it runs
KV_LOW = 0.5  # below it, a learned capacity grows by half at a time
START = 4  # a learned capacity before the first figures say more
OTHERS_READS = 3  # others' calls: the most of this many reads (a call sent but not yet
# arrived at the server would otherwise pass for one of the proxy's, and free a slot)
REGROW_S = 10.0  # after calls were seen waiting inside, the capacity grows again no sooner


@value
class Figures:
    """One read of a server: calls it runs and calls waiting in its own queue (whoever
    sent them), its slots where it says (llama.cpp), and its KV-cache use (0 to 1)."""

    running: int
    waiting: int
    slots: int | None = None
    kv_use: float | None = None


class EngineView:
    """One server's figures over time, and the room they leave for the proxy's calls."""

    def __init__(self, grace_s: float, unreadable_s: float) -> None:
        if not 0 < grace_s <= unreadable_s:
            raise ValueError("grace_s must be positive and at most unreadable_s")
        self.grace_s, self.unreadable_s = grace_s, unreadable_s
        self.capacity: int | None = None  # the server's own, told or learned
        self.others = 0  # calls there that are not the proxy's, at the last read
        self.figures: Figures | None = None
        self.read_at = -math.inf
        self.error: str | None = None  # why the last read failed (None: it did not)
        self._since: float | None = None  # first asked: unread since
        self._grow_at = -math.inf
        self._waited = False  # the last read saw calls waiting inside
        self._others_seen: deque[int] = deque()

    def read(self, figures: Figures, inflight: int, now: float) -> None:
        """A fresh read, while ``inflight`` of the proxy's own calls were there."""
        running, waiting = max(figures.running, 0), max(figures.waiting, 0)
        self._seen(now)
        self.figures, self.read_at, self.error = figures, now, None
        seen = self._others_seen
        seen.append(max(0, running + waiting - inflight))
        if len(seen) > OTHERS_READS:
            seen.popleft()
        self.others = max(seen)
        if figures.slots is not None and figures.slots > 0:
            self.capacity = figures.slots
            return
        capacity = self.capacity if self.capacity is not None else max(START, running)
        kv = figures.kv_use
        waited, self._waited = self._waited, waiting > 0
        if waiting > 0:
            # It starts no more than it runs now: so its KV cache says (nearly full, or
            # not said), or two reads running do (one may catch a burst not yet taken).
            if waited or kv is None or kv >= KV_HIGH:
                capacity = max(1, running)
            self._grow_at = now + REGROW_S
        elif running >= capacity and (kv is None or kv < KV_HIGH) and now >= self._grow_at:
            capacity += max(1, capacity // (2 if kv is not None and kv < KV_LOW else 8))
        self.capacity = capacity

    def failed(self, reason: str, now: float) -> None:
        """A read failed (timeout, refused, figures missing): the figures age on."""
        self._seen(now)
        self.error = reason

    def room(self, now: float) -> float | None:
        """How many of the proxy's calls the server can run now; 0 while its figures are
        stale; None once it has been unreadable for ``unreadable_s`` (fall back)."""
        if self.capacity is not None and now - self.read_at <= self.grace_s:
            return float(max(0, self.capacity - self.others))
        since = self._seen(now)
        if now - max(since, self.read_at) >= self.unreadable_s:
            return None
        return 0.0

    def _seen(self, now: float) -> float:
        if self._since is None:
            self._since = now
        return self._since

    def readable(self, now: float) -> bool:
        return self.room(now) is not None

    def snapshot(self, now: float) -> dict[str, object]:
        figures = self.figures
        return {
            "readable": self.readable(now),
            "capacity": self.capacity,
            "others": self.others,
            "running": None if figures is None else figures.running,
            "waiting": None if figures is None else figures.waiting,
            "kv_use": None if figures is None else figures.kv_use,
            "read_s_ago": round(now - self.read_at, 3) if math.isfinite(self.read_at) else None,
            "error": self.error,
        }
