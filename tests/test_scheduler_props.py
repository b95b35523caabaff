"""Invariants of the scheduler under random traffic, re-tries, time jumps, pauses, breakers
and limit changes: no slot leaked, no call lost or served twice, concurrency never above
the limit (nor a half-open deployment's probes), no slot idle while a call it may serve
waits except for a stated hold, every deadline exact."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from proxy.core.scheduling.scheduler import (
    HOLD_PATIENCE,
    Scheduler,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)

POOLS = ("a", "b")
DEPLOYMENTS = {"a/x": "a", "a/y": "a", "b/x": "b"}
CANDIDATES = (("a/x",), ("a/y",), ("b/x",), ("a/x", "b/x"), ("b/x", "a/y"), ("a/y", "a/x"))
TIERS = (
    TierSpec("urgent", 4.0, max_wait_s=15.0),
    TierSpec("normal", 2.0, max_wait_s=40.0, max_queue=6, reserve=1),
    TierSpec("batch", 1.0, max_wait_s=90.0),
)
# Wake-ups land a hair past the exact instant (so rounding never makes them early).
LATE_S = 1e-4
# Enough wake-ups to cross any time jump below; more means a hot loop.
MAX_WAKEUPS_PER_JUMP = 500


def scheduler(budget: float, reserve: int | None = 1) -> Scheduler:
    tiers = (TIERS[0], replace(TIERS[1], reserve=reserve), TIERS[2])
    return Scheduler(
        SchedulerSettings(tiers=tiers, max_queue=10, promote_after_s=(1e9, 2.0, 6.0, 12.0),
                          tier_promote_after_s=25.0, headroom_horizon_s=10.0,
                          headroom_spread=1.5, headroom_budget=budget),
        {"a": 3, "b": 1}, DEPLOYMENTS,
    )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = scheduler(0.2)
        self.now = 0.0
        self.tickets: list[Ticket] = []
        self.running: list[Ticket] = []
        self.finished: list[Ticket] = []  # slot back, may be queued again
        self.ended: dict[int, str] = {}
        self.probes: dict[str, int] = {}

    def collect(self) -> None:
        decisions = self.s.take()
        for r in decisions.rejections:
            t = r.ticket
            assert id(t) not in self.ended, "refused twice"
            assert t.state is TicketState.REJECTED and t not in self.running
            assert 1.0 <= r.retry_after_s <= 120.0
            if r.code == "queue_timeout":
                assert t.deadline <= self.now + LATE_S, "refused before its deadline"
            self.ended[id(t)] = r.code
        for d in decisions.dispatches:
            t = d.ticket
            assert t not in self.running and id(t) not in self.ended, "dispatched twice"
            assert d.deployment in t.candidates and DEPLOYMENTS[d.deployment] == d.pool
            assert self.now < t.deadline + LATE_S, "served after its deadline"
            self.running.append(t)

    @initialize(est=st.sampled_from([3.0, 12.0, 45.0]),
                budget=st.sampled_from([0.2, 0.02, 0.004]), reserve=st.sampled_from([1, None]))
    def urgent_work_flows(self, est: float, budget: float, reserve: int | None) -> None:
        """Start with urgent demand on ``a`` so its headroom is in play from the first step,
        under a budget its holds spend in tens of seconds, in one or two, or at once; the
        middle tier's fixed reserve of one slot, or adaptive holds alone."""
        self.s = scheduler(budget, reserve)
        self.submit(0, est, ("a/x",), 0)

    @rule(tier=st.integers(0, 2), est=st.sampled_from([0.2, 0.9, 3.0, 12.0, 45.0]),
          candidates=st.sampled_from(CANDIDATES), ceiling=st.integers(0, 2))
    def submit(self, tier: int, est: float, candidates: tuple[str, ...], ceiling: int) -> None:
        t = Ticket(tier=tier, candidates=candidates, est_service_s=est,
                   ceiling=min(ceiling, tier))
        self.tickets.append(t)
        self.s.submit(t, self.now)
        self.collect()

    @rule(calls=st.integers(2, 12), every=st.sampled_from([0.3, 0.6, 1.2]),
          long=st.sampled_from([3.0, 45.0]))
    def urgent_stream(self, calls: int, every: float, long: float) -> None:
        """Short urgent calls on ``a``, each done in 0.2 s, and halfway through less urgent
        calls that wait: between the urgent calls the headroom holds ``a``'s free slots
        for the next one and spends its budget doing so."""
        for i in range(calls):
            if i == calls // 2:
                for _ in range(3):
                    self.submit(2, long, ("a/x",), 0)
            self.submit(0, 0.2, ("a/x",), 0)
            self.time_passes(0.2)
            mine = [t for t in self.running if t.tier == 0 and t.est_service_s == 0.2]
            if mine:
                self.running.remove(mine[-1])
                self.s.release(mine[-1], self.now, 0.2)
                self.finished.append(mine[-1])
                self.collect()
            self.time_passes(every - 0.2)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50), took=st.sampled_from([None, 0.0, 1.0, 100.0]))
    def release(self, index: int, took: float | None) -> None:
        t = self.running.pop(index % len(self.running))
        self.s.release(t, self.now, took)
        self.finished.append(t)
        self.collect()

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50))
    def give_back(self, index: int) -> None:
        """A grant that goes back unused (the provider's rate limit was spent)."""
        t = self.running.pop(index % len(self.running))
        self.s.give_back(t, self.now)
        self.finished.append(t)
        self.collect()

    @precondition(lambda self: self.finished)
    @rule(index=st.integers(0, 50))
    def requeue(self, index: int) -> None:
        """A 429 or a re-try: the call goes back with its arrival and deadline."""
        t = self.finished.pop(index % len(self.finished))
        arrived, deadline, order = t.arrived, t.deadline, t.order
        self.s.submit(t, self.now)
        assert (t.arrived, t.deadline, t.order) == (arrived, deadline, order)
        self.collect()

    @rule(index=st.integers(0, 200))
    def cancel(self, index: int) -> None:
        if not self.tickets:
            return
        t = self.tickets[index % len(self.tickets)]
        was_queued = t.state is TicketState.QUEUED
        self.s.cancel(t, self.now)
        if was_queued:
            assert t.state is TicketState.CANCELLED
            self.ended[id(t)] = "cancelled"

    @rule(dt=st.sampled_from([0.0, 0.1, 1.0, 3.0]) | st.floats(0.0, 60.0))
    def time_passes(self, dt: float) -> None:
        """The shell's timer fires at every wake-up the scheduler asks for."""
        target = self.now + dt
        for _ in range(MAX_WAKEUPS_PER_JUMP):
            wakeup = self.s.next_wakeup(self.now)
            quiet_until = target if wakeup is None else min(wakeup, target)
            if quiet_until - LATE_S > self.now:  # nothing may become eligible in between
                self.now = quiet_until - LATE_S
                self.no_idle_slot_while_an_eligible_call_waits()
            if wakeup is None or wakeup > target:
                break
            assert wakeup >= self.now
            self.now = wakeup
            self.s.advance(self.now)
            self.collect()
        else:
            raise AssertionError("wake-ups do not make progress")
        self.now = target
        wakeup = self.s.next_wakeup(self.now)
        assert wakeup is None or wakeup > self.now

    @rule(what=st.sampled_from((*POOLS, *DEPLOYMENTS)), seconds=st.sampled_from([0.5, 5.0]))
    def pause(self, what: str, seconds: float) -> None:
        self.s.pause(what, self.now + seconds, self.now)
        self.collect()

    @rule(deployment=st.sampled_from(tuple(DEPLOYMENTS)), seconds=st.sampled_from([1.0, 8.0]),
          probes=st.integers(1, 2))
    def breaker_opens(self, deployment: str, seconds: float, probes: int) -> None:
        self.s.set_down(deployment, self.now + seconds, probes, self.now)
        self.probes[deployment] = probes
        self.collect()

    @rule(deployment=st.sampled_from(tuple(DEPLOYMENTS)))
    def breaker_closes(self, deployment: str) -> None:
        self.s.set_up(deployment, self.now)
        self.probes.pop(deployment, None)
        self.collect()

    @rule(pool=st.sampled_from(POOLS), bore=st.integers(0, 4))
    def throttled(self, pool: str, bore: int) -> None:
        self.s.cut(pool, self.now, bore)
        self.collect()

    @rule(pool=st.sampled_from(POOLS), limit=st.integers(0, 4))
    def set_max(self, pool: str, limit: int) -> None:
        self.s.set_max(pool, limit, self.now)
        self.collect()

    @rule(weights=st.none() | st.dictionaries(st.integers(0, 2), st.sampled_from([0.5, 1, 9])),
          reserves=st.none() | st.dictionaries(st.integers(0, 2), st.integers(0, 3)))
    def set_policy(self, weights: dict[int, float] | None, reserves: dict[int, int] | None) -> None:
        self.s.set_policy(weights, reserves, self.now)
        self.collect()

    @invariant()
    def books_balance(self) -> None:
        queued = [t for t in self.tickets if t.state is TicketState.QUEUED]
        assert sum(self.s.depth(i) for i in range(len(TIERS))) == len(queued) <= 10
        for t in self.tickets:
            if t.state is TicketState.DISPATCHED:
                assert t in self.running
            elif t.state is TicketState.RELEASED:
                assert t in self.finished
            elif t.state is not TicketState.QUEUED:
                assert id(t) in self.ended
            assert t.current_tier >= t.ceiling, "aged past its caller's ceiling"
        for pool in POOLS:
            assert self.s.inflight(pool) == sum(1 for t in self.running if t.pool == pool)

    @invariant()
    def concurrency_stays_within_the_limits(self) -> None:
        gates = self.s._gates
        for deployment, probes in self.probes.items():
            gate = gates[deployment]
            if gate.down_until <= self.now:
                assert gate.inflight <= probes or gate.inflight == sum(
                    1 for t in self.running if t.deployment == deployment
                    and t.dispatched_at < gate.down_until)

    @invariant()
    def no_idle_slot_while_an_eligible_call_waits(self) -> None:
        gates = self.s._gates
        for pool in POOLS:
            free = self.s._pools[pool].free(self.now)
            if free <= 0:
                continue
            eligible = [t for t in self.tickets if t.state is TicketState.QUEUED and any(
                gates[d].pool.name == pool and gates[d].open(self.now) for d in t.candidates)]
            if eligible:
                urgent = min(t.current_tier for t in eligible)
                pressed = min(t.deadline for t in eligible if t.current_tier == urgent)
                used = 1 - (pressed - self.now) / TIERS[urgent].max_wait_s
                assert free <= self.s.held_back(pool, urgent, self.now), (
                    f"{pool} idles while {eligible[0]} waits")
                assert used < HOLD_PATIENCE + 1e-3, f"{pool} holds a slot from a pressed call"

    def teardown(self) -> None:
        for deployment in DEPLOYMENTS:
            self.s.set_up(deployment, self.now)
        for pool in POOLS:
            self.s.set_max(pool, 2, self.now)
        self.collect()
        while self.running:
            self.release(0, None)
        self.time_passes(500.0)
        while self.running:
            self.release(0, None)
        for t in self.tickets:
            assert t.state in (TicketState.RELEASED, TicketState.REJECTED,
                               TicketState.CANCELLED), t
        assert all(self.s.depth(i) == 0 for i in range(len(TIERS)))


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30,
                                              deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_a_cut_that_ends_a_hold_lets_the_waiting_call_in() -> None:
    """Found by the machine: the headroom's allowance is a share of the provider's limit, so a
    429 that cuts the limit can leave the holds past their allowance at once; the call they
    kept waiting must go then, not at the next wake-up."""
    state = SchedulerMachine()
    state.urgent_work_flows(est=3.0, budget=0.2, reserve=None)
    state.give_back(index=0)
    state.urgent_stream(calls=5, every=0.6, long=3.0)
    state.urgent_stream(calls=11, every=0.6, long=3.0)
    state.throttled(bore=0, pool="a")
    state.no_idle_slot_while_an_eligible_call_waits()
