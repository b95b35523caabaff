"""The priority scheduler: which waiting call gets the next free upstream slot.

Pure: it is told the time (``now``, monotonic seconds), never sleeps and never does I/O.
Every method that changes something records its decisions (slots granted, calls refused)
for ``take``; the async shell (``proxy.http.call.admission``) or the simulator acts on them.
It alone decides whether a provider can take a call now (``capacity``): slots,
pauses after a 429 or a spent rate limit, half-open probe limits, open breakers and the
adaptive concurrency limit are all capacity it sees, so a call waits for them in its
place instead of failing.

The policy (``policy``) picks, for each free slot of a provider, among the
calls that may use it: a tier owed its floor (``floors``), else the most urgent
tier, and within a tier by level and by key (``shares``). Deadlines are exact: a
queued call past its deadline is refused (``queue_timeout``) on time, however it entered
the queue. The queue is bounded: past a tier's or the total bound, a more urgent arrival
evicts the latest arrival of the least urgent tier (``evicted``); otherwise it is refused
(``queue_full``).

Work-conserving apart from headroom: after every call below, no free slot is left while
a call that may use it waits and no hold applies. Time alone can change that (a pause
ends, a limit grows back, a hold lapses, a call moves up a tier); ``next_wakeup`` says
when, and ``advance`` applies it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from .capacity import Capacity, Gate, Pool, all_down, first_open
from .forecast import Forecast, forecast
from .generations import TierMaps
from .parts import Parts, build, reload
from .policy import HOLD_PATIENCE
from .status import status
from .tickets import (
    CANCELLED,
    DISPATCHED,
    NEW,
    QUEUED,
    REJECTED,
    RELEASED,
    Decisions,
    Dispatch,
    Rejection,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)

__all__ = ["HOLD_PATIENCE", "Decisions", "Dispatch", "Rejection", "Scheduler",
           "SchedulerSettings", "Ticket", "TicketState", "TierSpec"]


class Scheduler:
    def __init__(self, settings: SchedulerSettings, pools: Mapping[str, int],
                 deployments: Mapping[str, str] | None = None) -> None:
        """``pools``: provider -> max_concurrency. ``deployments``: deployment id -> its
        provider; a provider's own name also stands for a deployment of it."""
        self._capacity = Capacity(len(settings.tiers))
        self._pools = self._capacity.pools
        self._gates = self._capacity.gates
        for name, limit in pools.items():
            self._capacity.add_pool(name, limit)
        for deployment, pool in (deployments or {}).items():
            self._capacity.add_gate(deployment, pool)
        self._use(build(settings, self._capacity))
        self._out = Decisions()
        self._orders = itertools.count()  # arrival order
        self._running: dict[Ticket, None] = {}  # holding a slot
        self._tier_maps = TierMaps()

    def _use(self, parts: Parts) -> None:
        """The queues and the policy's state in force (``parts``)."""
        self._parts = parts
        (self._settings, self._queues, self._floors, self._headroom, self._policy,
         self._charges) = parts
        self._tiers = parts.settings.tiers

    def reconfigure(self, settings: SchedulerSettings, pools: Mapping[str, int],
                    deployments: Mapping[str, str], tier_map: Sequence[int],
                    now: float) -> None:
        """A new configuration (a reload) losing no call (``parts.reload``)."""
        self._use(reload(self._parts, settings, tier_map, self._tier_maps, self._running,
                         self._capacity, pools, deployments, now))
        self._fill_all(now)

    @property
    def generation(self) -> int:
        """The configuration in force: how many times ``reconfigure`` ran."""
        return self._tier_maps.generation

    # --- calls --------------------------------------------------------------------------

    def submit(self, ticket: Ticket, now: float) -> None:
        """Queue a call (again, for one whose slot came back: it keeps its arrival, tier,
        level and deadline); it gets a slot at once if one is free and nothing more
        deserving waits for it."""
        first = ticket.state is NEW
        if first:
            ticket.generation = self._tier_maps.generation
        else:
            self._tier_maps.bring_up(ticket, self._settings.levels)
        ticket.validate(len(self._tiers))
        gates, pools = self._capacity.gates_and_pools(ticket.candidates)  # unknown candidates raise
        if first:
            ticket.arrive(now, next(self._orders), self._settings.level_bounds_s,
                          self._tiers[ticket.tier].max_wait_s)
            self._charges.arrived(ticket, first_open(gates, now).pool.name, now)
        ticket.state = QUEUED
        ticket.visit += 1
        ticket.queued_at = now
        if ticket.deadline <= now:
            self._reject(ticket, "queue_timeout", now, queued=False)
            return
        if all_down(gates, now):
            self._reject(ticket, "upstream_unavailable", now, queued=False)
            return
        if not self._queues.queued and self._start_at_once(ticket, gates, now):
            return
        found = self._foresee(ticket, gates, pools, now) if first else None
        if ticket.state is REJECTED:
            return
        self._catch_up(now)  # calls due to move up a tier join it before this one
        self._queues.add(ticket)
        if found is not None:
            found.join(ticket, self._queues.backlog, pools, now)
        for pool in pools:
            self._fill(pool, now)
        if ticket.state is QUEUED:
            self._enforce_bounds(ticket, now)

    def _foresee(self, ticket: Ticket, gates: tuple[Gate, ...], pools: tuple[Pool, ...],
                 now: float) -> Forecast:
        """A new call's forecast (``forecast``); refused at once if its certain wait passes
        its deadline."""
        tier = ticket.current_tier
        max_wait_s = self._tiers[tier].max_wait_s
        found = forecast(ticket, self._queues.backlog, gates, pools, self._floors.shares, now,
                         max_wait_s, self._queues.promotes(tier),
                         self._policy.mean_service(first_open(gates, now).pool.name))
        ticket.position, ticket.predicted_s = found.position, found.expected_s
        refusal = found.refusal(ticket.deadline - now, max_wait_s)
        if self._settings.refuse_early and refusal is not None:
            self._queues.backlog.refused(ticket, now)
            self._reject(ticket, refusal.code, now, queued=False,
                         retry_after=refusal.retry_after_s, message=refusal.message)
        return found

    def _start_at_once(self, ticket: Ticket, gates: tuple[Gate, ...], now: float) -> bool:
        """Nothing waits: the first open gate with a free slot that no hold keeps takes it."""
        for gate in gates:
            pool = gate.pool
            if gate.open(now):
                free = pool.free(now)
                if free > self._policy.held_against(pool, ticket.current_tier, now):
                    self._dispatch(ticket, gate, now)
                    return True
        return False

    def release(self, ticket: Ticket, now: float, service_s: float | None = None) -> None:
        """The slot a ticket holds came back; ``service_s`` (how long it held it, if known)
        corrects its tier's floor, its key's share and the headroom's load, and feeds the
        provider's mean service time. The ticket may then be submitted again."""
        self._release(ticket, now, service_s, used=True)

    def give_back(self, ticket: Ticket, now: float) -> None:
        """The slot a ticket was granted goes back unused (its provider's rate limit was
        spent, its client left): what its tier was charged for it is refunded."""
        self._release(ticket, now, None, used=False)

    def _release(self, ticket: Ticket, now: float, service_s: float | None,
                 used: bool) -> None:
        if ticket.state is not DISPATCHED or ticket.deployment is None:
            raise ValueError("release of a ticket that holds no slot")
        gate = self._gates[ticket.deployment]
        pool = gate.pool
        pool.inflight -= 1
        gate.inflight -= 1
        pool.running[ticket.current_tier] -= 1
        ticket.state = RELEASED
        del self._running[ticket]
        self._charges.ended(ticket, pool, service_s, used, now)
        self._fill(pool, now)

    def cancel(self, ticket: Ticket, now: float) -> None:
        """The client left; a queued ticket is dropped (no-op otherwise)."""
        if ticket.state is QUEUED:
            self._leave(ticket, CANCELLED, now)
            for pool in self._capacity.gates_and_pools(ticket.candidates)[1]:
                self._fill(pool, now)  # a hold may have been keeping a slot from it alone

    def advance(self, now: float) -> None:
        """Apply everything due by ``now``: expiries, promotions, pauses that ended, limits
        that grew back, lapsed holds."""
        for ticket in self._queues.pop_expired(now):
            self._reject(ticket, "queue_timeout", now)
        self._catch_up(now)
        self._fill_all(now)

    def take(self) -> Decisions:
        """The decisions made since the last call, in order: refusals, then grants."""
        out = self._out
        if out.dispatches or out.rejections:  # mostly empty: kept
            self._out = Decisions()
        return out

    @property
    def quiet(self) -> bool:
        """Nothing decided since ``take`` and nothing queued: no wake-up is due either."""
        out = self._out
        return not (out.dispatches or out.rejections or self._queues.queued)

    def next_wakeup(self, now: float) -> float | None:
        """When ``advance`` next has something to do (``Policy.next_wakeup``)."""
        return self._policy.next_wakeup(self._pools.values(), now)

    # --- capacity -----------------------------------------------------------------------

    def set_max(self, pool: str, max_concurrency: int, now: float) -> None:
        """Change a provider's configured concurrency (a new provider is added). Calls
        running above a lowered limit keep their slots until released."""
        self._fill(self._capacity.set_max(pool, max_concurrency, now), now)

    def set_room(self, pool: str, room: float, source: str, now: float) -> None:
        """A provider's room (``Capacity.set_room``); what a change frees is handed out."""
        found = self._capacity.set_room(pool, room, source, now)
        if found is not None:
            self._fill(found, now)

    def lower_room(self, pool: str, room: float, source: str) -> None:
        """``Capacity.lower_room``: nothing is handed out, so no time is needed."""
        self._capacity.lower_room(pool, room, source)

    def limit_source(self, pool: str) -> str:
        """What holds the provider's limit now (``Pool.limit_source``)."""
        return self._pools[self._capacity.known_pool(pool)].limit_source

    def cut(self, pool: str, now: float, bore: int) -> None:
        """A 429 while ``bore`` other calls ran there: the provider's limit comes down to
        that and grows back by itself (``Pool.cut``); the headroom's allowance with it."""
        self._fill(self._capacity.cut(pool, now, bore), now)

    def pause(self, target: str, until: float, now: float) -> None:
        """``Capacity.pause``; queued calls keep their place."""
        self._capacity.pause(target, until)
        self._fill_all(now)

    def set_down(self, deployment: str, until: float, probes: int, now: float) -> None:
        """The deployment's breaker opened (``Capacity.set_down``). Queued calls with no
        other live candidate are refused now (``upstream_unavailable``)."""
        self._capacity.set_down(deployment, until, probes)
        for ticket in self._queues:
            if deployment in ticket.candidates and all(
                    self._gates[d].down(now) for d in ticket.candidates):
                self._reject(ticket, "upstream_unavailable", now)
        self._fill_all(now)

    def set_up(self, deployment: str, now: float) -> None:
        """The deployment's breaker closed (``Capacity.set_up``)."""
        self._fill(self._capacity.set_up(deployment), now)

    def set_policy(self, weights: Mapping[int, float] | None, reserves: Mapping[int, int] | None,
                   now: float) -> None:
        """Override tier weights and fixed reserves (time-of-day schedules); None restores
        the configured values. Tiers missing from a mapping keep their configured value."""
        self._policy.override(weights or {}, reserves or {})
        self._fill_all(now)

    # --- views --------------------------------------------------------------------------

    def depth(self, tier: int) -> int:
        return self._queues.depth[tier]

    def inflight(self, pool: str) -> int:
        found = self._pools.get(pool)
        return 0 if found is None else found.inflight

    def capacity(self, pool: str) -> int:
        """The provider's effective concurrency limit now (adaptive, at most its max)."""
        found = self._pools.get(pool)
        return 0 if found is None else found.limit

    def paused_until(self, target: str) -> float:
        found: Pool | Gate | None = self._pools.get(target) or self._gates.get(target)
        return -math.inf if found is None else found.paused_until

    def held_back(self, pool: str, tier: int, now: float) -> int:
        """Free slots of ``pool`` that ``tier`` may not take while no more urgent call waits."""
        return self._policy.held_against(self._pools[self._capacity.known_pool(pool)], tier, now)

    def expected_wait_s(self, deployment: str, tier: int, service_s: float,
                        now: float) -> float:
        """A rough queue wait for a new call of ``tier`` through ``deployment``: the work
        queued at that tier or more urgent ones that this provider could serve, shared by
        its slots, and at least any pause in force."""
        pool = self._gates[self._capacity.known_gate(deployment)].pool.name
        ahead_s = sum(self._queues.pool_seconds(pool, t) for t in range(tier + 1))
        return self._capacity.expected_wait_s(deployment, ahead_s, service_s, now)

    def snapshot(self, now: float) -> dict[str, object]:
        """What ``/admin/status`` shows of it (``status``)."""
        return status(self._parts, self._pools, now)

    # --- the policy ---------------------------------------------------------------------

    def _fill_all(self, now: float) -> None:
        for pool in self._pools.values():
            self._fill(pool, now)

    def _fill(self, pool: Pool, now: float) -> None:
        """Hand out free slots of ``pool`` while an eligible ticket waits."""
        held, queues = 0, self._queues
        self._headroom.book_idle(pool.name, now)  # this pass sizes holds by what they idled
        if queues.queued and pool.free(now) > 0:
            self._catch_up(now)
            while queues.queued and pool.free(now) > 0:
                chosen = self._policy.choose(pool, now)
                if chosen is None:
                    held = self._policy.holding
                    break
                ticket, gate = chosen
                queues.discard(ticket, DISPATCHED)
                self._dispatch(ticket, gate, now)
        self._headroom.note_idle(pool.name, now, held)

    def _dispatch(self, ticket: Ticket, gate: Gate, now: float) -> None:
        pool = gate.pool
        tier = ticket.current_tier
        ticket.state = DISPATCHED
        ticket.dispatched_at = now
        ticket.waited_s += now - ticket.queued_at
        ticket.deployment = gate.id
        ticket.pool = pool.name
        ticket.beside = pool.inflight
        pool.inflight += 1
        gate.inflight += 1
        pool.running[tier] += 1
        self._running[ticket] = None
        self._charges.started(ticket, pool, now)
        self._out.dispatches.append(Dispatch(ticket, gate.id, pool.name))

    def _catch_up(self, now: float) -> None:
        self._queues.promote_tiers(now, self._charges.keys.virtual)

    # --- bookkeeping --------------------------------------------------------------------

    def _reject(self, ticket: Ticket, code: str, now: float, queued: bool = True,
                retry_after: float | None = None, message: str | None = None) -> None:
        if queued:
            self._leave(ticket, REJECTED, now)
        else:
            ticket.state = REJECTED
            self._charges.unclaim(ticket)
        if retry_after is None:
            ahead_s = sum(self._queues.queued_s[: ticket.current_tier + 1])
            retry_after = self._capacity.retry_after(ticket.candidates, ahead_s, now)
        self._out.rejections.append(Rejection(ticket, code, retry_after, message))

    def _leave(self, ticket: Ticket, state: TicketState, now: float) -> None:
        self._queues.discard(ticket, state)
        ticket.waited_s += now - ticket.queued_at
        self._charges.unclaim(ticket)

    def _enforce_bounds(self, ticket: Ticket, now: float) -> None:
        out = self._queues.overflow(ticket, self._tiers[ticket.current_tier].max_queue,
                                    self._settings.max_queue)
        if out is not None:
            self._reject(out, "queue_full" if out is ticket else "evicted", now)
