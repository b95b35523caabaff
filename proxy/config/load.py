"""routing.yaml → frozen, typed configuration. The only reader of YAML and the environment."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.call.classify import ClassifySettings
from ..core.call.estimate import (
    DEFAULT_OUTPUT_PRIOR,
    DEFAULT_PREFILL_SECONDS_PER_TOKEN,
    DEFAULT_SECONDS_PER_TOKEN_PRIOR,
    DEFAULT_TTFT_PRIOR_S,
    EstimateSettings,
)
from ..core.call.retry import RetrySettings
from ..core.call.route import ModelRoute
from ..core.formats.request import BodyLimits
from ..core.health.provider import Provider
from ..core.scheduling.scheduler import SchedulerSettings, TierSpec
from ..core.scheduling.schedules import Schedule
from .batch import BatchSettings, StorageSettings, parse_batch, parse_storage
from .policy import ApiKey, parse_admin, parse_classify, parse_schedules
from .providers import parse_models, parse_providers
from .reader import ConfigError, Node, fail, safe_repr
from .state import StateSettings, parse_state
from .telemetry import TelemetrySettings, parse_telemetry

__all__ = ["ApiKey", "Config", "ConfigError", "Provider", "load_config", "parse_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8080


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    write_timeout_s: float = 30.0  # a client that stops reading frees its slot after this
    exact_token_chars: int = 16_000  # longer prompts are estimated, not tokenized
    max_json_depth: int = 64
    max_json_containers: int = 100_000

    @functools.cached_property  # read by every call
    def body(self) -> BodyLimits:
        return BodyLimits(self.max_json_depth, self.max_json_containers, self.exact_token_chars)


@dataclass(frozen=True)
class AccessLogSettings:
    enabled: bool = False
    format: str = "json"  # or text


@dataclass(frozen=True)
class ServerSettings:
    fast_lane: bool = True  # proxied calls skip aiohttp's per-request machinery where they can


@dataclass(frozen=True)
class Config:
    listen: Listen
    tiers: tuple[TierSpec, ...]
    scheduler: SchedulerSettings
    classify: ClassifySettings
    keys: tuple[ApiKey, ...]
    auth_required: bool  # keys were configured (even if every one is disabled)
    providers: Mapping[str, Provider]
    models: Mapping[str, ModelRoute]
    schedules: tuple[Schedule, ...] = ()
    timezone: str = "UTC"
    retry: RetrySettings = field(default_factory=RetrySettings)
    limits: Limits = field(default_factory=Limits)
    estimate: EstimateSettings = field(default_factory=EstimateSettings)
    warnings: tuple[str, ...] = ()
    admin_sha256: str | None = None  # None: admin endpoints answer loopback clients only
    access_log: AccessLogSettings = field(default_factory=AccessLogSettings)
    drain_timeout_s: float = 30.0  # SIGTERM: how long calls in flight may finish
    server: ServerSettings = field(default_factory=ServerSettings)
    state: StateSettings = field(default_factory=StateSettings)
    batch: BatchSettings = field(default_factory=lambda: BatchSettings(tier="low"))
    storage: StorageSettings = field(default_factory=StorageSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    version: str = ""  # sha256 prefix of the file it came from

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses a key written twice in one mapping (YAML would keep the
    last one silently: a typo's twin)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key is written twice in one mapping ({safe_repr(key)})",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the file's text (which may hold a secret)."""
    problem = getattr(exc, "problem", None) or "cannot be parsed"
    if isinstance(exc, yaml.constructor.ConstructorError) and not problem.startswith(
            "a key is written twice"):
        problem = "a YAML tag this file may not use"  # the tag's text is the file's
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    try:
        config = parse_config(data, os.environ if env is None else env)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    version = hashlib.sha256(text.encode()).hexdigest()[:12]
    storage = config.storage
    if storage.path != ":memory:" and not Path(storage.path).is_absolute():
        # A relative storage.path is the config file's neighbour, not the working dir's.
        storage = dataclasses.replace(storage, path=str(Path(path).parent / storage.path))
    return dataclasses.replace(config, version=version, storage=storage)


def parse_config(data: object, env: Mapping[str, str]) -> Config:
    try:
        return _parse(data, env)
    except ValueError as exc:  # a typed object refused a value the reader let through
        raise ConfigError(f"invalid value: {exc}") from exc


def _parse(data: object, env: Mapping[str, str]) -> Config:
    root = Node(data, "", env)
    warnings: list[str] = []
    listen_node = root.node("listen")
    listen = Listen(listen_node.string("host", "127.0.0.1"), listen_node.integer("port", 8080))
    listen_node.check_unknown()
    tiers = _tiers(root)
    names = tuple(t.name for t in tiers)
    scheduler = _scheduler(root.node("scheduler"), tiers)
    providers, declared = parse_providers(root, warnings)
    models = parse_models(root, names, providers, declared, warnings)
    classify_node = root.node("classify")
    auth_required = classify_node.has("keys")
    keys, classify = parse_classify(classify_node, names, models, warnings)
    admin_sha256 = parse_admin(root.node("admin"), keys, warnings)
    access_node = root.node("access_log")
    access_log = AccessLogSettings(
        enabled=access_node.boolean("enabled", root.has("access_log")),
        format=access_node.choice("format", ("json", "text"), "json"),
    )
    access_node.check_unknown()
    drain_timeout_s = root.number("drain_timeout_s", 30.0, maximum=3600.0)
    server_node = root.node("server")
    server = ServerSettings(fast_lane=server_node.boolean("fast_lane", True))
    server_node.check_unknown()
    timezone, schedules = parse_schedules(root.node("schedules"), names)
    retry_node = root.node("retry")
    retry = RetrySettings(
        max_attempts=retry_node.integer("max_attempts", 3, minimum=1),
        budget=retry_node.number("budget", 0.2, maximum=1.0),
        backoff_base_s=retry_node.number("backoff_base_s", 0.25),
        backoff_max_s=retry_node.number("backoff_max_s", 8.0),
    )
    retry_node.check_unknown()
    limits_node = root.node("limits")
    limits = Limits(
        max_body_bytes=limits_node.integer("max_body_bytes", 4 * 1024 * 1024, minimum=1),
        write_timeout_s=limits_node.number("write_timeout_s", 30.0, positive=True),
        exact_token_chars=limits_node.integer("exact_token_chars", 16_000),
        # orjson writes at most 254 levels: a deeper body could be read but not forwarded.
        max_json_depth=limits_node.integer("max_json_depth", 64, minimum=1, maximum=200),
        max_json_containers=limits_node.integer("max_json_containers", 100_000, minimum=1),
    )
    limits_node.check_unknown()
    estimate_node = root.node("estimate")
    estimate = EstimateSettings(
        output_tokens=estimate_node.integer("output_tokens", DEFAULT_OUTPUT_PRIOR, minimum=1),
        ttft_s=estimate_node.number("ttft_s", DEFAULT_TTFT_PRIOR_S),
        seconds_per_token=estimate_node.number(
            "seconds_per_token", DEFAULT_SECONDS_PER_TOKEN_PRIOR
        ),
        prefill_seconds_per_token=estimate_node.number(
            "prefill_seconds_per_token", DEFAULT_PREFILL_SECONDS_PER_TOKEN
        ),
    )
    estimate_node.check_unknown()
    state = parse_state(root.node("state"))
    batch = parse_batch(root.node("batch"), names)
    storage = parse_storage(root.node("storage"))
    telemetry = parse_telemetry(root.node("telemetry"))
    root.check_unknown()
    for message in warnings:
        log.warning("%s", message)
    return Config(
        listen=listen, tiers=tiers, scheduler=scheduler, classify=classify, keys=keys,
        auth_required=auth_required,
        providers=providers, models=models, schedules=schedules, timezone=timezone,
        retry=retry, limits=limits, estimate=estimate, warnings=tuple(warnings),
        admin_sha256=admin_sha256, access_log=access_log, drain_timeout_s=drain_timeout_s,
        server=server, state=state, batch=batch, storage=storage, telemetry=telemetry,
    )


def _tiers(root: Node) -> tuple[TierSpec, ...]:
    if not root.has("tiers"):
        return (
            TierSpec("critical", 8.0, 10.0), TierSpec("high", 4.0, 30.0),
            TierSpec("normal", 2.0, 120.0), TierSpec("low", 1.0, 900.0),
        )
    tiers: list[TierSpec] = []
    listed = root.raw("tiers")
    count = len(listed) if isinstance(listed, list) else 0
    for path, node in root.items("tiers"):
        name = node.string("name", required=True).strip()
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
            fail(f"{path}.name", "must be a word (letters, digits, '_' or '-')")
        if name.lower() in (t.name.lower() for t in tiers):
            fail(f"{path}.name", f"duplicate tier {name!r}")
        tiers.append(TierSpec(
            name=name,
            # Unwritten weights halve down the list (8/4/2/1 for four tiers): priority with
            # small floors below it.
            weight=node.number("weight", float(2 ** (count - 1 - len(tiers))), maximum=1e12),
            max_wait_s=node.number("max_wait_s", 120.0, positive=True),
            max_queue=node.optional_integer("max_queue", minimum=1),
            reserve=node.optional_integer("reserve"),
        ))
        node.check_unknown()
    if not tiers:
        fail("tiers", "must list at least one tier")
    return tuple(tiers)


# Settings of the policy before weights were floors, and what took their place.
RETIRED_SCHEDULER_KEYS = {
    "headroom_scale": "the adaptive headroom is sized by scheduler.headroom_spread "
                      "(mean + spread x sqrt(mean) busy slots; false turns it off)",
    "quantum_s": "a tier's weight is now its floor (see tiers[].weight); urgency decides "
                 "what the floors leave",
    "lend_s": "a tier's floor (tiers[].weight) is never lent; a call at risk of its "
              "deadline goes first inside its tier (scheduler.rescue_fraction)",
}


def _scheduler(node: Node, tiers: tuple[TierSpec, ...]) -> SchedulerSettings:
    defaults = SchedulerSettings(tiers=tiers)
    bounds = _floats(node, "level_bounds_s", defaults.level_bounds_s)
    promote = _floats(node, "promote_after_s", defaults.promote_after_s)
    if list(bounds) != sorted(bounds):
        fail(node.sub("level_bounds_s"), "must be increasing")
    if node.has("level_bounds_s") and not node.has("promote_after_s"):
        promote = tuple(defaults.promote_after_s[-1] for _ in range(len(bounds) + 1))
    if len(promote) != len(bounds) + 1:
        fail(node.sub("promote_after_s"), f"needs one value per level ({len(bounds) + 1})")
    tier_promote = (
        node.number("tier_promote_after_s", positive=True, allow_infinite=True)
        if node.raw("tier_promote_after_s") is not None else defaults.tier_promote_after_s
    )
    for key, instead in RETIRED_SCHEDULER_KEYS.items():
        if node.has(key):
            fail(node.sub(key), f"is no longer a setting: {instead}")
    spread = node.raw("headroom_spread")
    settings = SchedulerSettings(
        tiers=tiers,
        max_queue=node.integer("max_queue", defaults.max_queue, minimum=1),
        level_bounds_s=bounds,
        promote_after_s=promote,
        tier_promote_after_s=tier_promote,
        headroom_spread=None if spread is False else node.number(
            "headroom_spread", defaults.headroom_spread),
        headroom_horizon_s=node.number(
            "headroom_horizon_s", defaults.headroom_horizon_s, positive=True
        ),
        headroom_budget=node.number("headroom_budget", defaults.headroom_budget, maximum=1.0),
        rescue_fraction=node.number("rescue_fraction", defaults.rescue_fraction, maximum=1.0),
        refuse_early=node.boolean("refuse_early", defaults.refuse_early),
    )
    node.check_unknown()
    return settings


def _floats(node: Node, key: str, default: tuple[float, ...]) -> tuple[float, ...]:
    value = node.raw(key)
    if value is None:
        return default
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value
    ):
        fail(node.sub(key), "must be a list of positive numbers")
    return tuple(float(v) for v in value)


