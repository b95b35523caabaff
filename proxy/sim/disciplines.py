"""Reference disciplines: the same calls on the same providers, scheduled by a textbook rule
instead of the proxy's policy, for ``simulate --compare`` and the scoreboard.

- ``fcfs``: one queue in arrival order.
- ``priority``: strict priority; the most urgent tier first, arrival order within a tier.
- ``wfq``: weighted fair queueing of slot-seconds between tiers (start-time fair queueing,
  charged each call's true service time): a tier's virtual time grows by service / weight,
  the waiting tier with the least goes next, and a tier that starts waiting again joins at
  the virtual time of the last call started, so idling banks nothing. Arrival order within
  a tier; a tier of weight 0 only when no other tier waits.
- ``static``: each tier owns its weight's share of every provider's slots (at least one;
  largest remainders), as the seed design had: a call waits for a slot of its own tier
  even while another tier's sit idle.

A call takes the first of its candidates' providers with a slot it may use. Only slots and
waits are modelled, as a client with its tier's ``max_wait_s`` sees them: a call still
waiting then gives up (``queue_timeout``). A provider whose ``simulate:`` block answers
429 past a ``capacity`` below ``max_concurrency`` has that capacity here (a self-hosted
server its ``slots`` or ``slows_past``): the references know the real limit, which the
proxy has to find from the 429s, the server's figures or its latency.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator, Sequence

from ..config import Config
from ..config.trace import TraceCall
from ..core.call.route import Deployment
from .results import Outcome, Simulation, Waiting, makespan
from .servers import service_s

DISCIPLINES = ("fcfs", "priority", "wfq", "static")

_DEADLINE, _DONE, _ARRIVAL = 0, 1, 2  # at one instant: give-ups, then slots back, then arrivals
_Event = tuple[float, int, int, int, str]  # (time, kind, order, call, provider)


def slots_of(config: Config) -> dict[str, int]:
    """Each provider's real concurrency: its ``max_concurrency``, or, when lower, the
    simulated ``capacity`` past which it answers 429, the ``slots`` past which calls wait
    inside it, or the ``slows_past`` past which it serves no faster."""
    slots = {}
    for name, provider in config.providers.items():
        limit = provider.max_concurrency
        timing = provider.timing
        if timing is not None:
            for real in (timing.capacity, timing.slots, timing.slows_past):
                if real is not None:
                    limit = min(limit, real)
        slots[name] = limit
    return slots


def static_slots(slots: int, weights: Sequence[float]) -> list[int]:
    """``slots`` divided by weight: one for each tier of weight above 0 while there are
    enough (the most urgent first), the rest by weight (largest remainders); a tier of
    weight 0 none unless every weight is 0."""
    count = len(weights)
    if not sum(weights):
        weights = [1.0] * count
    out = [0] * count
    for i, w in enumerate(weights):
        if w and sum(out) < slots:
            out[i] = 1
    spare = slots - sum(out)
    total = sum(weights)
    shares = [spare * w / total for w in weights]
    for i, share in enumerate(shares):
        out[i] += int(share)
    by_remainder = sorted(range(count), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:slots - sum(out)]:
        out[i] += 1
    return out


def reference(config: Config, calls: Sequence[TraceCall], tiers: Sequence[str],
              discipline: str, keys: Sequence[str | None] | None = None,
              speed: float = 1.0) -> Simulation:
    """``calls`` under ``discipline``; ``tiers`` (and ``keys``) are each call's as the
    proxy classified it, for its give-up time and the report."""
    if discipline not in DISCIPLINES:
        raise ValueError(f"unknown discipline {discipline!r} (one of {', '.join(DISCIPLINES)})")
    return _Reference(config, discipline).run(calls, tiers, keys, speed)


class _Reference:
    def __init__(self, config: Config, discipline: str) -> None:
        self.config = config
        self.discipline = discipline
        self.rank = {name: i for i, name in enumerate(config.tier_names)}
        count = len(config.tiers)
        self.weights = [t.weight for t in config.tiers]
        slots = slots_of(config)
        if discipline == "static":
            self.free = {(p, t): n for p, c in slots.items()
                         for t, n in enumerate(static_slots(c, self.weights))}
        else:
            self.free = {(p, t): c for p, c in slots.items() for t in range(count)}
        self.shared = discipline != "static"  # one count of free slots per provider
        self.queues: list[deque[int]] = [deque() for _ in range(count)]
        self.virtual = [0.0] * count
        self.started_virtual = 0.0
        self.busy = dict.fromkeys(config.providers, 0.0)
        self.first_model = next(iter(config.models))

    def run(self, calls: Sequence[TraceCall], tiers: Sequence[str],
            keys: Sequence[str | None] | None, speed: float) -> Simulation:
        outcomes = [Outcome(c.t / speed, tier) for c, tier in zip(calls, tiers, strict=True)]
        for outcome, key in zip(outcomes, keys or [None] * len(calls), strict=True):
            outcome.key = key
        counted = Waiting(len(self.rank))
        events: list[_Event] = []
        order = itertools.count()
        for i, outcome in enumerate(outcomes):
            heapq.heappush(events, (outcome.arrived, _ARRIVAL, next(order), i, ""))
        waiting: set[int] = set()
        while events:
            now, kind, _, i, provider = heapq.heappop(events)
            call, outcome = calls[i], outcomes[i]
            tier = self.rank.get(outcome.tier, 0)
            if kind == _DONE:
                self._release(provider, tier)
            elif kind == _DEADLINE:
                if i in waiting:
                    waiting.discard(i)
                    outcome.code, outcome.wait_s, outcome.done_at = "queue_timeout", (
                        now - outcome.arrived), now
                    counted.add(self._pools(call), tier, -1)
            else:
                candidates = self._candidates(call)
                if not candidates:
                    outcome.code = "model_not_found" if candidates is None else (
                        "upstream_unavailable")
                    outcome.wait_s, outcome.done_at = 0.0, now
                    continue
                waiting.add(i)
                self._join(tier, i)
                counted.add(self._pools(call), tier)
                max_wait_s = self.config.tiers[tier].max_wait_s if outcome.tier in self.rank else (
                    math.inf)
                if math.isfinite(max_wait_s):
                    heapq.heappush(events, (now + max_wait_s, _DEADLINE, next(order), i, ""))
            self._fill(calls, outcomes, waiting, counted, events, order, now)
        return Simulation(outcomes, makespan(outcomes), self.busy, counted.inversions)

    def _candidates(self, call: TraceCall) -> tuple[Deployment, ...] | None:
        route = self.config.models.get(call.model or self.first_model)
        return None if route is None else route.candidates

    def _pools(self, call: TraceCall) -> set[str]:
        return {d.provider for d in self._candidates(call) or ()}

    def _join(self, tier: int, i: int) -> None:
        if self.discipline == "wfq" and not self.queues[tier]:
            self.virtual[tier] = max(self.virtual[tier], self.started_virtual)
        self.queues[0 if self.discipline == "fcfs" else tier].append(i)

    def _order(self) -> list[int]:
        """The queues to look in, best first."""
        present = [t for t, q in enumerate(self.queues) if q]
        if self.discipline == "wfq":
            return sorted(present, key=lambda t: (not self.weights[t], self.virtual[t], t))
        return present

    def _fill(self, calls: Sequence[TraceCall], outcomes: Sequence[Outcome],
              waiting: set[int], counted: Waiting, events: list[_Event],
              order: Iterator[int], now: float) -> None:
        """Start calls while one may use a free slot, best first."""
        while True:
            found = None
            for t in self._order():
                queue = self.queues[t]
                while queue and queue[0] not in waiting:
                    queue.popleft()  # gave up
                for i in queue:
                    if i not in waiting:
                        continue
                    deployment = self._free_candidate(calls[i], t)
                    if deployment is not None:
                        found = (t, i, deployment)
                        break
                if found is not None:
                    break
            if found is None:
                return
            t, i, deployment = found
            self.queues[t].remove(i)
            waiting.discard(i)
            call, outcome = calls[i], outcomes[i]
            tier = self.rank.get(outcome.tier, 0)
            output = min(call.output_tokens, call.max_tokens or call.output_tokens,
                         deployment.max_output_tokens)
            took = service_s(self.config, deployment, call.prompt_tokens, output)[1]
            counted.add(self._pools(call), tier, -1)
            counted.started(deployment.provider, tier)
            self._take(deployment.provider, tier, took)
            outcome.wait_s, outcome.service_s = now - outcome.arrived, took
            outcome.provider = deployment.provider
            outcome.cost_usd = deployment.cost(call.prompt_tokens, output,
                                               deployment.service_tier(outcome.tier))
            outcome.done_at = now + took
            self.busy[deployment.provider] += took
            heapq.heappush(events, (now + took, _DONE, next(order), i, deployment.provider))

    def _free_candidate(self, call: TraceCall, queue: int) -> Deployment | None:
        for deployment in self._candidates(call) or ():
            if self._free(deployment.provider, queue) > 0:
                return deployment
        return None

    def _free(self, provider: str, tier: int) -> int:
        return self.free[(provider, 0 if self.shared else tier)]

    def _take(self, provider: str, tier: int, took: float) -> None:
        if self.discipline == "wfq":
            self.started_virtual = self.virtual[tier]
            weight = self.weights[tier]
            self.virtual[tier] += took / weight if weight else 0.0
        self.free[(provider, 0 if self.shared else tier)] -= 1

    def _release(self, provider: str, tier: int) -> None:
        self.free[(provider, 0 if self.shared else tier)] += 1
