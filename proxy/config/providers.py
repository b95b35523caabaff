"""Parsing the providers and models sections of routing.yaml."""

from __future__ import annotations

import importlib.util
import re
import urllib.parse
from collections.abc import Mapping

from ..core.call.route import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    STRATEGIES,
    CacheSettings,
    Degradation,
    Deployment,
    ModelRoute,
    SemanticSettings,
)
from ..core.health.breaker import BreakerSettings
from ..core.health.engines import ENGINES
from ..core.health.provider import Provider, SimSettings, Timeouts
from .egress import egress_for, environment_proxies
from .policy import tier_index
from .reader import UNSET, Node, fail, interpolate, safe_repr

PROVIDER_KINDS = ("openai", "azure", "anthropic", "simulated")
ANTHROPIC_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"  # the Messages API's version header, unless configured
FORWARDED_SERVICE_TIERS = ("openai",)
PROVIDER_TIERS = ("auto", "default", "flex", "priority", "scale")  # OpenAI's service_tier
AUTO_CAP = 1024  # max_concurrency: auto without a number: learned up to this


def parse_providers(root: Node, warnings: list[str]) -> tuple[dict[str, Provider], set[str]]:
    """The enabled providers, and the names of all declared ones (disabled included)."""
    providers: dict[str, Provider] = {}
    declared: set[str] = set()
    proxies = environment_proxies(root.env)
    for path, node in root.items("providers"):
        name = node.string("name", required=True)
        if name in declared:
            fail(f"{path}.name", f"duplicate provider {name!r}")
        kind = node.choice("kind", PROVIDER_KINDS, "openai")
        declared.add(name)
        engine = node.optional_string("engine")
        if engine is not None and engine not in ENGINES:
            fail(f"{path}.engine", f"must be one of {', '.join(ENGINES)}")
        if engine is not None and kind not in ("openai", "simulated"):
            fail(f"{path}.engine", "only applies to kinds openai and simulated")
        raw_limit = node.raw("max_concurrency")
        if raw_limit != "auto" and raw_limit is not None and (
                isinstance(raw_limit, bool) or not isinstance(raw_limit, int) or raw_limit < 1):
            fail(f"{path}.max_concurrency", "must be a positive integer or auto")
        auto = raw_limit == "auto" or (engine is not None and raw_limit is None)
        max_concurrency = AUTO_CAP if auto else node.integer("max_concurrency", 10, minimum=1)
        priority = node.boolean("priority", True)
        if node.has("priority") and engine not in ("vllm", "sglang"):
            fail(f"{path}.priority", "only applies to engine vllm or sglang")
        read_every_s = node.number("read_every_s", 1.0, minimum=0.1, maximum=60.0)
        if node.has("read_every_s") and engine is None:
            fail(f"{path}.read_every_s", "only applies with an engine")
        timeouts_node = node.node("timeouts")
        timeouts = Timeouts(
            connect_s=timeouts_node.number("connect_s", 10.0, positive=True),
            first_byte_s=timeouts_node.number("first_byte_s", 60.0, positive=True),
            idle_s=timeouts_node.number("idle_s", 60.0, positive=True),
            response_s=timeouts_node.number("response_s", 600.0, positive=True),
        )
        timeouts_node.check_unknown()
        breaker = _breaker(node.node("breaker"))
        common = {
            "name": name, "kind": kind, "max_concurrency": max_concurrency,
            "timeouts": timeouts, "breaker": breaker,
            "rpm": node.optional_integer("rpm", minimum=1),
            "tpm": node.optional_integer("tpm", minimum=1),
            "engine": engine, "auto": auto, "priority": priority, "read_every_s": read_every_s,
        }
        if kind == "simulated":
            sim = _simulate(node.node("simulate"))
            provider = Provider(sim=sim, timing=sim, **common)  # type: ignore[arg-type]
        else:
            # A real provider's simulate: block is only the simulator's timing model.
            common["timing"] = _simulate(node.node("simulate")) if node.has("simulate") else None
            provider_or_none = _http_provider(path, node, kind, common, warnings, proxies)
            node.check_unknown()
            if provider_or_none is None:
                continue
            provider = provider_or_none
        node.check_unknown()
        providers[name] = provider
    return providers, declared


def _http_provider(
    path: str, node: Node, kind: str, common: dict[str, object], warnings: list[str],
    proxies: Mapping[str, str],
) -> Provider | None:
    base_url = (ANTHROPIC_URL if kind == "anthropic" and not node.has("base_url")
                else node.string("base_url", required=True)).rstrip("/")
    if not re.match(r"https?://[^/\s]+", base_url):
        fail(f"{path}.base_url", "must be an http:// or https:// URL")
    try:
        port = urllib.parse.urlsplit(base_url).port  # raises for a port out of range
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        fail(f"{path}.base_url", "has a port that is not a number from 1 to 65535")
    api_key = node.secret("api_key", "")
    if re.search(r"[\r\n\0]", str(api_key)):
        fail(f"{path}.api_key", "holds a line break or NUL")
    if api_key == "" and "${" in str(node.data.get("api_key", "")):
        api_key = UNSET  # a variable set to nothing is as good as unset
    headers: dict[str, str] = {}
    for header, raw in node.mapping("headers").items():
        value = interpolate(str(raw), node.env)
        if value is UNSET:
            fail(f"{node.sub('headers')}.{header}", "uses an environment variable that is not set")
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", header) or re.search(
                r"[\r\n\0]", str(value)):
            fail(f"{node.sub('headers')}.{header}",
                 "is not a header name, or its value holds a line break or NUL")
        headers[header] = str(value)
    accepts = node.boolean("accepts_service_tier", kind in FORWARDED_SERVICE_TIERS)
    max_response_bytes = node.integer("max_response_bytes", 64 * 1024 * 1024, minimum=1)
    api_version = node.optional_string("api_version")
    if api_key is UNSET:
        warnings.append(
            f"{path}.api_key: environment variable not set; provider {common['name']!r} disabled"
        )
        return None
    query: dict[str, str] = {}
    version = node.optional_string("anthropic_version")
    if kind == "anthropic":
        headers.setdefault("anthropic-version", version or ANTHROPIC_VERSION)
    elif version is not None:
        fail(f"{path}.anthropic_version", "only applies to kind anthropic")
    if kind == "azure":
        if api_version is None:
            fail(f"{path}.api_version", "is required for kind azure")
        query["api-version"] = api_version
    elif api_version is not None:
        fail(f"{path}.api_version", "only applies to kind azure")
    return Provider(
        base_url=base_url, api_key=str(api_key), headers=headers, query=query,
        max_response_bytes=max_response_bytes, egress=egress_for(base_url, proxies),
        accepts_service_tier=accepts, **common,  # type: ignore[arg-type]
    )


def _breaker(node: Node) -> BreakerSettings:
    d = BreakerSettings()
    settings = BreakerSettings(
        consecutive_failures=node.integer("consecutive_failures", d.consecutive_failures,
                                          minimum=1),
        error_rate=node.number("error_rate", d.error_rate, maximum=1.0),
        window_s=node.number("window_s", d.window_s, positive=True),
        min_calls=node.integer("min_calls", d.min_calls, minimum=1),
        cooldown_s=node.number("cooldown_s", d.cooldown_s, positive=True),
        cooldown_max_s=node.number("cooldown_max_s", d.cooldown_max_s, positive=True),
        half_open_probes=node.integer("half_open_probes", d.half_open_probes, minimum=1),
    )
    node.check_unknown()
    return settings


def parse_models(
    root: Node,
    names: tuple[str, ...],
    providers: Mapping[str, Provider],
    declared: set[str],
    warnings: list[str],
) -> dict[str, ModelRoute]:
    models: dict[str, ModelRoute] = {}
    for public, value in root.mapping("models").items():
        path = f"models.{public}"
        node = Node({"candidates": value} if isinstance(value, list) else value, path, root.env)
        strategy = node.choice("strategy", STRATEGIES, "ordered")
        tier_strategies: dict[str, str] = {}
        for tier, tier_strategy in node.mapping("tiers").items():
            tier_name = names[tier_index(tier, names, f"{path}.tiers.{tier}")]
            if tier_strategy not in STRATEGIES:
                fail(f"{path}.tiers.{tier}", f"must be one of {', '.join(STRATEGIES)}")
            tier_strategies[tier_name] = str(tier_strategy)
        max_cost: dict[str, float] = {}
        for tier, cost in node.mapping("max_cost").items():
            tier_name = names[tier_index(tier, names, f"{path}.max_cost.{tier}")]
            if isinstance(cost, bool) or not isinstance(cost, int | float) or cost <= 0:
                fail(f"{path}.max_cost.{tier}", "must be a positive number")
            max_cost[tier_name] = float(cost)
        candidates = _candidates(path if isinstance(value, list) else f"{path}.candidates",
                                 node, providers, declared, names)
        degradation = _degradation(node, names, candidates) if node.has("degrade") else None
        cache = _cache(node.node("cache")) if node.has("cache") else None
        semantic = (_semantic(node.node("semantic_cache"))
                    if node.has("semantic_cache") else None)
        node.check_unknown()
        if not candidates:
            warnings.append(f"{path}: no enabled provider; the model answers 503")
        models[public] = ModelRoute(
            name=public, candidates=candidates, strategy=strategy,
            tier_strategies=tier_strategies, max_cost=max_cost, degradation=degradation,
            cache=cache, semantic_cache=semantic,
        )
    if not models:
        fail("models", "must name at least one model")
    for public, route in models.items():
        wanted = route.semantic_cache.embedding_model if route.semantic_cache else None
        if wanted is not None and wanted not in models:
            fail(f"models.{public}.semantic_cache.embedding_model",
                 f"{safe_repr(wanted)} is not a model of this routing table")
    return models


def _simulate(node: Node) -> SimSettings:
    sim = SimSettings(
        ttft_s=node.number("ttft_s", 0.2),
        tokens_per_s=node.number("tokens_per_s", 50.0, positive=True),
        prefill_tokens_per_s=node.number("prefill_tokens_per_s", 0.0),
        default_output_tokens=node.integer("default_output_tokens", 64, minimum=1),
        max_output_tokens=node.integer("max_output_tokens", 4096, minimum=1),
        error_rate=node.number("error_rate", 0.0, maximum=1.0),
        capacity=node.optional_integer("capacity", minimum=1),
        slots=node.optional_integer("slots", minimum=1),
        slows_past=node.optional_integer("slows_past", minimum=1),
        seed=node.optional_integer("seed"),
    )
    node.check_unknown()
    return sim


def _cache(node: Node) -> CacheSettings:
    settings = CacheSettings(
        ttl_s=node.number("ttl_s", 300.0, positive=True, maximum=7 * 24 * 3600),
        max_entries=node.integer("max_entries", 10_000, minimum=1, maximum=10_000_000),
    )
    node.check_unknown()
    return settings


def _semantic(node: Node) -> SemanticSettings:
    if importlib.util.find_spec("usearch") is None:
        fail(node.path, "needs the 'semantic' extra: pip install 'triage-proxy[semantic]'")
    settings = SemanticSettings(
        embedding_model=node.string("embedding_model", required=True),
        threshold=node.number("threshold", 0.95, positive=True, maximum=1.0),
        ttl_s=node.number("ttl_s", 86_400.0, positive=True, maximum=30 * 24 * 3600),
        max_entries=node.integer("max_entries", 100_000, minimum=1, maximum=10_000_000),
    )
    node.check_unknown()
    return settings


def _candidates(
    path: str, node: Node, providers: Mapping[str, Provider], declared: set[str],
    names: tuple[str, ...],
) -> tuple[Deployment, ...]:
    raw = node.raw("candidates")
    if not isinstance(raw, list) or not raw:
        fail(path, "must be a non-empty list of {provider, model}")
    result: list[Deployment] = []
    for i, item in enumerate(raw):
        item_path = f"{path}[{i}]"
        c = Node(item, item_path, node.env)
        provider = c.string("provider", required=True)
        deployment = Deployment(
            provider=provider,
            model=c.string("model", required=True),
            input_cost=c.number("input_cost", 0.0),
            output_cost=c.number("output_cost", 0.0),
            quality=c.number("quality", 0.5, maximum=1.0),
            weight=c.number("weight", 1.0, positive=True),
            max_output_tokens=c.integer("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS,
                                        minimum=1),
            service_tiers=_service_tiers(c, names),
            tier_costs=_tier_costs(c),
            priorities=_priorities(c, names),
        )
        c.check_unknown()
        if provider not in providers:
            if provider in declared:
                continue  # disabled (secret unset); already warned
            fail(f"{item_path}.provider", f"unknown provider {safe_repr(provider)}")
        if deployment.service_tiers and not providers[provider].accepts_service_tier:
            fail(f"{item_path}.service_tier", f"provider {safe_repr(provider)} is not sent "
                 "service_tier (set its accepts_service_tier: true)")
        if deployment.priorities and providers[provider].priority_order is None:
            fail(f"{item_path}.priority", f"provider {safe_repr(provider)} is not sent "
                 "priority (its engine must be vllm or sglang, with priority on)")
        if any(d.id == deployment.id for d in result):
            fail(item_path, f"duplicate deployment {deployment.id!r}")
        result.append(deployment)
    return tuple(result)


def _service_tiers(node: Node, names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``service_tier: {critical: priority, low: flex}``: proxy tier → provider tier."""
    found = []
    for tier, value in node.mapping("service_tier").items():
        path = f"{node.sub('service_tier')}.{tier}"
        name = names[tier_index(tier, names, path)]
        if value not in PROVIDER_TIERS:
            fail(path, f"must be one of {', '.join(PROVIDER_TIERS)}")
        found.append((name, str(value)))
    return tuple(found)


def _priorities(node: Node, names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``priority: {critical: 0, low: 10}``: proxy tier → the server's priority number."""
    found = []
    for tier, value in node.mapping("priority").items():
        path = f"{node.sub('priority')}.{tier}"
        name = names[tier_index(tier, names, path)]
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 2**31 - 1:
            fail(path, "must be a whole number (a 32-bit integer)")
        found.append((name, value))
    return tuple(found)


def _tier_costs(node: Node) -> tuple[tuple[str, float, float], ...]:
    """``costs: {flex: {input: 0.075, output: 0.30}}``: a provider tier's own prices."""
    found = []
    for tier in node.mapping("costs"):
        if tier not in PROVIDER_TIERS:
            fail(f"{node.sub('costs')}.{tier}", f"must be one of {', '.join(PROVIDER_TIERS)}")
        prices = node.node("costs").node(tier)
        found.append((tier, prices.number("input"), prices.number("output")))
        prices.check_unknown()
    return tuple(found)


def _degradation(
    node: Node, names: tuple[str, ...], candidates: tuple[Deployment, ...]
) -> Degradation:
    d = node.node("degrade")
    allow = d.string_list("allow")
    ids = {c.id for c in candidates}
    for i, deployment_id in enumerate(allow):
        if deployment_id not in ids:
            fail(f"{d.sub('allow')}[{i}]", f"not a candidate of this model: {sorted(ids)}")
    tiers = tuple(
        names[tier_index(t, names, f"{d.sub('tiers')}[{i}]")]
        for i, t in enumerate(d.string_list("tiers"))
    )
    degradation = Degradation(
        max_wait_s=d.number("max_wait_s", positive=True),
        allow=allow,
        shed_wait_s=d.optional_number("shed_wait_s", positive=True),
        tiers=tiers,
    )
    d.check_unknown()
    return degradation


