"""What each provider can take right now: slots per pool, gates per deployment.

A *pool* is one provider's slots: ``limit`` calls at once, an effective limit that adapts
between 1 and ``max_concurrency``, and at most the *room* set from outside (what a
self-hosted server's own figures, or the latency an upstream shows, leave for the proxy's
calls: ``limit_source`` says which of these holds the limit now). A 429 cuts it to the
concurrency the provider was actually seen to bear (the calls still in flight when it
refused one), by at most half;
every ``GROW_EVERY_S`` without a 429 it grows back by one (an eighth of itself when
that is more), so a provider whose real limit is lower than configured is used right up
to that limit, probed above it about once per ``GROW_EVERY_S``, and a provider that went
quiet after a cut is given its slots back with time alone. A pool may be *paused* (its own
rate limit or quota is spent) until a time.

A *deployment* (``provider/model``) has a gate: *paused* until a time (a 429 with
``retry-after``, the provider's quota headers), *down* until a time (its breaker is open:
queued calls that have no other candidate are refused), and at most ``probes`` calls at
once while its breaker is half-open.

Everything here is state driven by ``now``; ``scheduler`` is its only user.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from .tickets import Ticket

GROW_EVERY_S = 10.0
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 120.0


@dataclass
class Pool:
    name: str
    max_concurrency: int
    limit: int = 0
    inflight: int = 0
    paused_until: float = -math.inf
    running: list[int] = field(default_factory=list)  # calls in flight, per tier
    deployments: list[Gate] = field(default_factory=list)
    adaptive: int = 0  # the limit 429s leave (1 to max_concurrency)
    room: float = math.inf  # what a server's figures or its latency allow (0: nothing)
    room_source: str = "engine"  # "engine" or "latency"
    _grow_at: float = math.inf

    def __post_init__(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError("max_concurrency must not be negative")
        self.adaptive = self.limit = self.max_concurrency

    @property
    def limit_source(self) -> str:
        """What holds the limit now: ``configured``, ``429``, ``engine`` or ``latency``."""
        if self.room < self.adaptive:
            return self.room_source
        return "429" if self.adaptive < self.max_concurrency else "configured"

    @property
    def slots(self) -> int:
        """The slots it has, for a forecast: its ``max_concurrency``, or the room a server's
        figures leave where that is less (a room of 0, figures stale, says nothing)."""
        room = self.room
        return int(room) if 1 <= room < self.max_concurrency else self.max_concurrency

    def set_room(self, room: float, source: str, now: float) -> None:
        """At most ``room`` calls at once from now (``math.inf``: no bound), by what
        ``source`` says; calls running above it keep their slots."""
        if not room >= 0:
            raise ValueError("room must not be negative")
        self._grow(now)
        self.room, self.room_source = room, source
        self.settle()

    def settle(self) -> None:
        """``limit`` from the adaptive limit and the room."""
        room = self.room
        self.limit = self.adaptive if room >= self.adaptive else int(room)

    def free(self, now: float) -> int:
        """Slots that may be handed out at ``now``."""
        if now < self.paused_until:
            return 0
        if now >= self._grow_at:
            self._grow(now)
        free = self.limit - self.inflight
        return free if free > 0 else 0

    def cut(self, now: float, bore: int) -> None:
        """A 429 while ``bore`` other calls were running: that is about what the provider
        bears, so the limit comes down to it (by at most half at a time; a burst of 429s
        from calls already in flight walks it down to the concurrency that is real).
        Growth starts over: the probe above the real limit failed."""
        self._grow(now)
        adaptive = min(self.adaptive, self.limit)  # from the limit in force, a room's too
        self.adaptive = max(min(1, adaptive), min(adaptive, max(-(-adaptive // 2), bore)))
        self._grow_at = now + GROW_EVERY_S if self.adaptive < self.max_concurrency else math.inf
        self.settle()

    def set_max(self, max_concurrency: int, now: float) -> None:
        """A new configured maximum: the limit follows it unless a 429 cut it, in which
        case it keeps growing back, now towards the new maximum."""
        self._grow(now)
        was_full = self.adaptive >= self.max_concurrency
        self.max_concurrency = max_concurrency
        if was_full:
            self.adaptive = max_concurrency
        self.adaptive = min(max(self.adaptive, 1 if max_concurrency else 0), max_concurrency)
        if self.adaptive >= max_concurrency:
            self._grow_at = math.inf
        elif not math.isfinite(self._grow_at):
            self._grow_at = now + GROW_EVERY_S
        self.settle()

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "inflight": self.inflight,
            "limit": self.limit,
            "limit_source": self.limit_source,
            "max_concurrency": self.max_concurrency,
            "paused_for_s": round(max(0.0, self.paused_until - now), 3),
            "running_by_tier": list(self.running),
            "deployments": {
                g.id: {"inflight": g.inflight,
                       "paused_for_s": round(max(0.0, g.paused_until - now), 3),
                       "down_for_s": round(max(0.0, g.down_until - now), 3),
                       "probes": g.probes}
                for g in self.deployments if g.id != self.name
            },
        }

    def next_change(self, now: float) -> float:
        """When ``free`` may next grow by time alone (pause ends, limit grows back)."""
        if now < self.paused_until:
            return self.paused_until
        self._grow(now)
        return self._grow_at

    def _grow(self, now: float) -> None:
        if now < self._grow_at:
            return
        while now >= self._grow_at:
            self.adaptive = min(self.adaptive + max(1, self.adaptive // 8), self.max_concurrency)
            self._grow_at = (self._grow_at + GROW_EVERY_S
                             if self.adaptive < self.max_concurrency else math.inf)
        self.settle()


@dataclass
class Gate:
    """One deployment's own availability, inside its pool's."""

    id: str
    pool: Pool
    inflight: int = 0
    paused_until: float = -math.inf
    down_until: float = -math.inf
    probes: int | None = None  # concurrent calls allowed once down_until passes (half-open)

    def open(self, now: float) -> bool:
        """Whether a call may be sent through this gate at ``now`` (slots aside)."""
        if now < self.paused_until or now < self.down_until:
            return False
        return self.probes is None or self.inflight < self.probes

    def down(self, now: float) -> bool:
        return now < self.down_until

    def next_change(self, now: float) -> float:
        """When ``open`` may turn true by time alone (inf: not by time)."""
        until = max(self.paused_until, self.down_until)
        return until if until > now else math.inf


GatesAndPools = tuple[tuple[Gate, ...], tuple[Pool, ...]]


class Capacity:
    """Every pool and gate by name, and each candidate tuple's gates and pools."""

    def __init__(self, tiers: int) -> None:
        self._tiers = tiers
        self.pools: dict[str, Pool] = {}
        self.gates: dict[str, Gate] = {}
        self._by_candidates: dict[tuple[str, ...], GatesAndPools] = {}

    def add_pool(self, name: str, limit: int) -> None:
        """A provider; its own name also stands for a deployment of it."""
        pool = self.pools[name] = Pool(name, limit, running=[0] * self._tiers)
        gate = self.gates[name] = Gate(name, pool)
        pool.deployments.append(gate)

    def add_gate(self, deployment: str, pool: str) -> None:
        if deployment in self.gates:
            if self.gates[deployment].pool.name != pool:
                raise ValueError(f"deployment {deployment!r} belongs to another provider")
            return
        provider = self.pools[self.known_pool(pool)]
        gate = self.gates[deployment] = Gate(deployment, provider)
        provider.deployments.append(gate)

    def set_max(self, name: str, max_concurrency: int, now: float) -> Pool:
        """A provider's configured concurrency (a new provider is added)."""
        if max_concurrency < 0:
            raise ValueError("max_concurrency must not be negative")
        if name not in self.pools:
            self.add_pool(name, max_concurrency)
        pool = self.pools[name]
        pool.set_max(max_concurrency, now)
        return pool

    def cut(self, name: str, now: float, bore: int) -> Pool:
        """A 429 from provider ``name`` while ``bore`` other calls ran there (``Pool.cut``)."""
        pool = self.pools[self.known_pool(name)]
        pool.cut(now, bore)
        return pool

    def set_room(self, name: str, room: float, source: str, now: float) -> Pool | None:
        """At most ``room`` of the provider's calls at once (``math.inf``: no bound), by a
        self-hosted server's own figures (``source`` "engine") or its latency ("latency");
        calls running above it keep their slots until released. The pool, if it changed."""
        pool = self.pools[self.known_pool(name)]
        if pool.room != room or pool.room_source != source:
            pool.set_room(room, source, now)
            return pool
        return None

    def lower_room(self, name: str, room: float, source: str) -> None:
        """``set_room`` for a room no higher than the one in force (a provider just
        configured)."""
        pool = self.pools[self.known_pool(name)]
        if room < pool.room:
            pool.room, pool.room_source = room, source
            pool.settle()

    def pause(self, target: str, until: float) -> None:
        """Send nothing through a provider (its name) or a deployment until ``until``; a
        later pause never shortens an earlier one."""
        if target in self.pools:
            gate_or_pool: Pool | Gate = self.pools[target]
        else:
            gate_or_pool = self.gates[self.known_gate(target)]
        gate_or_pool.paused_until = max(gate_or_pool.paused_until, until)

    def set_down(self, deployment: str, until: float, probes: int) -> None:
        """The deployment's breaker opened: nothing goes through it until ``until``, then at
        most ``probes`` calls at once until ``set_up``."""
        gate = self.gates[self.known_gate(deployment)]
        gate.down_until = until
        gate.probes = probes

    def set_up(self, deployment: str) -> Pool:
        """The deployment's breaker closed: no probe limit any more. Its pool."""
        gate = self.gates[self.known_gate(deployment)]
        gate.down_until = -math.inf
        gate.probes = None
        return gate.pool

    def recount(self, tiers: int, running: Iterable[Ticket]) -> None:
        """A new number of tiers (a reload): the calls running per tier, counted again
        from the ``running`` tickets, their tiers already renumbered."""
        self._tiers = tiers
        for pool in self.pools.values():
            pool.running = [0] * tiers
        for ticket in running:
            assert ticket.pool is not None
            self.pools[ticket.pool].running[ticket.current_tier] += 1

    def expected_wait_s(self, deployment: str, ahead_s: float, service_s: float,
                        now: float) -> float:
        """``ahead_s`` of queued work and then a call of ``service_s`` shared by the
        deployment's slots, and at least any pause in force."""
        gate = self.gates[deployment]
        pool = gate.pool
        paused = max(pool.paused_until, gate.paused_until, gate.down_until) - now
        busy = ahead_s or pool.free(now) <= 0
        wait = (ahead_s + service_s) / max(pool.limit, 1) if busy else 0.0
        return max(wait, paused, 0.0)

    def retry_after(self, candidates: tuple[str, ...], ahead_s: float, now: float) -> float:
        """For a refused call: the soonest a candidate is back when every one is down, else
        the time its candidates' slots take to serve ``ahead_s`` of queued work."""
        gates = [self.gates[d] for d in candidates]
        if all(g.down(now) for g in gates):
            back = min(g.down_until for g in gates) - now
            return min(max(back, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        slots = sum(p.limit for p in {g.pool.name: g.pool for g in gates}.values())
        drain = ahead_s / slots if slots else RETRY_AFTER_MAX_S
        return min(max(drain, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)

    def known_pool(self, pool: str) -> str:
        if pool not in self.pools:
            raise ValueError(f"unknown provider {pool!r}")
        return pool

    def known_gate(self, deployment: str) -> str:
        if deployment not in self.gates:
            raise ValueError(f"unknown deployment {deployment!r}")
        return deployment

    def gates_and_pools(self, candidates: tuple[str, ...]) -> GatesAndPools:
        """The gates of ``candidates`` and their distinct pools, in preference order."""
        found = self._by_candidates.get(candidates)
        if found is None:
            gates = tuple(self.gates[self.known_gate(d)] for d in candidates)
            pools = tuple({g.pool.name: g.pool for g in gates}.values())
            found = self._by_candidates[candidates] = (gates, pools)
        return found

    def gates_by_pool(self, candidates: tuple[str, ...]) -> dict[str, tuple[Gate, ...]]:
        by_pool: dict[str, list[Gate]] = {}
        for deployment in dict.fromkeys(candidates):
            gate = self.gates[deployment]
            by_pool.setdefault(gate.pool.name, []).append(gate)
        return {pool: tuple(gates) for pool, gates in by_pool.items()}


def first_open(gates: tuple[Gate, ...], now: float) -> Gate:
    """The first gate open at ``now``, else the first (plain loops: this runs per call)."""
    for gate in gates:
        if gate.open(now):
            return gate
    return gates[0]


def all_down(gates: tuple[Gate, ...], now: float) -> bool:
    for gate in gates:  # noqa: SIM110 - all() over a generator costs a frame per call
        if not gate.down(now):
            return False
    return True
