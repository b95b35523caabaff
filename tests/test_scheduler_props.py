"""Invariants of the scheduler under random traffic, time jumps and capacity changes."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from proxy.core.scheduler import (
    Dispatch,
    Rejection,
    Scheduler,
    SchedulerSettings,
    Ticket,
    TicketState,
    TierSpec,
)

PROVIDERS = ("a", "b")
TIERS = (
    TierSpec("urgent", 4.0, max_wait_s=15.0),
    TierSpec("normal", 2.0, max_wait_s=40.0, max_queue=6, reserve=1),
    TierSpec("batch", 1.0, max_wait_s=90.0),
)
# Wake-ups land a hair past the exact instant (so rounding never makes them early).
LATE_S = 1e-4
# Enough wake-ups to cross any time jump below; more means a hot loop.
MAX_WAKEUPS_PER_JUMP = 500


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(
            SchedulerSettings(tiers=TIERS, max_queue=10, promote_after_s=(1e9, 2.0, 6.0, 12.0),
                              tier_promote_after_s=25.0, headroom_horizon_s=10.0,
                              headroom_scale=1.5),
            {"a": 3, "b": 1},
        )
        self.now = 0.0
        self.tickets: list[Ticket] = []
        self.running: list[Ticket] = []
        self.dispatched: set[int] = set()
        self.ended: dict[int, str] = {}
        self.lowered: set[str] = set()

    def record(self, dispatches: list[Dispatch], rejections: tuple[Rejection, ...] | list[
            Rejection] = ()) -> None:
        for r in rejections:
            assert id(r.ticket) not in self.ended and id(r.ticket) not in self.dispatched
            assert r.ticket.state is TicketState.REJECTED
            assert 1.0 <= r.retry_after_s <= 120.0
            self.ended[id(r.ticket)] = r.code
        for d in dispatches:
            t = d.ticket
            assert id(t) not in self.dispatched and id(t) not in self.ended, "dispatched twice"
            assert d.provider in t.candidates
            assert self.s.capacity(d.provider) >= self.s.inflight(d.provider)
            self.dispatched.add(id(t))
            self.running.append(t)

    @initialize(est=st.sampled_from([3.0, 12.0, 45.0]))
    def urgent_work_flows(self, est: float) -> None:
        """Start with urgent demand on ``a`` so its headroom is in play from the first step."""
        self.submit(0, est, ("a",))

    @rule(tier=st.integers(0, 2), est=st.sampled_from([0.2, 0.9, 3.0, 12.0, 45.0]),
          candidates=st.sampled_from([("a",), ("b",), ("a", "b"), ("b", "a")]))
    def submit(self, tier: int, est: float, candidates: tuple[str, ...]) -> None:
        t = Ticket(tier=tier, candidates=candidates, est_service_s=est)
        self.tickets.append(t)
        result = self.s.submit(t, self.now)
        own = [result.dispatch] if result.dispatch else []
        self.record(own + list(result.woken), result.rejections)
        if result.dispatch:
            assert result.dispatch.ticket is t

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50))
    def release(self, index: int) -> None:
        t = self.running.pop(index % len(self.running))
        assert t.provider is not None
        self.record(self.s.release(t.provider, self.now, self.now - t.dispatched_at))

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
            dispatches, rejections = self.s.advance(self.now)
            self.record(dispatches, rejections)
        else:
            raise AssertionError("wake-ups do not make progress")
        self.now = target
        wakeup = self.s.next_wakeup(self.now)
        assert wakeup is None or wakeup > self.now

    @rule(provider=st.sampled_from(PROVIDERS), limit=st.integers(0, 4))
    def set_capacity(self, provider: str, limit: int) -> None:
        if limit < self.s.inflight(provider):
            self.lowered.add(provider)
        self.record(self.s.set_capacity(provider, limit, self.now))

    @rule(provider=st.sampled_from(PROVIDERS), available=st.booleans())
    def set_available(self, provider: str, available: bool) -> None:
        before = self.s.inflight(provider)
        self.record(self.s.set_available(provider, available, self.now))
        if not available:
            assert self.s.inflight(provider) == before

    @rule(weights=st.none() | st.dictionaries(st.integers(0, 2), st.sampled_from([0.5, 1, 9])),
          reserves=st.none() | st.dictionaries(st.integers(0, 2), st.integers(0, 3)))
    def set_policy(self, weights: dict[int, float] | None, reserves: dict[int, int] | None) -> None:
        self.record(self.s.set_policy(weights, reserves, self.now))

    @invariant()
    def books_balance(self) -> None:
        queued = [t for t in self.tickets if t.state is TicketState.QUEUED]
        assert sum(self.s.depth(i) for i in range(len(TIERS))) == len(queued) <= 10
        for t in self.tickets:
            if t.state is TicketState.DISPATCHED:
                assert id(t) in self.dispatched
            elif t.state is not TicketState.QUEUED:
                assert id(t) in self.ended
        for provider in PROVIDERS:
            running = sum(1 for t in self.running if t.provider == provider)
            assert self.s.inflight(provider) == running
            if provider not in self.lowered:
                assert running <= self.s.capacity(provider)
            elif running <= self.s.capacity(provider):
                self.lowered.discard(provider)

    @invariant()
    def no_idle_slot_while_an_eligible_call_waits(self) -> None:
        snapshot = self.s.snapshot(self.now)["providers"]
        assert isinstance(snapshot, dict)
        for t in self.tickets:
            if t.state is not TicketState.QUEUED:
                continue
            for provider in t.candidates:
                if not snapshot[provider]["available"]:
                    continue
                free = self.s.capacity(provider) - self.s.inflight(provider)
                assert free <= self.s.held_back(provider, t.current_tier, self.now), (
                    f"{provider} idles while {t} waits"
                )

    def teardown(self) -> None:
        for provider in PROVIDERS:
            self.record(self.s.set_available(provider, True, self.now))
            self.record(self.s.set_capacity(provider, 2, self.now))
        while self.running:
            self.release(0)
        self.time_passes(500.0)
        while self.running:
            self.release(0)
        for t in self.tickets:
            assert t.state in (TicketState.DISPATCHED, TicketState.REJECTED,
                               TicketState.CANCELLED), t
        assert all(self.s.depth(i) == 0 for i in range(len(TIERS)))


SchedulerMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=30,
                                              deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase
