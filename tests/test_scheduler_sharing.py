"""Weighted sharing of slot-seconds across tiers, on a fake clock."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import pytest

from proxy.core.scheduler import Dispatch, Ticket, TierSpec
from tests.scheduler_kit import drain, make, occupy, ticket


def simulate_share(weights: Sequence[float], ests: Sequence[float], slots: int,
                   horizon: float) -> list[float]:
    """Every tier always backlogged; calls run exactly their estimate. Slot-seconds used
    per tier by the end."""
    tiers = [TierSpec(f"t{i}", w, max_wait_s=1e9) for i, w in enumerate(weights)]
    s = make({"p": slots}, tiers, headroom_scale=0.0, tier_promote_after_s=None)
    used = [0.0] * len(weights)
    running: list[tuple[float, int, int]] = []

    def top_up(now: float) -> list[Dispatch]:
        got: list[Dispatch] = []
        for tier, est in enumerate(ests):
            while s.depth(tier) < 3:
                result = s.submit(ticket(tier, est), now)
                got += result.woken
                if result.dispatch:
                    got.append(result.dispatch)
        return got

    def start(now: float, dispatches: list[Dispatch]) -> None:
        for d in dispatches:
            heapq.heappush(running, (now + d.ticket.est_service_s, d.ticket.order,
                                     d.ticket.tier))
            used[d.ticket.tier] += d.ticket.est_service_s

    now = 0.0
    start(now, top_up(now))
    while now < horizon:
        now = heapq.heappop(running)[0]
        start(now, s.release("p", now))
        start(now, top_up(now))
    return used


@pytest.mark.parametrize(("weights", "ests", "slots"), [
    ((1, 1), (1.0, 1.0), 1),
    ((2, 1), (1.0, 1.0), 1),
    ((2, 1), (0.5, 4.0), 2),          # a weight is a share of slot time, not of calls
    ((1, 3), (3.0, 0.3), 1),          # the less urgent tier may have the larger share
    ((8, 4, 2, 1), (0.5, 2.0, 8.0, 20.0), 4),
])
def test_weights_share_slot_seconds(weights: tuple[float, ...], ests: tuple[float, ...],
                                    slots: int) -> None:
    used = simulate_share(weights, ests, slots, horizon=8_000.0)
    total = sum(used)
    for w, u in zip(weights, used, strict=True):
        assert u / total == pytest.approx(w / sum(weights), rel=0.05)


def test_idle_tier_banks_no_credit() -> None:
    tiers = (TierSpec("a", 1, max_wait_s=1e9), TierSpec("b", 1, max_wait_s=1e9))
    s = make(tiers=tiers, headroom_scale=0.0, quantum_s=5.0)
    now = 0.0
    occupy(s, now, tier=1)
    for _ in range(1000):  # tier b alone for a long time
        s.submit(ticket(1, 1.0), now)
        now += 1.0
        assert [d.ticket.tier for d in s.release("p", now)] == [1]
    for _ in range(50):  # tier a now has a backlog too
        s.submit(ticket(0, 1.0), now)
    for _ in range(50):
        s.submit(ticket(1, 1.0), now)
    order = [t.tier for t in drain(s, now)]
    run_of_a = order.index(1)
    assert 1 <= run_of_a <= 6  # a gets a quantum's worth first, not the 1000 s b had alone
    assert order[:40].count(0) == pytest.approx(20, abs=4)


def test_urgent_tier_within_its_share_goes_first() -> None:
    """Urgent calls use 20 % of the slot (their share is 8/9): whenever the slot frees while
    one waits, it goes next, however much low work is queued."""
    s = make({"p": 1}, headroom_scale=0.0)
    now, next_urgent, busy_until = 0.0, 0.0, 0.0
    urgent_waiting: list[Ticket] = []
    picked_urgent = 0
    while now < 2000.0:
        while s.depth(3) < 3:
            got = s.submit(ticket(3, 5.0), now).dispatch
            busy_until = now + 5.0 if got else busy_until
        if now >= next_urgent:
            urgent = ticket(0, 0.2)
            if s.submit(urgent, now).dispatch:
                busy_until = now + 0.2
            else:
                urgent_waiting.append(urgent)
            next_urgent += 1.0
        if now >= busy_until:
            dispatched = s.release("p", now)
            assert len(dispatched) == 1
            if urgent_waiting:
                assert dispatched[0].ticket is urgent_waiting.pop(0)
                picked_urgent += 1
            busy_until = now + dispatched[0].ticket.est_service_s
        now = min(next_urgent, busy_until)
    assert picked_urgent > 100
