"""Provider health and limits, pure: what a grant may spend, and what comes back."""

from __future__ import annotations

import random

import pytest

from proxy.core.call.classify import Principal
from proxy.core.call.retry import RetryAllowance
from proxy.core.call.route import Deployment
from proxy.core.health.breaker import BreakerSettings
from proxy.core.health.fleet import Fleet, Start, Verdict
from proxy.core.health.provider import Provider
from proxy.core.scheduling.scheduler import Scheduler, SchedulerSettings, Ticket, TierSpec

DEPLOYMENT = Deployment("p", "m")


def fleet(rpm: int | None = None, tpm: int | None = None, retry_ratio: float = 0.2,
          breaker: BreakerSettings | None = None) -> tuple[Fleet, Scheduler]:
    provider = Provider("p", "openai", 4, rpm=rpm, tpm=tpm,
                        breaker=breaker or BreakerSettings())
    scheduler = Scheduler(SchedulerSettings(tiers=(TierSpec("only"),)), {"p": 4},
                          {DEPLOYMENT.id: "p"})
    key = Principal("k", rpm=2, tpm=1000)
    return Fleet(scheduler, {"p": provider}, [DEPLOYMENT], [key], retry_ratio,
                 random.Random(0)), scheduler


def test_an_open_breaker_takes_nothing_from_the_buckets() -> None:
    f, _ = fleet(rpm=1, breaker=BreakerSettings(consecutive_failures=1))
    assert f.begin(DEPLOYMENT, False, 10, 0.0) is Start.GO
    f.end(DEPLOYMENT, Verdict.FAILURE, 0.1, 0.0, 10, None)
    assert f.down(DEPLOYMENT.id, 0.2)
    assert f.begin(DEPLOYMENT, False, 10, 0.2) is Start.DOWN
    requests = f.provider_rates["p"].requests
    assert requests is not None
    assert requests.available(0.2) == pytest.approx(0.0, abs=0.01)  # the one call


def test_a_retry_the_allowance_refuses_gives_its_tokens_back() -> None:
    f, _ = fleet(tpm=1000, retry_ratio=0.0)
    f.retry_allowances["p"] = RetryAllowance(ratio=0.0, min_per_s=0.0)
    assert f.begin(DEPLOYMENT, True, 600, 0.0) is Start.RETRIES_SPENT
    tokens = f.provider_rates["p"].tokens
    assert tokens is not None and tokens.available(0.0) == 1000


def test_a_spent_rate_limit_pauses_the_provider_until_it_refills() -> None:
    f, scheduler = fleet(rpm=60)
    for _ in range(60):
        assert f.begin(DEPLOYMENT, False, 1, 0.0) is Start.GO
    assert f.begin(DEPLOYMENT, False, 1, 0.0) is Start.RATE_LIMITED
    assert scheduler.paused_until("p") == pytest.approx(1.0)


@pytest.mark.parametrize(("verdict", "used", "left"), [
    (Verdict.SUCCESS, 100, 900),   # reconciled with the usage reported
    (Verdict.FAILURE, None, 1000),  # refused before any output: the tokens come back
    (Verdict.THROTTLED, None, 1000),
])
def test_provider_tokens_are_reconciled_with_what_the_call_used(
    verdict: Verdict, used: int | None, left: int
) -> None:
    f, _ = fleet(tpm=1000)
    assert f.begin(DEPLOYMENT, False, 600, 0.0) is Start.GO
    f.end(DEPLOYMENT, verdict, 0.0, 0.0, 600, used)
    assert f.provider_rates["p"].tokens is not None
    assert f.provider_rates["p"].tokens.available(0.0) == pytest.approx(left)


def test_a_keys_share_is_reconciled_with_its_usage_or_refunded() -> None:
    f, _ = fleet()
    assert f.take_key("k", 600, 0.0) == 0.0
    f.reconcile_key("k", 600, 100, 0.0)  # used 100 of the 600 it was charged
    assert f.take_key("k", 900, 0.0) == 0.0
    f.reconcile_key("k", 900, None, 0.0)  # never went upstream: everything back
    assert f.key_rates["k"].tokens is not None
    assert f.key_rates["k"].tokens.available(0.0) == pytest.approx(900)
    assert f.take_key("k", 1, 0.0) == 0.0  # the refunded call's request came back too
    assert f.take_key("k", 1, 0.0) > 0  # two requests a minute: both spent


@pytest.mark.parametrize(("others", "paused"), [(0, True), (3, False)])
def test_a_429_pauses_the_deployment_only_when_nothing_else_was_running(
    others: int, paused: bool
) -> None:
    f, scheduler = fleet()
    tickets = [Ticket(0, (DEPLOYMENT.id,), 1.0) for _ in range(others + 1)]
    for t in tickets:
        scheduler.submit(t, 0.0)
    f.end(DEPLOYMENT, Verdict.THROTTLED, 0.5, 0.0, 10, None, retry_after_s=2.0,
          beside=others)
    assert (scheduler.paused_until(DEPLOYMENT.id) > 0.5) is paused
    assert scheduler.capacity("p") == (2 if others == 0 else max(2, others))


def test_a_late_429_of_a_burst_cuts_to_what_the_provider_bore_when_it_was_sent() -> None:
    """Eight calls sent at once to a provider that bears three: the fourth to seventh are
    refused. Each was sent beside the calls before it, so the limit comes down to three,
    whatever is still in flight when each 429 arrives."""
    f, scheduler = fleet()
    scheduler.set_max("p", 8, 0.0)
    tickets = [Ticket(0, (DEPLOYMENT.id,), 1.0) for _ in range(8)]
    for t in tickets:
        scheduler.submit(t, 0.0)
    assert [t.beside for t in tickets] == list(range(8))
    for t in reversed(tickets[3:]):  # the latest refusals arrive first
        f.end(DEPLOYMENT, Verdict.THROTTLED, 0.1, 0.0, 10, None, beside=t.beside)
        scheduler.give_back(t, 0.1)
    assert scheduler.capacity("p") == 3
