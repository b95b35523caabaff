"""Spend budgets per key (``budget_usd: {amount, period: day|month}``): calendar periods in
the configured timezone, daylight saving included; a spent key gets 429 budget_exceeded
with retry-after to the period's end; bad budgets are config errors."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import ConfigError
from proxy.core.call.budgets import (
    GO,
    HELD,
    SPENT,
    TOO_BIG,
    Budget,
    Budgets,
    Refusal,
    Reservation,
    call_cost,
    decide,
    decide_share,
    period_of,
)
from proxy.core.call.classify import Principal, RequestFacts
from proxy.core.call.tokens import TokenCounter
from proxy.core.clock import FakeClock, SystemClock
from proxy.core.formats.request import BodyLimits, Kind, parse_call
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream
from .test_attempts import engine_for

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
UTC = ZoneInfo("UTC")
NEW_YORK = ZoneInfo("America/New_York")


def at(tz: ZoneInfo, *fields: int) -> float:
    return datetime(*fields, tzinfo=tz).timestamp()  # type: ignore[misc]


@pytest.mark.parametrize(("period", "tz", "wall", "start", "end"), [
    ("day", UTC, (2026, 11, 30, 23, 59), (2026, 11, 30), (2026, 12, 1)),
    ("month", UTC, (2026, 12, 31, 12), (2026, 12, 1), (2027, 1, 1)),
    ("month", UTC, (2028, 2, 29, 1), (2028, 2, 1), (2028, 3, 1)),
    # 8 March 2026: New York springs forward, the day has 23 hours.
    ("day", NEW_YORK, (2026, 3, 8, 12), (2026, 3, 8), (2026, 3, 9)),
    ("day", NEW_YORK, (2026, 11, 1, 0, 30), (2026, 11, 1), (2026, 11, 2)),
])
def test_periods_are_calendar_periods_in_the_timezone(
        period: str, tz: ZoneInfo, wall: tuple[int, ...], start: tuple[int, ...],
        end: tuple[int, ...]) -> None:
    assert period_of(period, at(tz, *wall), tz) == (at(tz, *start), at(tz, *end))
    if tz is NEW_YORK and start == (2026, 3, 8):
        assert at(tz, *end) - at(tz, *start) == 23 * 3600
    if tz is NEW_YORK and start == (2026, 11, 1):
        assert at(tz, *end) - at(tz, *start) == 25 * 3600


NOON = at(UTC, 2026, 11, 30, 12)


@pytest.mark.parametrize(("spent", "reserved", "estimate", "verdict"), [
    (0.0, 0.0, 0.5, GO),
    (0.4, 0.5, 0.1, GO),  # exactly the amount
    (0.4, 0.5, 0.2, HELD),  # it fits beside the spend, not beside the calls in flight
    (0.9, 0.0, 0.2, SPENT),
    (1.0, 0.0, 0.0, SPENT),
    (0.0, 0.0, 1.5, TOO_BIG),  # never, whatever is spent
    (0.0, 3.0, 0.0, HELD),
])
def test_the_rule(spent: float, reserved: float, estimate: float, verdict: str) -> None:
    assert decide(1.0, spent, reserved, estimate) == verdict


def test_a_reservation_holds_its_ceiling_until_it_settles_at_its_real_cost() -> None:
    clock = FakeClock(wall_start=NOON)
    budgets = Budgets({"app": Budget(1.0, "day")})
    first = budgets.admit("app", 0.1, 0.5, clock.wall())
    second = budgets.admit("app", 0.1, 0.4, clock.wall())
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    assert (budgets.spent("app", clock.wall()), budgets.reserved("app", clock.wall())) == (
        0.0, 0.9)
    held = budgets.admit("app", 0.2, 0.5, clock.wall())
    assert isinstance(held, Refusal) and held.reason == HELD
    assert budgets.check("app", 0.2, clock.wall()) is None  # arrival weighs the spend only
    budgets.settle(first, 0.15)
    budgets.settle(first, 5.0)  # twice: nothing more
    assert budgets.spent("app", clock.wall()) == pytest.approx(0.15)
    assert budgets.reserved("app", clock.wall()) == pytest.approx(0.4)
    third = budgets.admit("app", 0.2, 0.5, clock.wall())  # 0.15 + 0.4 + 0.2 fits now
    assert isinstance(third, Reservation)
    for bad in (math.nan, -5.0, math.inf):  # a cost that is no number counts nothing
        budgets.settle(third, bad)
    budgets.settle(second, 0.8)
    clock.advance(60)
    spent = budgets.admit("app", 0.1, 0.5, clock.wall())
    assert isinstance(spent, Refusal) and spent.reason == SPENT
    assert spent.retry_after_s == 12 * 3600 - 60  # to midnight
    refusal = budgets.check("app", 0.1, clock.wall())
    assert refusal is not None and refusal.reason == SPENT
    assert budgets.snapshot(clock.wall()) == {"app": {
        "amount_usd": 1.0, "period": "day", "spent_usd": 0.95, "reserved_usd": 0.0,
        "resets_in_s": 12 * 3600 - 60}}
    # No budget: nothing reserved, nothing kept.
    assert budgets.admit("other", 5.0, 5.0, clock.wall()) is None
    budgets.spend("other", 100.0, clock.wall())
    assert budgets.check("other", 5.0, clock.wall()) is None
    assert budgets.spent("other", clock.wall()) == 0.0


def test_a_call_whose_estimate_alone_passes_the_whole_budget_is_refused_outright() -> None:
    budgets = Budgets({"app": Budget(1.0, "day")})
    refusal = budgets.admit("app", 1.2, 1.5, NOON)  # nothing spent, nothing in flight
    assert isinstance(refusal, Refusal) and refusal.reason == TOO_BIG
    assert refusal.retry_after_s == 12 * 3600
    arrival = budgets.check("app", 1.2, NOON)
    assert arrival is not None and arrival.reason == TOO_BIG
    # A maximum above the whole budget is allowed: the estimate is what is expected.
    assert isinstance(budgets.admit("app", 0.2, 1.5, NOON), Reservation)


def test_each_period_starts_over_and_a_call_counts_for_the_period_it_was_sent_in() -> None:
    clock = FakeClock(wall_start=at(UTC, 2026, 11, 30, 23, 59, 50))
    budgets = Budgets({"app": Budget(1.0, "day")})
    late = budgets.admit("app", 0.5, 0.6, clock.wall())
    assert isinstance(late, Reservation)
    budgets.spend("app", 0.5, clock.wall())  # a call sent without a reservation
    clock.advance(20)  # 1 December
    assert budgets.spent("app", clock.wall()) == 0.0
    assert budgets.reserved("app", clock.wall()) == 0.0
    budgets.settle(late, 0.6)  # ran past midnight: November's
    assert budgets.spent("app", clock.wall()) == 0.0
    assert budgets.spent_in("app", late.start) == pytest.approx(1.1)
    assert isinstance(budgets.admit("app", 0.9, 0.9, clock.wall()), Reservation)
    # Ended periods with nothing in flight are forgotten; a reload keeps what was spent,
    # a budget removed stops refusing.
    assert budgets.spent_in("app", late.start) == 0.0
    budgets.configure({"app": Budget(5.0, "day")}, "UTC")
    assert budgets.reserved("app", clock.wall()) == pytest.approx(0.9)
    budgets.configure({}, "UTC")
    assert budgets.check("app", 100.0, clock.wall()) is None
    assert budgets.admit("app", 100.0, 100.0, clock.wall()) is None


@pytest.mark.parametrize(("mine", "reserved", "estimate", "verdict"), [
    (1.0, 0.0, 0.5, GO),  # its share is (9 - 3) / 3 = 2 since Redis went away
    (1.0, 0.5, 0.5, GO),
    (1.0, 0.6, 0.5, HELD),
    (2.6, 0.0, 0.5, SPENT),
    (1.0, 0.0, 2.5, SPENT),  # more than its share, not more than the budget
    (1.0, 0.0, 9.5, TOO_BIG),
])
def test_without_redis_a_replica_spends_its_share_of_what_was_left(
        mine: float, reserved: float, estimate: float, verdict: str) -> None:
    # 9 a day, 2 spent by the others and 1 by this replica when Redis was last heard.
    assert decide_share(9.0, 2.0, 1.0, mine + 1.0, reserved, estimate, 3) == verdict
    assert decide_share(9.0, 9.0, 0.0, 0.0, 0.0, 0.1, 3) == SPENT


def test_a_calls_estimate_and_ceiling_at_its_deployments_prices(counter: TokenCounter) -> None:
    config = config_from(
        [{"name": "p", "kind": "simulated"}],
        {"m": [{"provider": "p", "model": "x", "input_cost": 1000, "output_cost": 2000,
                "max_output_tokens": 4000}],
         "e": [{"provider": "p", "model": "y", "input_cost": 1000}]})
    engine = engine_for(config)

    def plan(kind: Kind, body: dict[str, Any], model: str = "m") -> Any:
        call = parse_call(orjson.dumps({"model": model, **body}), kind, BodyLimits(), counter)
        facts = RequestFacts({}, call.model, 100, "hi", call.stream, call.service_tier)
        return engine.plan(call, facts, Principal("app"), 0.0)

    messages = [{"role": "user", "content": "hi"}]
    chat = plan("chat", {"messages": messages})
    deployment = chat.route.candidates[0]
    # 100 prompt tokens at $1000/M, 256 expected out (the prior) or 4000 at most, at $2000/M.
    assert call_cost(chat, deployment) == pytest.approx((0.1 + 0.512, 0.1 + 8.0))
    asked = plan("chat", {"messages": messages, "max_tokens": 10_000, "n": 2})
    # The estimate trusts max_tokens up to max_output_tokens; the maximum is what it allows.
    assert call_cost(asked, deployment) == pytest.approx((0.1 + 16.0, 0.1 + 40.0))
    embedding = plan("embeddings", {"input": "hi"}, "e")
    assert call_cost(embedding, embedding.route.candidates[0]) == pytest.approx((0.1, 0.1))


STEP = st.tuples(st.booleans(), st.integers(0, 10**6), st.floats(0.0, 4.0),
                st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 30.0))


@settings(max_examples=300, deadline=None)
@given(st.floats(0.1, 10.0), st.lists(STEP, min_size=1, max_size=60))
def test_spend_never_passes_the_amount_by_more_than_one_call(
        amount: float, steps: list[tuple[bool, int, float, float, float, float]]) -> None:
    """Any interleaving of calls arriving and ending, with estimates anywhere below their
    maximum costs and real costs anywhere up to them: the spend passes the amount by at most
    one call's real cost, and a call is refused or held only when the rule says so."""
    clock = FakeClock(wall_start=NOON)
    budgets = Budgets({"k": Budget(amount, "day")})
    running: list[tuple[Reservation, float]] = []
    most = 0.0  # the costliest call sent
    for ends, which, maximum, estimated, costs, pause in steps:
        wall = clock.wall()
        if running and ends:
            reservation, cost = running.pop(which % len(running))
            budgets.settle(reservation, cost)
        else:
            estimate, cost = maximum * estimated, maximum * costs
            spent, reserved = budgets.spent("k", wall), budgets.reserved("k", wall)
            got = budgets.admit("k", estimate, maximum, wall)
            if isinstance(got, Reservation):
                assert spent + reserved + estimate <= amount
                running.append((got, cost))
                most = max(most, cost)
            else:
                assert got is not None
                assert got.reason == decide(amount, spent, reserved, estimate) != GO
        clock.advance(pause)
        assert budgets.spent("k", clock.wall()) <= amount + most + 1e-9
    for reservation, cost in running:
        budgets.settle(reservation, cost)
    assert budgets.spent("k", clock.wall()) <= amount + most + 1e-9
    assert budgets.reserved("k", clock.wall()) == 0.0


@pytest.mark.parametrize(("budget", "message"), [
    ({"amount": 0, "period": "day"}, "budget_usd.amount: must be a positive number"),
    ({"amount": -1, "period": "day"}, "budget_usd.amount: must be a positive number"),
    ({"amount": ".nan", "period": "day"}, "budget_usd.amount: must be a"),
    ({"amount": "lots", "period": "day"}, "budget_usd.amount: must be a number"),
    ({"amount": 5, "period": "week"}, "budget_usd.period: must be one of day, month"),
    ({"amount": 5}, "budget_usd.period: is required"),
    ({"period": "day"}, "budget_usd.amount: is required"),
    ({"amount": 5, "period": "day", "currency": "eur"}, "budget_usd.currency: unknown key"),
])
def test_bad_budgets_are_config_errors(budget: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from([{"name": "p", "kind": "simulated"}], {"m": [{"provider": "p",
                                                                  "model": "x"}]},
                    classify={"keys": [{"name": "app", "key": "k", "budget_usd": budget}]})
    assert message in str(info.value), str(info.value)


class ShiftedClock(SystemClock):
    """The real clock, with the wall clock set to a chosen moment."""

    def __init__(self, wall: float) -> None:
        self.shift = wall - time.time()

    def wall(self) -> float:
        return time.time() + self.shift


async def test_a_spent_key_gets_429_until_the_period_ends(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(usage={"prompt_tokens": 1000, "completion_tokens": 1000,
                               "total_tokens": 2000})
    server = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "p", "base_url": str(server.make_url("/v1")), "api_key": "sk"}],
        {"m": [{"provider": "p", "model": "up", "input_cost": 1000, "output_cost": 1000}]},
        classify={"keys": [{"name": "app", "key": "app-key",
                            "budget_usd": {"amount": 3, "period": "month"}},
                           {"name": "free", "key": "free-key"}]})
    clock = ShiftedClock(at(UTC, 2026, 11, 30, 22))
    client: Client = await aiohttp_client(build_app(config, counter=counter, clock=clock))
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="app-key",
                             max_retries=2)
    messages: Any = [{"role": "user", "content": "hi"}]
    for _ in range(2):  # $2 each: the second passes the amount and is still served
        await sdk.chat.completions.create(model="m", messages=messages)
    with pytest.raises(openai.RateLimitError) as info:
        await sdk.chat.completions.create(model="m", messages=messages)
    error = info.value
    assert error.code == "budget_exceeded" and "$3" in error.message
    assert error.response.headers["x-should-retry"] == "false"  # the SDK did not retry
    assert int(error.response.headers["retry-after"]) == pytest.approx(2 * 3600, abs=2)
    assert len(fake.seen) == 2
    # Other keys are not affected; status and metrics show the spend.
    free = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="free-key")
    await free.chat.completions.create(model="m", messages=messages)
    status = client.app[SERVICE].status()
    assert status["budgets"] == {"app": {"amount_usd": 3.0, "period": "month",  # type: ignore[index]
                                         "spent_usd": 4.0, "reserved_usd": 0.0,
                                         "resets_in_s": pytest.approx(7200, abs=2)}}
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_budget_spent_usd{key="app"} 4.0' in metrics
    assert 'proxy_budget_usd{key="app"} 3.0' in metrics
    assert 'proxy_rejections_total{code="budget_exceeded",tier="normal"} 1.0' in metrics
    # December: a new month.
    clock.shift += 2 * 3600
    await sdk.chat.completions.create(model="m", messages=messages)


async def test_queued_calls_never_start_past_the_budget(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.2, usage={"prompt_tokens": 1000, "completion_tokens": 1000,
                                           "total_tokens": 2000})
    server = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "p", "base_url": str(server.make_url("/v1")), "api_key": "sk",
          "max_concurrency": 1}],
        {"m": [{"provider": "p", "model": "up", "input_cost": 1000, "output_cost": 1000}]},
        classify={"keys": [{"name": "app", "key": "app-key",
                            "budget_usd": {"amount": 1, "period": "day"}}]})
    client: Client = await aiohttp_client(build_app(config, counter=counter))

    async def call() -> int:
        resp = await client.post("/v1/chat/completions", headers={
            "Authorization": "Bearer app-key"}, json={"model": "m", "messages": [
                {"role": "user", "content": "hi"}]})
        return resp.status

    statuses = await asyncio.gather(*(call() for _ in range(5)))
    assert sorted(statuses) == [200, 429, 429, 429, 429] and len(fake.seen) == 1
    assert client.app[SERVICE].scheduler.inflight("p") == 0


def one_dollar_calls(server_url: str, budget: float, **sections: Any) -> Any:
    """A provider whose calls cost $1 (1000 tokens out at $1000/M; the prompt is free) and
    may cost $4.096 (the default max_output_tokens), and a key with ``budget``."""
    return config_from(
        [{"name": "p", "base_url": server_url, "api_key": "sk", "max_concurrency": 20}],
        {"m": [{"provider": "p", "model": "up", "output_cost": 1000}]},
        classify={"keys": [{"name": "app", "key": "app-key",
                            "budget_usd": {"amount": budget, "period": "day"}}]},
        **sections)


async def post(client: Client, **body: Any) -> tuple[int, Mapping[str, str], Any]:
    resp = await client.post("/v1/chat/completions", headers={
        "Authorization": "Bearer app-key"}, json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}], **body})
    return resp.status, resp.headers, await resp.json()


ONE_DOLLAR = {"prompt_tokens": 5, "completion_tokens": 1000, "total_tokens": 1005}


async def test_many_calls_at_once_spend_the_budget_and_at_most_one_call_more(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.1, usage=ONE_DOLLAR)
    server = await aiohttp_server(fake.app())
    config = one_dollar_calls(str(server.make_url("/v1")), 3)
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    answers = await asyncio.gather(*(post(client) for _ in range(12)))
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    # The calls held while others were in flight waited for room instead of being
    # refused: the budget is used, and passed by at most one call.
    assert 3 <= len(fake.seen) <= 4 and len(served) == len(fake.seen)
    for status, headers, body in refused:
        assert status == 429 and body["error"]["code"] == "budget_exceeded"
        assert headers["x-should-retry"] == "false"
    budgets = client.app[SERVICE].status()["budgets"]["app"]  # type: ignore[index]
    assert budgets["spent_usd"] == len(fake.seen) and budgets["reserved_usd"] == 0


async def test_a_call_held_until_its_deadline_is_refused_with_a_short_retry_after(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=1.5, usage=ONE_DOLLAR)
    server = await aiohttp_server(fake.app())
    config = one_dollar_calls(str(server.make_url("/v1")), 4,
                              tiers=[{"name": "normal", "max_wait_s": 0.5}])
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    first = asyncio.ensure_future(post(client))
    await asyncio.sleep(0.1)  # it runs, its $4.096 reserved: the rest is too little
    status, headers, body = await post(client)
    assert status == 429 and body["error"]["code"] == "budget_exceeded"
    assert "reserved by its calls in flight" in body["error"]["message"]
    assert headers["x-should-retry"] == "true" and headers["retry-after"] == "1"
    assert (await first)[0] == 200 and len(fake.seen) == 1
    assert (await post(client))[0] == 200  # settled at $1: room again


async def test_a_call_costing_more_than_the_whole_budget_is_refused_on_arrival(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(usage=ONE_DOLLAR)
    server = await aiohttp_server(fake.app())
    config = one_dollar_calls(str(server.make_url("/v1")), 0.5)
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    status, headers, body = await post(client, max_tokens=1000)  # estimated at $1
    assert status == 429 and body["error"]["code"] == "budget_exceeded"
    assert "whole budget of $0.5 a day" in body["error"]["message"]
    assert headers["x-should-retry"] == "false" and fake.seen == []
    assert (await post(client, max_tokens=100))[0] == 200  # $0.10 is fine


async def test_a_call_whose_client_leaves_is_charged_its_estimate(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=5, usage=ONE_DOLLAR)
    server = await aiohttp_server(fake.app())
    config = one_dollar_calls(str(server.make_url("/v1")), 5)
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(0.3):
            await post(client, max_tokens=500)
    service = client.app[SERVICE]
    async with asyncio.timeout(5):
        while service.status()["budgets"]["app"]["reserved_usd"]:  # type: ignore[index]
            await asyncio.sleep(0.02)
    # The upstream bills what it produced, and nothing reports it: the estimate counts.
    assert service.budgets.spent("app", service.clock.wall()) == pytest.approx(0.5, abs=0.01)
