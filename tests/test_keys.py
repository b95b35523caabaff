"""Keys fail closed: a key reaches no tier more urgent than it was given, premium upstream
processing is not bought by a call the proxy put in a lower tier, and a config that names
what does not exist, or leaves a value null or empty, is refused instead of defaulted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.config import ConfigError, parse_config
from proxy.core.call.classify import upstream_service_tier
from proxy.core.call.tokens import TokenCounter
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
BASE = {
    "providers": [{"name": "sim", "kind": "simulated", "max_concurrency": 2}],
    "models": {"m": [{"provider": "sim", "model": "small"}]},
}


def keys(*entries: dict[str, Any], **classify: Any) -> dict[str, Any]:
    return {**BASE, "classify": {"keys": list(entries), **classify}}


def test_max_tier_defaults_to_the_keys_own_tier() -> None:
    config = parse_config(keys({"name": "batch", "key": "k1", "tier": "low"}), {})
    principal = config.keys[0].principal
    assert (principal.tier, principal.max_tier) == (3, 3)


def test_a_key_without_a_tier_may_reach_the_default_tier_only() -> None:
    config = parse_config(keys({"name": "app", "key": "k1"}, default_tier="high"), {})
    assert config.keys[0].principal.max_tier == 1


def test_max_tier_may_open_a_key_up_explicitly() -> None:
    config = parse_config(keys({"name": "app", "key": "k", "tier": "normal",
                                "max_tier": "critical"}), {})
    assert config.keys[0].principal.max_tier == 0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (keys({"name": "a", "key": "k", "tier": "high", "max_tier": "low"}),
         "classify.keys[0].max_tier: is less urgent than the key's own tier"),
        ({**BASE, "classify": {"keys": []}},
         "classify.keys: must list at least one key (leave it out for open access)"),
        (keys({"name": "a", "key": ""}), "classify.keys[0].key: must not be empty"),
        (keys({"name": "a", "key": "k"}, {"name": "a", "key": "other"}),
         "classify.keys[1].name: duplicate key name 'a'"),
        (keys({"name": "a", "key": "k"},
              rules=[{"tier": "high", "match": {"key": "ghost"}}]),
         "classify.rules[0].match.key[0]: unknown key 'ghost'"),
        ({**BASE, "classify": {"rules": [{"tier": "high", "match": {"model": "gpt-5*"}}]}},
         "classify.rules[0].match.model[0]: matches no model of models:"),
        ({**BASE, "classify": {"rules": [{"tier": "urgent", "match": {"model": "m"}}]}},
         "classify.rules[0].tier: unknown tier 'urgent'"),
        ({**BASE, "classify": {"default_tier": ""}}, "classify.default_tier: unknown tier ''"),
        ({**BASE, "classify": {"default_tier": None}}, "classify.default_tier: must not be null"),
        ({**BASE, "listen": {"host": ""}}, "listen.host: must not be empty"),
        ({**BASE, "listen": {"host": None}}, "listen.host: must not be null"),
        ({**BASE, "scheduler": {"tier_promote_after_s": None}},
         "scheduler.tier_promote_after_s: must not be null"),
        ({**BASE, "providers": [{"name": "sim", "kind": "simulated", "max_concurrency": None}]},
         "providers[0].max_concurrency: must not be null"),
        ({**BASE, "tiers": [{"name": "a", "max_queue": None}]},
         "tiers[0].max_queue: must not be null"),
    ],
)
def test_configs_that_would_fail_open_are_refused(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, {})
    assert str(info.value).startswith(message), str(info.value)


def test_a_rule_may_name_a_disabled_key_and_a_disabled_key_keeps_its_limits_readable() -> None:
    config = parse_config(keys({"name": "a", "key": "${UNSET_KEY}", "rpm": 5},
                               {"name": "b", "key": "k"},
                               rules=[{"tier": "low", "match": {"key": ["a", "b"]}}]), {})
    assert [k.name for k in config.keys] == ["b"]
    assert config.warnings


def test_tier_promotion_can_be_switched_off_with_infinity() -> None:
    config = parse_config({**BASE, "scheduler": {"tier_promote_after_s": float("inf")}}, {})
    assert config.scheduler.tier_promote_after_s == float("inf")


@pytest.mark.parametrize(
    ("requested", "tier", "forwarded"),
    [("priority", 0, "priority"), ("priority", 1, None), ("priority", 3, None),
     ("flex", 3, "flex"), ("flex", 0, "flex"), ("auto", 2, "auto"), (None, 0, None)],
)
def test_priority_goes_upstream_only_with_the_most_urgent_tier(
    requested: str | None, tier: int, forwarded: str | None
) -> None:
    assert upstream_service_tier(requested, tier) == forwarded


async def keyed_proxy(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
    fake: FakeUpstream, *entries: dict[str, Any],
) -> Any:
    server = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "up", "base_url": str(server.make_url("/v1")), "api_key": "sk"}],
        {"m": [{"provider": "up", "model": "x"}]},
        classify={"keys": list(entries)},
    )
    return await aiohttp_client(build_app(config, counter=counter))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_low_key_cannot_buy_urgency_with_a_header_or_service_tier(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    client = await keyed_proxy(aiohttp_server, aiohttp_client, counter, fake,
                               {"name": "batch", "key": "batch-key", "tier": "low"})
    auth = {"Authorization": "Bearer batch-key"}
    resp = await client.post("/v1/chat/completions", json=CHAT,
                             headers={**auth, "X-Priority": "critical"})
    assert resp.status == 200 and resp.headers["x-proxy-tier"] == "low"
    resp = await client.post("/v1/chat/completions", json={**CHAT, "service_tier": "priority"},
                             headers=auth)
    assert resp.status == 200 and resp.headers["x-proxy-tier"] == "low"
    assert "service_tier" not in fake.seen[-1].body  # not billed at the premium rate


async def test_the_most_urgent_tier_forwards_priority(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    fake = FakeUpstream()
    client = await keyed_proxy(aiohttp_server, aiohttp_client, counter, fake,
                               {"name": "ops", "key": "ops-key", "tier": "critical"})
    resp = await client.post("/v1/chat/completions", json={**CHAT, "service_tier": "priority"},
                             headers={"Authorization": "Bearer ops-key"})
    assert resp.status == 200 and resp.headers["x-proxy-tier"] == "critical"
    assert fake.seen[-1].body["service_tier"] == "priority"


async def test_the_model_list_needs_a_key_when_keys_are_configured(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    client = await keyed_proxy(aiohttp_server, aiohttp_client, counter, FakeUpstream(),
                               {"name": "app", "key": "app-key"})
    assert (await client.get("/v1/models")).status == 401
    resp = await client.get("/v1/models", headers={"Authorization": "Bearer app-key"})
    assert resp.status == 200 and [m["id"] for m in (await resp.json())["data"]] == ["m"]
