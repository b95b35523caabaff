"""A reload in the pure core: ``Scheduler.reconfigure`` and ``Engine.reconfigure`` keep every
queued and running call, in its place, with its deadline; state survives for whatever still
exists; nothing leaks, whatever the change."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.scheduling.scheduler import SchedulerSettings, Ticket, TicketState, TierSpec

from .scheduler_kit import FOUR, Kit, ticket

THREE = (TierSpec("critical", 8), TierSpec("normal", 2), TierSpec("low", 1))


def reconfigure(kit: Kit, tiers: tuple[TierSpec, ...], tier_map: list[int],
                caps: dict[str, int], now: float,
                deployments: dict[str, str] | None = None) -> None:
    kit.s.reconfigure(SchedulerSettings(tiers=tiers), caps, deployments or {}, tier_map, now)
    kit.collect()


def test_queued_calls_keep_their_order_and_deadlines_and_a_vanished_tier_moves() -> None:
    kit = Kit({"p": 1})
    running = kit.occupy(0.0, tier=1)
    waiting = [ticket(t) for t in (3, 1, 3, 2)]
    for i, t in enumerate(waiting):
        kit.submit(t, 0.1 * (i + 1))
    deadlines = [t.deadline for t in waiting]
    # "high" (1) is gone: its calls go to the default tier (normal, now 1).
    reconfigure(kit, THREE, [0, 1, 1, 2], {"p": 1}, 1.0)
    assert [t.tier for t in waiting] == [2, 1, 2, 1]
    assert [t.deadline for t in waiting] == deadlines
    assert all(t.state is TicketState.QUEUED for t in waiting)
    assert running.tier == 1 and kit.s.snapshot(1.0)["providers"]["p"][  # type: ignore[index]
        "running_by_tier"] == [0, 1, 0]
    order = kit.drain(2.0)
    # Normal before low; among each, arrival order.
    assert order == [waiting[1], waiting[3], waiting[0], waiting[2]]
    assert kit.s.inflight("p") == 0 and kit.s.snapshot(3.0)["queued"] == 0


def test_a_raised_limit_serves_waiting_calls_at_once_and_a_lowered_one_keeps_running_calls(
) -> None:
    kit = Kit({"p": 2})
    a, b = kit.occupy(0.0), kit.occupy(0.0)
    waiting = [ticket(2) for _ in range(3)]
    for t in waiting:
        kit.submit(t, 0.5)
    reconfigure(kit, FOUR, [0, 1, 2, 3], {"p": 4}, 1.0)
    assert [kit.granted(t) for t in waiting] == [True, True, False]
    reconfigure(kit, FOUR, [0, 1, 2, 3], {"p": 1}, 2.0)
    assert kit.s.inflight("p") == 4 and kit.s.capacity("p") == 1
    for t in (a, b, waiting[0]):
        assert kit.finish(t, 3.0) == []  # still above the new limit
    assert kit.finish(waiting[1], 3.0) == [waiting[2]]


def test_a_provider_that_left_serves_the_calls_that_still_name_it() -> None:
    kit = Kit({"p": 1, "q": 1}, deployments={"q/m": "q"})
    kit.occupy(0.0, provider="q")
    waiting = ticket(1, candidates=("q/m",))
    kit.submit(waiting, 0.5)
    kit.s.pause("q/m", 1.5, 0.6)
    reconfigure(kit, FOUR, [0, 1, 2, 3], {"p": 1}, 1.0)
    assert kit.s.paused_until("q/m") == 1.5  # its state is kept
    assert kit.release("q", 1.2) == []
    kit.advance(1.5)
    assert kit.granted(waiting)
    kit.finish(waiting, 2.0)
    assert kit.s.inflight("q") == 0


def test_new_providers_and_deployments_are_added() -> None:
    kit = Kit({"p": 1})
    reconfigure(kit, FOUR, [0, 1, 2, 3], {"p": 1, "r": 2}, 0.0, {"r/x": "r"})
    t = ticket(0, candidates=("r/x",))
    kit.submit(t, 0.1)
    assert kit.granted(t) and t.pool == "r"


def test_a_bad_tier_map_is_refused() -> None:
    kit = Kit({"p": 1})
    for tier_map in ([0, 1, 2], [0, 1, 2, 3, 0], [0, 1, 2, 5]):
        try:
            reconfigure(kit, THREE, tier_map, {"p": 1}, 0.0)
        except ValueError:
            continue
        raise AssertionError(f"{tier_map} accepted")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_no_call_is_lost_and_no_slot_leaks_across_reloads(data: st.DataObject) -> None:
    """Random arrivals, releases and reloads (tiers dropped or kept, limits changed):
    every ticket ends dispatched-and-released or refused with a code, concurrency never
    exceeds the limit in force for new dispatches, and every slot comes back."""
    tier_sets = [FOUR, THREE, FOUR[:2], (TierSpec("only", 1),)]
    kit = Kit({"p": 2, "q": 1}, deployments={"q/m": "q"})
    tiers = FOUR
    tickets: list[Ticket] = []
    now = 0.0
    for _ in range(data.draw(st.integers(5, 40))):
        now += data.draw(st.floats(0.0, 5.0))
        action = data.draw(st.sampled_from(["submit", "submit", "release", "retry",
                                             "reload"]))
        if action == "submit":
            t = ticket(data.draw(st.integers(0, len(tiers) - 1)),
                       data.draw(st.floats(0.1, 5.0)),
                       data.draw(st.sampled_from([("p",), ("q/m",), ("p", "q/m")])))
            tickets.append(t)
            kit.submit(t, now)
        elif action == "retry":  # a released call queues again, maybe after a reload
            released = [t for t in tickets if t.state is TicketState.RELEASED]
            if released:
                kit.submit(data.draw(st.sampled_from(released)), now)
        elif action == "release":
            busy = [t for ts in kit.running.values() for t in ts]
            if busy:
                kit.finish(data.draw(st.sampled_from(busy)), now)
        else:
            new = data.draw(st.sampled_from(tier_sets))
            names = [spec.name for spec in new]
            default = data.draw(st.integers(0, len(new) - 1))
            tier_map = [names.index(s.name) if s.name in names else default for s in tiers]
            caps = {"p": data.draw(st.integers(0, 3)), "q": data.draw(st.integers(1, 2))}
            reconfigure(kit, new, tier_map, caps, now)
            tiers = new
        for pool in ("p", "q"):
            running = kit.s.snapshot(now)["providers"][pool]  # type: ignore[index]
            assert sum(running["running_by_tier"]) == kit.s.inflight(pool)
    # Everything left runs out.
    for _ in range(len(tickets) + 1):
        now += 1000.0
        kit.advance(now)
        busy = [t for ts in kit.running.values() for t in ts]
        for t in busy:
            kit.finish(t, now)
    for t in tickets:
        assert t.state in (TicketState.RELEASED, TicketState.REJECTED), t
        assert (t in kit.refused) == (t.state is TicketState.REJECTED)
        if t.generation == kit.s.generation:
            assert 0 <= t.ceiling <= t.current_tier <= t.tier < len(tiers)
    assert kit.s.inflight("p") == kit.s.inflight("q") == 0
    assert kit.s.snapshot(now)["queued"] == 0 and not math.isnan(now)


def test_a_call_running_through_a_reload_is_re_queued_in_its_place_and_claims_stay_capped(
) -> None:
    """Found in review: a call running during a reload kept its old virtual start, so its
    re-try went behind every call queued since; and queued calls were re-tagged with their
    uncapped estimates, so one absurd estimate put its key's later calls far behind."""
    kit = Kit({"p": 1})
    first = kit.occupy(0.0, tier=2)
    queued = [ticket(2, 10.0) for _ in range(20)]
    for t in queued:
        kit.submit(t, 0.0)
    absurd = ticket(2, 50_000.0, key="liar")
    kit.submit(absurd, 0.5)
    reconfigure(kit, FOUR, [0, 1, 2, 3], {"p": 1}, 1.0)
    kit.running["p"].remove(first)
    kit.s.give_back(first, 1.0)  # its re-try: the slot goes to the next call meanwhile
    kit.collect()
    kit.submit(first, 1.0)
    assert first.tag <= min(t.tag for t in queued if t.state is TicketState.QUEUED)
    later = ticket(2, 1.0, key="liar")
    kit.submit(later, 2.0)
    assert later.tag <= 30.0  # the absurd call was charged the longest level's bound, 30 s
