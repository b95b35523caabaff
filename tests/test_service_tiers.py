"""Provider service tiers: a deployment sends each proxy tier's calls with the provider's
``service_tier`` its table maps it to, prices them at that tier, and a flex "resource
unavailable" 429 sends the call again without it, neither a breaker failure nor a pause."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp.test_utils import TestServer

from proxy.config import ConfigError
from proxy.core.call.attempts import tier_declined
from proxy.core.call.route import Deployment, ModelRoute, rank
from proxy.core.call.tokens import TokenCounter
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[TestServer]]
PRICED = {"input_cost": 0.15, "output_cost": 0.60,
          "service_tier": {"critical": "priority", "low": "flex"},
          "costs": {"priority": {"input": 0.25, "output": 1.0},
                    "flex": {"input": 0.075, "output": 0.30}}}


def tiered(upstream: str = "http://127.0.0.1:9/v1", **candidate: Any) -> Any:
    return config_from(
        [{"name": "up", "kind": "openai", "base_url": upstream, "api_key": "k",
          "max_concurrency": 4}],
        {"m": [{"provider": "up", "model": "x", **{**PRICED, **candidate}}]})


def test_the_documented_table_is_valid_config() -> None:
    """docs/routing.md's example (a block of its own: the doc's other blocks are one file)."""
    text = (Path(__file__).parent.parent / "docs" / "routing.md").read_text()
    block = text.split("## Provider service tiers", 1)[1].split("```yml\n", 1)[1]
    models = yaml.safe_load(block.split("```", 1)[0])["models"]
    config = config_from([{"name": "openai", "base_url": "https://api.openai.com/v1",
                           "max_concurrency": 1}], models)
    assert config.models["gpt-4o-mini"].candidates[0].service_tier("low") == "flex"


def test_a_deployment_maps_proxy_tiers_to_provider_tiers_and_prices_each() -> None:
    deployment = tiered().models["m"].candidates[0]
    assert deployment.service_tier("critical") == "priority"
    assert deployment.service_tier("low") == "flex"
    assert deployment.service_tier("normal") is None
    million = 1_000_000
    assert deployment.cost(million, million) == pytest.approx(0.75)
    assert deployment.cost(million, million, "priority") == pytest.approx(1.25)
    assert deployment.cost(million, million, "flex") == pytest.approx(0.375)
    assert deployment.cost(million, million, "scale") == pytest.approx(0.75)  # unpriced


@pytest.mark.parametrize(("candidate", "problem"), [
    ({"service_tier": {"urgent": "flex"}}, "unknown tier"),
    ({"service_tier": {"low": "cheap"}}, "must be one of auto, default, flex, priority, scale"),
    ({"costs": {"turbo": {"input": 1, "output": 1}}}, "must be one of"),
    ({"costs": {"flex": {"input": 1}}}, "costs.flex.output: is required"),
    ({"costs": {"flex": {"input": -1, "output": 1}}}, "costs.flex.input: must be >= 0"),
])
def test_a_bad_tier_table_is_refused_naming_its_path(candidate: dict[str, Any],
                                                     problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        tiered(**candidate)


def test_a_provider_that_is_not_sent_service_tier_cannot_be_given_a_table() -> None:
    with pytest.raises(ConfigError, match="accepts_service_tier"):
        config_from([{"name": "up", "kind": "openai", "base_url": "http://127.0.0.1:9",
                      "api_key": "k", "max_concurrency": 1, "accepts_service_tier": False}],
                    {"m": [{"provider": "up", "model": "x", **PRICED}]})


def test_the_cheapest_strategy_and_max_cost_count_the_tiers_price() -> None:
    flex = Deployment("a", "x", 1.0, 1.0, service_tiers=(("low", "flex"),),
                      tier_costs=(("flex", 0.1, 0.1),))
    plain = Deployment("b", "x", 0.5, 0.5)
    route = ModelRoute("m", (plain, flex), strategy="cheapest")
    assert rank(route, "low", 1000, 1000, {}, random.Random(1)) == [flex, plain]
    assert rank(route, "high", 1000, 1000, {}, random.Random(1)) == [plain, flex]


@pytest.mark.parametrize(("sent", "status", "body", "declined"), [
    ("flex", 429, b'{"error": {"code": "resource_unavailable"}}', True),
    ("flex", 429, b'{"error": {"message": "Resource unavailable, try later"}}', True),
    ("flex", 498, b'{"error": {"code": "capacity_exceeded"}}', True),
    ("flex", 429, b'{"error": {"code": "rate_limit_exceeded"}}', False),  # a real limit
    (None, 429, b'{"error": {"code": "resource_unavailable"}}', False),
    ("priority", 429, b'{"error": {"code": "resource_unavailable"}}', False),
    ("flex", 500, b"resource unavailable", False),
])
def test_what_counts_as_a_declined_tier(sent: str | None, status: int, body: bytes,
                                        declined: bool) -> None:
    assert tier_declined(sent, status, body) is declined


async def start(aiohttp_server: Factory, counter: TokenCounter,
                upstream: FakeUpstream) -> TestServer:
    up = await aiohttp_server(upstream.app())
    return await aiohttp_server(build_app(tiered(str(up.make_url("/v1"))), counter=counter))


async def call(server: TestServer, tier: str, **body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(
            server.make_url("/v1/chat/completions"), headers={"X-Priority": tier},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    ) as resp:
        return resp.status, await resp.json()


async def status(server: TestServer) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(
            server.make_url("/admin/status")) as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def metric(server: TestServer, line_start: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(
            server.make_url("/metrics")) as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(line_start))


async def test_each_tier_is_sent_with_its_provider_tier_and_priced_at_it(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    upstream = FakeUpstream(usage={"prompt_tokens": 1000, "completion_tokens": 1000,
                                   "total_tokens": 2000})
    server = await start(aiohttp_server, counter, upstream)
    for tier in ("critical", "normal", "low"):
        assert (await call(server, tier, service_tier="auto"))[0] == 200
    sent = [seen.body.get("service_tier") for seen in upstream.seen]
    assert sent == ["priority", "auto", "flex"]  # normal: the client's own, as before
    costs = {tier: await metric(server, f'proxy_cost_usd_total{{key="anonymous",tier="{tier}"}}')
             for tier in ("critical", "normal", "low")}
    assert costs == pytest.approx({"critical": 0.00125, "normal": 0.00075, "low": 0.000375})


async def test_the_tier_the_provider_says_it_served_is_the_one_priced(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    usage = {"prompt_tokens": 1000, "completion_tokens": 1000, "total_tokens": 2000}
    upstream = FakeUpstream(usage=usage, served_tier="default")  # asked priority, gave default
    server = await start(aiohttp_server, counter, upstream)
    assert (await call(server, "critical"))[0] == 200
    line = 'proxy_cost_usd_total{key="anonymous",tier="critical"}'
    assert await metric(server, line) == pytest.approx(0.00075)  # not priority's 0.00125
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "x"}
    upstream.raw_stream = [
        b"data: " + orjson.dumps({**chunk, "choices": [{"index": 0, "delta": {
            "content": "hi"}, "finish_reason": "stop"}]}) + b"\n\n",
        b"data: " + orjson.dumps({**chunk, "choices": [], "usage": usage,
                                  "service_tier": "flex"}) + b"\n\n",
        b"data: [DONE]\n\n"]
    async with aiohttp.ClientSession() as session, session.post(
            server.make_url("/v1/chat/completions"), headers={"X-Priority": "critical"},
            json={"model": "m", "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200 and b"[DONE]" in await resp.read()
    assert await metric(server, line) == pytest.approx(0.00075 + 0.000375)  # flex's price


async def test_a_flex_429_is_sent_again_without_service_tier_and_is_no_failure(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    upstream = FakeUpstream()
    upstream.script.append("flex_429")
    server = await start(aiohttp_server, counter, upstream)
    got, _ = await call(server, "low")
    assert got == 200
    assert [seen.body.get("service_tier") for seen in upstream.seen] == ["flex", None]
    breaker = (await status(server))["breakers"]["up/x"]
    assert breaker["window_failures"] == 0 and breaker["consecutive_failures"] == 0, breaker
    assert await metric(server, 'proxy_upstream_attempts_total{outcome="declined"') == 1
    assert await metric(server, 'proxy_upstream_attempts_total{outcome="throttle"') == 0
