"""What a call decides about a slot leased across replicas, pure: the shared state's
answers fed in by hand on a fake clock, the commands and the local scheduler checked."""

from __future__ import annotations

import pytest

from proxy.core.call import leases
from proxy.core.call.commands import Fail, Queue, Send
from proxy.core.engine import Engine
from proxy.core.errors import QueueTimeout
from proxy.core.health.fleet import Verdict
from proxy.core.scheduling.tickets import Ticket

from .conftest import config_from
from .test_attempts import Call, engine_for, sim

TIERS = [{"name": "high", "max_wait_s": 10}, {"name": "low", "max_wait_s": 60}]


def engine(slots: int = 2) -> Engine:
    return engine_for(config_from([sim("a", max_concurrency=slots)],
                                  {"m": [{"provider": "a", "model": "x"}]}, tiers=TIERS))


def granted_locally(engine: Engine, call: Call, now: float) -> str:
    """The local scheduler gives the call a slot; the lease is asked for next."""
    assert isinstance(call.command, Queue)
    ticket = call.command.ticket
    engine.scheduler.submit(ticket, now)
    (dispatch,) = [d for d in engine.scheduler.take().dispatches if d.ticket is ticket]
    return dispatch.deployment


def test_the_ask_names_the_provider_its_limit_and_the_waiters_place() -> None:
    e = engine(slots=3)
    call = Call(e, now=0.0)
    deployment = call.attempts.candidate(granted_locally(e, call, 1.0))
    ask = leases.lease_ask(call.attempts, deployment, 4.0)
    ticket = call.attempts.ticket
    assert ticket is not None
    assert (ask.provider, ask.limit, ask.key) == ("a", 3, ticket.key)
    assert ask.rank == leases.rank(ticket) == ticket.current_tier * leases.LEVELS + ticket.standing
    assert ask.waited_s == pytest.approx(4.0 - ticket.arrived)
    assert ask.max_wait_s == pytest.approx(call.plan.deadline - 4.0)
    late = leases.lease_ask(call.attempts, deployment, call.plan.deadline + 5)
    assert late.max_wait_s == 0.0


def test_a_tier_goes_before_any_level_of_a_less_urgent_one() -> None:
    urgent, relaxed = Ticket(0, ("a/x",), 1.0), Ticket(1, ("a/x",), 1.0)
    urgent.current_tier, urgent.standing = 0, 40  # levels past the last share its rank
    relaxed.current_tier, relaxed.standing = 1, 0
    assert leases.rank(urgent) == leases.LEVELS - 1 < leases.rank(relaxed)


def test_the_deadline_in_the_lease_queue_gives_the_slot_back_and_fails_the_call() -> None:
    e = engine()
    call = Call(e)
    granted_locally(e, call, 0.0)
    assert e.scheduler.inflight("a") == 1
    command = leases.lease_timed_out(call.attempts, 10.0)
    assert isinstance(command, Fail) and isinstance(command.error, QueueTimeout)
    assert e.scheduler.inflight("a") == 0


def test_redis_gone_while_waiting_queues_the_call_again_under_the_local_share() -> None:
    e = engine()
    call = Call(e)
    deployment = granted_locally(e, call, 0.0)
    command = leases.lease_lost(call.attempts, 1.0)
    assert isinstance(command, Queue) and command.ticket is call.attempts.ticket
    assert e.scheduler.inflight("a") == 0
    call.command = command
    assert isinstance(call.queue(1.0), Send)  # the local slot is its at once
    assert call.attempts.deployment is not None
    assert call.attempts.deployment.id == deployment


def test_a_spent_shared_rate_pauses_the_provider_and_the_call_waits_in_its_place() -> None:
    e = engine()
    call = Call(e)
    granted_locally(e, call, 0.0)
    command = leases.rate_spent(call.attempts, "a", 2.5, 1.0)
    assert isinstance(command, Queue) and e.scheduler.inflight("a") == 0
    call.command = command
    assert isinstance(call.queue(1.0), Queue)  # paused: it waits
    assert e.scheduler.next_wakeup(1.0) == pytest.approx(3.5)
    assert isinstance(call.wake(3.5), Send)


def test_a_call_makes_room_only_where_its_providers_local_slots_are_all_taken() -> None:
    e = engine(slots=1)
    first = Call(e)
    granted_locally(e, first, 0.0)
    second = Call(e)
    assert isinstance(second.command, Queue)
    ticket = second.command.ticket
    assert leases.withdrawals(second.attempts, ticket) == [
        ("a", (ticket.tier + 1) * leases.LEVELS - 1)]
    e.scheduler.give_back(first.attempts.ticket, 0.1)  # type: ignore[arg-type]
    assert leases.withdrawals(second.attempts, ticket) == []


@pytest.mark.parametrize(("used", "verdict", "reconciled"), [
    (None, None, leases.Reconciliation(1, 100, False)),  # never went: request and tokens back
    (40, Verdict.SUCCESS, leases.Reconciliation(0, 60, False)),
    (None, Verdict.THROTTLED, leases.Reconciliation(0, 100, True)),  # a 429 cuts the limit
    (100, Verdict.ABANDONED, leases.Reconciliation(0, 0, False)),
])
def test_an_ended_attempt_gives_back_what_it_did_not_use(
        used: int | None, verdict: Verdict | None, reconciled: leases.Reconciliation) -> None:
    assert leases.reconciliation(100, used, verdict) == reconciled
