"""The attempt policy, pure: events in, commands out, on a fake clock with no sockets."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.config import Config
from proxy.core.call.attempts import (
    HELD_POLL_S,
    LEASE_LOST,
    LEASE_TIMED_OUT,
    LEASED,
    Attempts,
)
from proxy.core.call.budgets import HELD, SPENT, Budget, Budgets, Refusal
from proxy.core.call.classify import Principal, RequestFacts
from proxy.core.call.commands import (
    Command,
    Done,
    Fail,
    Hold,
    LeaseSlot,
    PassThrough,
    Queue,
    Reserve,
    Result,
    Send,
    Wait,
)
from proxy.core.call.tokens import TokenCounter
from proxy.core.engine import Engine
from proxy.core.errors import (
    QueueTimeout,
    UpstreamAuthError,
    UpstreamConnectError,
    UpstreamUnavailable,
)
from proxy.core.formats.request import BodyLimits, parse_call
from proxy.core.health.fleet import Verdict
from proxy.core.scheduling.scheduler import Dispatch, TicketState

from .conftest import config_from

WALL = 1_767_225_600.0  # a wall time for the budgets' periods
CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}'


def sim(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "kind": "simulated", "max_concurrency": 2, **extra}


def engine_for(config: Config) -> Engine:
    return Engine(scheduler=config.scheduler, classify=config.classify,
                  providers=config.providers, models=config.models,
                  principals=[k.principal for k in config.keys], retry=config.retry,
                  estimate=config.estimate, rng=random.Random(1))


class Call:
    """One call through the policy, with the scheduler's decisions fed back by hand."""

    def __init__(self, engine: Engine, body: bytes = CHAT,
                 principal: Principal | None = None, now: float = 0.0) -> None:
        self.engine = engine
        call = parse_call(body, "chat", BodyLimits(), TokenCounter(None))
        facts = RequestFacts({}, call.model, 10, "hi", call.stream, call.service_tier)
        self.plan = engine.plan(call, facts, principal or Principal("anonymous"), now)
        self.attempts = Attempts(engine, self.plan)
        self.command: Command = self.attempts.start(now)

    def queue(self, now: float) -> Command:
        """Carry out a Queue command: submit, and report the scheduler's decision if it
        made one at once (else the command stays, and ``wake`` moves time on)."""
        assert isinstance(self.command, Queue), self.command
        ticket = self.command.ticket
        self.engine.scheduler.submit(ticket, now)
        return self._decided(now)

    def wake(self, now: float) -> Command:
        self.engine.scheduler.advance(now)
        return self._decided(now)

    def _decided(self, now: float) -> Command:
        decisions = self.engine.scheduler.take()
        ticket = self.attempts.ticket
        for r in decisions.rejections:
            if r.ticket is ticket:
                self.command = self.attempts.refused(r.code, r.retry_after_s, now)
        for d in decisions.dispatches:
            if d.ticket is ticket:
                self.command = self.attempts.granted(d.deployment, now)
        return self.command

    def finish(self, now: float, verdict: Verdict, **result: Any) -> Command:
        assert isinstance(self.command, Send), self.command
        self.command = self.attempts.finished(Result(verdict, **result), now)
        return self.command


def test_a_successful_call_goes_queue_send_done_and_gives_its_slot_back() -> None:
    engine = engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x"}]}))
    call = Call(engine)
    assert isinstance(call.queue(0.0), Send)
    assert call.finish(1.0, Verdict.SUCCESS, status=200, prompt_tokens=12,
                       completion_tokens=7) == Done()
    assert engine.scheduler.inflight("a") == 0
    assert call.attempts.usage is not None and call.attempts.usage.total == 19


def test_a_429_queues_the_call_again_in_its_place_and_sends_it_when_the_pause_ends() -> None:
    engine = engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x"}]}))
    call = Call(engine)
    call.queue(0.0)
    command = call.finish(0.5, Verdict.THROTTLED, status=429, retry_after_s=2.0)
    assert isinstance(command, Queue) and command.ticket is call.attempts.ticket
    assert command.ticket.candidates == ("a/x",)  # the paused deployment stays a candidate
    assert call.queue(0.5) is command  # waits: the deployment is paused until 2.5
    assert engine.scheduler.next_wakeup(0.5) == pytest.approx(2.5)
    assert isinstance(call.wake(2.5), Send)
    assert command.ticket.arrived == 0.0
    assert engine.scheduler.capacity("a") == 1  # and the provider's limit was cut


def test_a_throttled_call_past_its_deadline_gets_the_proxys_queue_timeout() -> None:
    engine = engine_for(config_from(
        [sim("a")], {"m": [{"provider": "a", "model": "x"}]},
        tiers=[{"name": "only", "max_wait_s": 10}]))
    call = Call(engine)
    call.queue(0.0)
    now = 0.0
    while isinstance(call.command, Send):
        now += 1.0
        call.finish(now, Verdict.THROTTLED, status=429, retry_after_s=3.0)
        call.queue(now)
        wake = engine.scheduler.next_wakeup(now)
        assert wake is not None
        now = wake
        call.wake(now)
    assert isinstance(call.command, Fail) and isinstance(call.command.error, QueueTimeout)
    assert now == pytest.approx(10.0)


def test_a_5xx_moves_to_the_next_candidate_then_passes_the_last_answer_through() -> None:
    engine = engine_for(config_from(
        [sim("a"), sim("b")],
        {"m": [{"provider": "a", "model": "x"}, {"provider": "b", "model": "y"}]},
        retry={"max_attempts": 2}))
    call = Call(engine)
    assert call.queue(0.0) == Send(engine.models["m"].candidates[0])
    command = call.finish(0.1, Verdict.FAILURE, status=503)
    assert isinstance(command, Queue) and command.ticket.candidates == ("b/y",)
    assert call.queue(0.1) == Send(engine.models["m"].candidates[1])
    assert call.finish(0.2, Verdict.FAILURE, status=500) == PassThrough()


def test_a_529_overload_falls_back_pauses_the_deployment_and_spares_its_breaker() -> None:
    engine = engine_for(config_from(
        [sim("a", breaker={"consecutive_failures": 1}), sim("b")],
        {"m": [{"provider": "a", "model": "x"}, {"provider": "b", "model": "y"}]}))
    call = Call(engine)
    assert call.queue(0.0) == Send(engine.models["m"].candidates[0])
    command = call.finish(0.1, Verdict.OVERLOADED, status=529, retry_after_s=4.0)
    assert isinstance(command, Queue) and command.ticket.candidates == ("b/y",)
    assert call.queue(0.1) == Send(engine.models["m"].candidates[1])
    assert not engine.fleet.breakers["a/x"].down(0.2)  # an overload is not a failure
    assert engine.scheduler.capacity("a") == 2  # nor a sign of the concurrency it bears
    second = Call(engine, now=0.2)  # the overloaded deployment pauses for its retry-after
    assert second.queue(0.2) == Send(engine.models["m"].candidates[1])
    assert call.finish(0.3, Verdict.SUCCESS, status=200) == Done()


def test_an_overloaded_only_candidate_is_tried_again_once_its_pause_ends() -> None:
    engine = engine_for(config_from([sim("a", breaker={"consecutive_failures": 1})],
                                    {"m": [{"provider": "a", "model": "x"}]}))
    call = Call(engine)
    call.queue(0.0)
    command = call.finish(0.1, Verdict.OVERLOADED, status=529, retry_after_s=2.0)
    if isinstance(command, Wait):
        call.command = command = call.attempts.resume(command.until)
    assert isinstance(command, Queue)
    assert call.queue(0.5) is command  # paused until 2.1
    assert isinstance(call.wake(2.1), Send)
    assert not engine.fleet.breakers["a/x"].down(2.1)


def test_a_failed_only_candidate_is_tried_again_after_a_backoff_within_the_allowance() -> None:
    engine = engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x"}]}))
    call = Call(engine)
    call.queue(0.0)
    command = call.finish(0.1, Verdict.FAILURE, error=UpstreamConnectError("refused"))
    assert isinstance(command, Wait) and 0.1 <= command.until <= 0.1 + 0.25
    call.command = call.attempts.resume(command.until)
    assert isinstance(call.queue(command.until), Send)  # the retry allowance allows one re-try
    command = call.finish(command.until + 0.1, Verdict.FAILURE,
                          error=UpstreamConnectError("refused"))
    assert isinstance(command, Wait)
    call.command = call.attempts.resume(command.until)
    command = call.queue(command.until)  # the retry allowance is spent: the last error stands
    assert isinstance(command, Fail) and isinstance(command.error, UpstreamConnectError)


def test_an_upstream_401_fails_over_and_never_passes_the_providers_answer_on() -> None:
    engine = engine_for(config_from(
        [sim("a"), sim("b")],
        {"m": [{"provider": "a", "model": "x"}, {"provider": "b", "model": "y"}]}))
    call = Call(engine)
    call.queue(0.0)
    command = call.finish(0.1, Verdict.AUTH, status=401)
    assert isinstance(command, Queue) and command.ticket.candidates == ("b/y",)
    call.queue(0.1)
    command = call.finish(0.2, Verdict.AUTH, status=403)
    assert isinstance(command, Fail) and isinstance(command.error, UpstreamAuthError)
    assert command.error.status == 502


def test_a_spent_provider_rate_limit_pauses_the_provider_and_keeps_the_call_queued() -> None:
    engine = engine_for(config_from([sim("a", rpm=1)], {"m": [{"provider": "a", "model": "x"}]}))
    first, second = Call(engine), Call(engine)
    first.queue(0.0)
    assert isinstance(second.queue(0.0), Queue)  # granted, but the rpm bucket is empty
    assert engine.scheduler.paused_until("a") == pytest.approx(60.0)
    assert second.attempts.ticket is not None
    second.queue(0.0)
    assert second.attempts.ticket.state is TicketState.QUEUED
    first.finish(1.0, Verdict.SUCCESS, status=200)
    assert isinstance(second.wake(60.0), Send)


def test_a_breaker_that_opens_while_the_call_waits_refuses_it_fast() -> None:
    engine = engine_for(config_from(
        [sim("a", max_concurrency=1, breaker={"consecutive_failures": 1, "cooldown_s": 30})],
        {"m": [{"provider": "a", "model": "x"}]}, retry={"max_attempts": 1}))
    first, second = Call(engine), Call(engine)
    first.queue(0.0)
    assert isinstance(second.queue(0.0), Queue)  # waits for the one slot
    first.finish(1.0, Verdict.FAILURE, status=500)
    command = second._decided(1.0)
    assert isinstance(command, Fail) and isinstance(command.error, UpstreamUnavailable)
    assert command.error.retry_after == pytest.approx(29.0, abs=6.0)
    late = Call(engine, now=2.0)
    assert isinstance(late.command, Fail) and isinstance(late.command.error,
                                                         UpstreamUnavailable)


def test_a_keys_share_is_refunded_when_its_call_never_goes_upstream() -> None:
    config = config_from([sim("a", max_concurrency=1)], {"m": [{"provider": "a", "model": "x"}]},
                         tiers=[{"name": "only", "max_wait_s": 5}],
                         classify={"keys": [{"name": "k", "key": "s", "rpm": 1}]})
    engine = engine_for(config)
    principal = config.keys[0].principal
    first = Call(engine, principal=principal)
    first.queue(0.0)
    assert isinstance(Call(engine, principal=principal).command, Fail)  # over its rpm
    first.finish(1.0, Verdict.SUCCESS, status=200)
    assert isinstance(Call(engine, principal=principal, now=61.0).command, Queue)
    # A call that times out in the queue gives its share back.
    engine.scheduler.pause("a", 1e9, 61.0)
    waiting = Call(engine, principal=principal, now=122.0)
    waiting.queue(122.0)
    assert isinstance(waiting.wake(127.0), Fail)
    assert isinstance(Call(engine, principal=principal, now=127.0).command, Queue)


def test_a_client_that_leaves_gives_the_slot_back_at_any_step() -> None:
    engine = engine_for(config_from([sim("a", max_concurrency=1)],
                                    {"m": [{"provider": "a", "model": "x"}]}))
    running, waiting = Call(engine), Call(engine)
    running.queue(0.0)
    waiting.queue(0.0)
    waiting.attempts.abandon(0.5)  # left while queued
    assert waiting.attempts.ticket is not None
    assert waiting.attempts.ticket.state is TicketState.CANCELLED
    running.attempts.abandon(1.0)  # left while its call was upstream
    assert engine.scheduler.inflight("a") == 0
    running.attempts.abandon(1.0)  # twice is harmless
    assert engine.scheduler.inflight("a") == 0


@pytest.mark.parametrize("max_tokens", [2**62, 2**64 - 1])
def test_a_lying_max_tokens_is_capped_in_every_estimate(max_tokens: int) -> None:
    engine = engine_for(config_from(
        [sim("a", tpm=100_000)],
        {"m": [{"provider": "a", "model": "x", "max_output_tokens": 8000}]}))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d}'
    call = Call(engine, body % max_tokens)
    assert call.plan.output_tokens == 8000
    assert isinstance(call.command, Queue) and call.command.ticket.est_service_s < 1000
    call.queue(0.0)
    call.finish(1.0, Verdict.SUCCESS, status=200, completion_tokens=2**62)
    assert call.attempts.usage is not None and not call.attempts.usage.reported
    assert engine.fleet.provider_rates["a"].tokens is not None
    assert engine.fleet.provider_rates["a"].tokens.available(1.0) >= -100_000
    assert isinstance(Call(engine, now=2.0).queue(2.0), Send)  # nobody else is stuck


def test_n_choices_are_charged_n_times_and_learned_once() -> None:
    engine = engine_for(config_from([sim("a", tpm=100_000)],
                                    {"m": [{"provider": "a", "model": "x"}]},
                                    estimate={"output_tokens": 50}))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100'
    one, three = Call(engine, body + b"}"), Call(engine, body + b', "n": 3}')
    assert one.plan.output_tokens == three.plan.output_tokens == 100
    assert three.plan.tokens - three.plan.prompt_tokens == 300
    assert isinstance(three.command, Queue)
    assert three.command.ticket.est_service_s == pytest.approx(
        one.attempts.start(0.0).ticket.est_service_s)  # type: ignore[union-attr]
    three.queue(0.0)
    three.finish(1.0, Verdict.SUCCESS, status=200, completion_tokens=None)
    assert three.attempts.usage is not None and three.attempts.usage.completion_tokens == 300
    reported = Call(engine, body + b', "n": 3}', now=2.0)
    reported.queue(2.0)
    reported.finish(3.0, Verdict.SUCCESS, status=200, completion_tokens=240)
    assert reported.attempts.usage is not None and reported.attempts.usage.reported
    assert 50 < engine.outputs.expect("anonymous", "m", None) <= 80  # 80 per choice


def test_dispatch_names_the_deployment_the_policy_sends_to() -> None:
    engine = engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x"}]}))
    call = Call(engine)
    assert isinstance(call.command, Queue)
    engine.scheduler.submit(call.command.ticket, 0.0)
    decision = engine.scheduler.take().dispatches[0]
    assert decision == Dispatch(call.command.ticket, "a/x", "a")


def test_degrade_serves_on_an_idle_backup_instead_of_shedding() -> None:
    """The preferred provider has a long backlog of calls only it can serve; the backup is
    idle. The expected wait counts what each provider could really serve, so the call
    moves to the backup at once instead of being shed by a global queue depth."""
    engine = engine_for(config_from(
        [sim("premium", max_concurrency=1), sim("budget", max_concurrency=1)],
        {"m": {"candidates": [{"provider": "premium", "model": "big"},
                              {"provider": "budget", "model": "small"}],
               "degrade": {"max_wait_s": 5, "shed_wait_s": 60}},
         "only": [{"provider": "premium", "model": "big"}]}))
    body = b'{"model": "only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}'
    backlog = [Call(engine, body) for _ in range(40)]
    for call in backlog:
        call.queue(0.0)
    call = Call(engine)
    assert isinstance(call.command, Queue)
    assert call.command.ticket.candidates[0] == "budget/small"
    assert isinstance(call.queue(0.0), Send)


def test_throttling_spends_no_attempt() -> None:
    """A 429 on a, which moves the call to b; a 5xx on b: with two attempts allowed the call
    still goes back to a, because only real failures count against retry.max_attempts
    (the deadline bounds 429s)."""
    engine = engine_for(config_from(
        [sim("a"), sim("b")],
        {"m": [{"provider": "a", "model": "x"}, {"provider": "b", "model": "y"}]},
        retry={"max_attempts": 2}))
    call = Call(engine)
    assert call.queue(0.0) == Send(engine.models["m"].candidates[0])
    call.finish(0.1, Verdict.THROTTLED, status=429, retry_after_s=0.5)
    assert call.queue(0.1) == Send(engine.models["m"].candidates[1])
    command = call.finish(0.2, Verdict.FAILURE, status=500)
    assert isinstance(command, Queue) and command.ticket.candidates == ("a/x",)


# --- a key's budget and slots leased across replicas: commands the driver carries out ---


def budgeted(amount: float = 1.0) -> tuple[Engine, Principal]:
    budget = Budget(amount, "day")
    return (engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x",
                                                       "input_cost": 1, "output_cost": 1}]})),
            Principal("gold", budget=budget))


def test_a_key_with_a_budget_reserves_before_it_is_sent() -> None:
    engine, gold = budgeted()
    call = Call(engine, principal=gold)
    reserve = call.queue(0.0)
    assert isinstance(reserve, Reserve) and reserve.deployment.id == "a/x"
    assert 0 < reserve.estimate <= reserve.maximum
    book = Budgets({"gold": gold.budget})  # type: ignore[dict-item]
    got = book.admit("gold", reserve.estimate, reserve.maximum, WALL)
    assert isinstance(call.attempts.reserved(reserve.deployment, got, 0.0), Send)
    assert call.attempts.reservation is got


@pytest.mark.parametrize(("left", "expected"), [(60.0, Hold), (0.01, Fail)])
def test_a_call_its_budget_holds_gives_its_slot_back_and_waits_or_is_refused(
        left: float, expected: type) -> None:
    """Held (the rest is reserved by calls in flight): its slot goes back, and it waits at
    most HELD_POLL_S, or is refused when too little of its wait is ``left``."""
    engine, gold = budgeted()
    call = Call(engine, principal=gold, now=0.0)
    reserve = call.queue(0.0)
    assert isinstance(reserve, Reserve) and call.attempts.ticket is not None
    at = call.attempts.ticket.deadline - left
    held = Refusal(HELD, "gold", gold.budget, reserve.estimate, 1.0)  # type: ignore[arg-type]
    command = call.attempts.reserved(reserve.deployment, held, at)
    assert isinstance(command, expected)
    assert engine.scheduler.inflight("a") == 0
    if isinstance(command, Hold):
        assert command == Hold("gold", at + HELD_POLL_S)
        assert call.attempts.held_over(at + 0.1) == Queue(call.attempts.ticket)  # type: ignore[arg-type]
    else:
        assert isinstance(command, Fail) and command.error.code == "budget_exceeded"


def test_a_spent_budget_refuses_the_call_and_frees_its_slot() -> None:
    engine, gold = budgeted()
    call = Call(engine, principal=gold)
    reserve = call.queue(0.0)
    assert isinstance(reserve, Reserve)
    spent = Refusal(SPENT, "gold", gold.budget, reserve.estimate, 60.0)  # type: ignore[arg-type]
    command = call.attempts.reserved(reserve.deployment, spent, 0.0)
    assert isinstance(command, Fail) and command.error.code == "budget_exceeded"
    assert command.error.retry_after == 60.0 and engine.scheduler.inflight("a") == 0


@pytest.mark.parametrize(("outcome", "expected"), [
    (LEASED, Send), (LEASE_LOST, Queue), (LEASE_TIMED_OUT, Fail), (2.5, Queue)])
def test_across_replicas_a_slot_is_leased_before_the_call_is_sent(
        outcome: str | float, expected: type) -> None:
    engine = engine_for(config_from([sim("a")], {"m": [{"provider": "a", "model": "x"}]}))
    engine.across_replicas = True
    call = Call(engine)
    lease = call.queue(0.0)
    assert isinstance(lease, LeaseSlot) and lease.ask.provider == "a"
    assert isinstance(call.attempts.leased(lease.deployment, outcome, 0.1), expected)
    if expected is not Send:
        assert engine.scheduler.inflight("a") == 0
    if outcome == 2.5:  # the provider's shared rpm/tpm is spent: it pauses here that long
        assert engine.scheduler.paused_until("a") == pytest.approx(2.6)
