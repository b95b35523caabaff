"""The priority scheduler: which waiting call gets the next free upstream slot.

Pure: it is told the time (``now``, monotonic seconds), never sleeps and never does I/O;
``proxy.admission`` is the async shell around it.

- Tiers x levels. Each tier is a multi-level feedback queue. A call joins the level its
  estimated service time puts it in (short calls start high), FIFO within a level, and
  moves up one level after waiting ``promote_after_s[level]`` there.
- Across tiers, weighted fair sharing of slot-seconds: serving a call charges its tier
  ``est_service_s / weight`` of virtual time. Among tiers that can use the free slot, the
  most urgent one that is less than ``quantum_s`` ahead of the most under-served waiting
  tier goes first; if none is, the most under-served one goes. A tier that had nothing
  waiting restarts level with the others, so idle tiers bank no credit.
- Headroom (``proxy.headroom``): a call may not take the last free slots of a provider held
  for more urgent tiers; never all of them, so every tier keeps a usable slot.
- A call waiting ``tier_promote_after_s`` moves up one tier, once. Past its tier's
  ``max_wait_s`` it is rejected (``queue_timeout``).
- Bounded queue: past a tier's or the total bound, a more urgent arrival evicts the most
  recently queued call of the least urgent tier (``evicted``); otherwise it is refused
  (``queue_full``).
- Work-conserving: after every call below, no free usable slot is left while a call that
  may use it waits. Time alone can make a call eligible (a reservation lapses, a call moves
  up a tier); ``next_wakeup`` says when, and ``advance`` applies it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from .headroom import Headroom
from .scheduler_queues import TicketQueues
from .scheduler_types import (
    Dispatch,
    Rejection,
    SchedulerSettings,
    SubmitResult,
    Ticket,
    TicketState,
    TierSpec,
)

__all__ = [
    "Dispatch",
    "Rejection",
    "Scheduler",
    "SchedulerSettings",
    "SubmitResult",
    "Ticket",
    "TicketState",
    "TierSpec",
]

_RETRY_AFTER_MIN_S = 1.0
_RETRY_AFTER_MAX_S = 120.0
# Weight of the newest sample in the per-provider mean of observed service times.
_SERVICE_EWMA_ALPHA = 0.1


class Scheduler:
    def __init__(self, settings: SchedulerSettings, capacities: Mapping[str, int]) -> None:
        self._settings = settings
        self._tiers = settings.tiers
        count = len(settings.tiers)
        self._weights = [t.weight for t in settings.tiers]
        self._reserves: list[int | None] = [t.reserve for t in settings.tiers]
        self._capacity: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._running: dict[str, list[int]] = {}
        self._available: dict[str, bool] = {}
        self._mean_service: dict[str, float] = {}
        for provider, limit in capacities.items():
            self._add_provider(provider, limit)
        promote = settings.tier_promote_after_s
        self._queues = TicketQueues(
            count, settings.levels, settings.promote_after_s,
            [promote if promote is not None and promote < t.max_wait_s else math.inf
             for t in settings.tiers],
        )
        self._headroom = Headroom(count, settings.headroom_scale, settings.headroom_horizon_s)
        self._virtual = [0.0] * count
        self._active = [False] * count
        self._floor = 0.0

    def submit(self, ticket: Ticket, now: float) -> SubmitResult:
        """Queue a call; it gets a slot at once if one is free and nothing more deserving
        waits for it. Rejections name the ticket itself or the tickets it evicted."""
        self._check(ticket)
        spec = self._tiers[ticket.tier]
        ticket.state = TicketState.QUEUED
        ticket.current_tier = ticket.tier
        ticket.level = bisect.bisect_left(self._settings.level_bounds_s, ticket.est_service_s)
        ticket.arrived = ticket.entered_level = now
        max_wait_s = spec.max_wait_s
        if ticket.max_wait_s is not None:
            max_wait_s = min(max_wait_s, max(ticket.max_wait_s, 0.0))
        ticket.deadline = now + max_wait_s
        likely = next((p for p in ticket.candidates if self._available[p]),
                      ticket.candidates[0])
        self._headroom.record(likely, ticket.tier, ticket.est_service_s, now)
        self._catch_up(now)  # calls due to move up join their level before this one
        self._queues.add(ticket)
        woken: list[Dispatch] = []
        for provider in dict.fromkeys(ticket.candidates):
            woken += self._fill(provider, now)
        own = next((d for d in woken if d.ticket is ticket), None)
        others = tuple(d for d in woken if d.ticket is not ticket)
        if own is not None:
            return SubmitResult(own, (), others)
        return SubmitResult(None, self._enforce_bounds(ticket), others)

    def release(self, provider: str, now: float, service_s: float | None = None,
                ticket: Ticket | None = None) -> list[Dispatch]:
        """A slot on ``provider`` came back; ``service_s`` (how long the call held it) feeds
        the provider's mean service time shown in ``snapshot``. Pass the ``ticket`` that held
        it so the headroom counts each tier's running calls exactly; without it the least
        urgent tier running there is assumed."""
        if self._inflight.get(provider, 0) <= 0:
            raise ValueError(f"release of {provider!r} without a slot held")
        self._inflight[provider] -= 1
        running = self._running[provider]
        tier = ticket.current_tier if ticket is not None else -1
        if not 0 <= tier < len(running) or running[tier] == 0:
            tier = max(i for i, n in enumerate(running) if n)
        running[tier] -= 1
        if service_s is not None:
            old = self._mean_service.get(provider, service_s)
            self._mean_service[provider] = old + _SERVICE_EWMA_ALPHA * (service_s - old)
        return self._fill(provider, now)

    def cancel(self, ticket: Ticket, now: float) -> None:
        """The caller left; a queued ticket is dropped (no-op otherwise)."""
        if ticket.state is TicketState.QUEUED:
            self._queues.discard(ticket, TicketState.CANCELLED)

    def expire(self, now: float) -> list[Rejection]:
        """Reject every queued ticket whose tier's ``max_wait_s`` has passed."""
        out: list[Rejection] = []
        for ticket in self._queues.pop_expired(now):
            self._queues.discard(ticket, TicketState.REJECTED)
            out.append(Rejection(ticket, "queue_timeout", self._retry_after(ticket)))
        return out

    def advance(self, now: float) -> tuple[list[Dispatch], list[Rejection]]:
        """Apply everything due by ``now``: expiries, promotions, lapsed reservations."""
        rejections = self.expire(now)
        dispatches: list[Dispatch] = []
        for provider in self._capacity:
            dispatches += self._fill(provider, now)
        return dispatches, rejections

    def next_deadline(self) -> float | None:
        """Earliest deadline of a queued ticket."""
        soonest = self._queues.next_deadline()
        return soonest if math.isfinite(soonest) else None

    def next_wakeup(self, now: float) -> float | None:
        """When ``advance`` next has something to do: a deadline, or (while a free slot is
        held back from a waiting call) a reservation lapse or tier promotion."""
        soonest = self._queues.next_deadline()
        for provider, capacity in self._capacity.items():
            free = capacity - self._inflight[provider]
            if free <= 0 or not self._available[provider]:
                continue
            for tier in range(len(self._tiers)):
                if self._queues.count(provider, tier) == 0:
                    continue
                soonest = min(soonest, self._queues.next_tier_promotion(tier))
                lapse = self._headroom.lapse_time(provider, tier, free - 1, now, self._reserves,
                                                  self._running[provider], capacity)
                if lapse is not None:
                    soonest = min(soonest, lapse)
        return soonest if math.isfinite(soonest) else None

    def set_capacity(self, provider: str, limit: int, now: float) -> list[Dispatch]:
        """Change a provider's concurrency limit (a new provider is added). Calls already
        running above a lowered limit keep their slots until released."""
        if limit < 0:
            raise ValueError("limit must not be negative")
        if provider not in self._capacity:
            self._add_provider(provider, limit)
        self._capacity[provider] = limit
        return self._fill(provider, now)

    def set_available(self, provider: str, available: bool, now: float) -> list[Dispatch]:
        """Nothing is dispatched to an unavailable provider (breaker open, paused)."""
        self._available[self._known(provider)] = available
        return self._fill(provider, now)

    def set_policy(self, weights: Mapping[int, float] | None, reserves: Mapping[int, int] | None,
                   now: float) -> list[Dispatch]:
        """Override tier weights and fixed reserves (time-of-day schedules); None restores
        the configured values. Tiers missing from a mapping keep their configured value."""
        new_weights = [(weights or {}).get(i, spec.weight) for i, spec in enumerate(self._tiers)]
        new_reserves = [
            (reserves or {}).get(i, spec.reserve) for i, spec in enumerate(self._tiers)
        ]
        if any(not w > 0 for w in new_weights):
            raise ValueError("weights must be positive")
        if any(r is not None and r < 0 for r in new_reserves):
            raise ValueError("reserves must not be negative")
        self._weights, self._reserves = new_weights, new_reserves
        dispatches: list[Dispatch] = []
        for provider in self._capacity:
            dispatches += self._fill(provider, now)
        return dispatches

    def depth(self, tier: int) -> int:
        return self._queues.depth[tier]

    def inflight(self, provider: str) -> int:
        return self._inflight.get(provider, 0)

    def capacity(self, provider: str) -> int:
        return self._capacity.get(provider, 0)

    def held_back(self, provider: str, tier: int, now: float) -> int:
        """Free slots of ``provider`` that ``tier`` may not take right now."""
        return self._held(self._known(provider), now)[tier]

    def snapshot(self, now: float) -> dict[str, object]:
        tiers = []
        for i, spec in enumerate(self._tiers):
            oldest = self._queues.oldest_arrival(i)
            tiers.append({
                "name": spec.name,
                "weight": self._weights[i],
                "depth": self._queues.depth[i],
                "by_level": list(self._queues.level_depth[i]),
                "oldest_wait_s": round(now - oldest, 3) if math.isfinite(oldest) else 0.0,
                "queued_service_s": round(self._queues.queued_s[i], 3),
            })
        providers = {
            name: {
                "inflight": self._inflight[name],
                "limit": capacity,
                "available": self._available[name],
                "held_back": self._held(name, now),
                "running_by_tier": list(self._running[name]),
                "mean_service_s": self._mean_service.get(name),
            }
            for name, capacity in self._capacity.items()
        }
        return {"queued": self._queues.queued, "tiers": tiers, "providers": providers}

    def _fill(self, provider: str, now: float) -> list[Dispatch]:
        """Hand out free slots of ``provider`` while an eligible ticket waits."""
        out: list[Dispatch] = []
        if not self._available[provider]:
            return out
        self._catch_up(now)
        while self._queues.queued and self._capacity[provider] > self._inflight[provider]:
            ticket = self._choose(provider, now)
            if ticket is None:
                break
            tier = ticket.current_tier
            self._queues.discard(ticket, TicketState.DISPATCHED)
            ticket.dispatched_at = now
            ticket.provider = provider
            self._inflight[provider] += 1
            self._running[provider][tier] += 1
            self._virtual[tier] += ticket.est_service_s / self._weights[tier]
            out.append(Dispatch(ticket, provider))
        return out

    def _catch_up(self, now: float) -> None:
        self._queues.promote_tiers(now)
        self._queues.age(now)

    def _choose(self, provider: str, now: float) -> Ticket | None:
        free = self._capacity[provider] - self._inflight[provider]
        held = self._headroom.iter_held(provider, now, self._reserves, self._running[provider],
                                        self._capacity[provider])
        credit_line = self._sync_floor() + self._settings.quantum_s
        chosen: int | None = None
        for tier, held_back in enumerate(held):
            if free <= held_back:
                break  # what is held against a tier is held against every tier below it
            if self._queues.count(provider, tier) == 0:
                continue
            if self._virtual[tier] < credit_line:
                chosen = tier
                break
            if chosen is None or self._virtual[tier] < self._virtual[chosen]:
                chosen = tier
        return None if chosen is None else self._queues.head(chosen, provider)

    def _sync_floor(self) -> float:
        """Virtual time of the most under-served waiting tier; a tier that starts waiting
        again is brought up to it, so idling banks no credit."""
        depth = self._queues.depth
        lowest = math.inf
        for tier, active in enumerate(self._active):
            waiting = depth[tier] > 0
            if waiting and not active:
                self._virtual[tier] = max(self._virtual[tier], self._floor)
            self._active[tier] = waiting
            if waiting and self._virtual[tier] < lowest:
                lowest = self._virtual[tier]
        if lowest != math.inf:
            self._floor = max(self._floor, lowest)
        return self._floor

    def _held(self, provider: str, now: float) -> list[int]:
        return self._headroom.held(provider, now, self._reserves, self._running[provider],
                                   self._capacity[provider])

    def _enforce_bounds(self, ticket: Ticket) -> tuple[Rejection, ...]:
        tier = ticket.current_tier
        limit = self._tiers[tier].max_queue
        over_tier = limit is not None and self._queues.depth[tier] > limit
        if not over_tier and self._queues.queued <= self._settings.max_queue:
            return ()
        if not over_tier:
            victim_tier = max(i for i, d in enumerate(self._queues.depth) if d)
            victim = self._queues.newest(victim_tier)
            if victim_tier > tier and victim is not None:
                self._queues.discard(victim, TicketState.REJECTED)
                return (Rejection(victim, "evicted", self._retry_after(victim)),)
        self._queues.discard(ticket, TicketState.REJECTED)
        return (Rejection(ticket, "queue_full", self._retry_after(ticket)),)

    def _retry_after(self, ticket: Ticket) -> float:
        """Estimated time to drain the queued work at or above the ticket's tier."""
        ahead = sum(self._queues.queued_s[: ticket.current_tier + 1])
        slots = sum(self._capacity[p] for p in set(ticket.candidates) if self._available[p])
        drain = ahead / slots if slots else _RETRY_AFTER_MAX_S
        return min(max(drain, _RETRY_AFTER_MIN_S), _RETRY_AFTER_MAX_S)

    def _check(self, ticket: Ticket) -> None:
        if ticket.state is not TicketState.NEW:
            raise ValueError("a ticket can be submitted once")
        if not 0 <= ticket.tier < len(self._tiers):
            raise ValueError(f"tier {ticket.tier} out of range")
        if not ticket.candidates:
            raise ValueError("a ticket needs at least one candidate provider")
        for provider in ticket.candidates:
            self._known(provider)
        if not ticket.est_service_s >= 0 or not math.isfinite(ticket.est_service_s):
            raise ValueError("est_service_s must be a finite non-negative number")

    def _known(self, provider: str) -> str:
        if provider not in self._capacity:
            raise ValueError(f"unknown provider {provider!r}")
        return provider

    def _add_provider(self, provider: str, limit: int) -> None:
        self._capacity[provider] = limit
        self._inflight[provider] = 0
        self._running[provider] = [0] * len(self._tiers)
        self._available[provider] = True
