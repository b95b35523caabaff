"""Spend budgets per key (``budget_usd: {amount, period: day|month}``): calendar periods in
the configured timezone, daylight saving included; a spent key gets 429 budget_exceeded
with retry-after to the period's end; bad budgets are config errors."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.config import ConfigError
from proxy.core.budgets import Budget, Budgets, period_of
from proxy.core.clock import SystemClock
from proxy.core.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

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


def test_spend_is_refused_past_the_amount_and_starts_over_each_period() -> None:
    budgets = Budgets({"app": Budget(1.0, "day")})
    noon = at(UTC, 2026, 11, 30, 12)
    assert budgets.refused_for("app", noon) is None
    for bad in (math.nan, -5.0, math.inf, 0.0):
        budgets.spend("app", bad, noon)
    assert budgets.spent("app", noon) == 0.0
    budgets.spend("app", 0.6, noon)
    assert budgets.refused_for("app", noon) is None
    budgets.spend("app", 0.6, noon + 60)
    assert budgets.refused_for("app", noon + 60) == 12 * 3600 - 60
    assert budgets.refused_for("app", at(UTC, 2026, 12, 1, 0, 0, 1)) is None  # a new day
    assert budgets.spent("app", at(UTC, 2026, 12, 1)) == 0.0
    budgets.spend("other", 100.0, noon)  # no budget: nothing kept
    assert budgets.refused_for("other", noon) is None and budgets.spent("other", noon) == 0.0
    # A reload keeps what was spent; a key's budget removed stops refusing it.
    budgets.spend("app", 2.0, noon)
    budgets.configure({"app": Budget(5.0, "day")}, "UTC")
    assert budgets.spent("app", noon) == pytest.approx(3.2)
    budgets.configure({}, "UTC")
    assert budgets.refused_for("app", noon) is None


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
                                         "spent_usd": 4.0, "resets_in_s": pytest.approx(
                                             7200, abs=2)}}
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
