"""Parsing the classification and time-of-day sections of routing.yaml."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import zoneinfo
from collections.abc import Collection
from dataclasses import dataclass

from ..core.call.budgets import PERIODS, Budget
from ..core.call.classify import ClassifySettings, Principal, Rule
from ..core.scheduling.schedules import Schedule
from .reader import UNSET, Node, fail, safe_repr


@dataclass(frozen=True)
class ApiKey:
    """A proxy key: looked up by the hex SHA-256 digest of the secret, never compared as
    text; it authenticates as ``principal``."""

    sha256: str
    principal: Principal

    @property
    def name(self) -> str:
        return self.principal.name


def tier_index(value: object, names: tuple[str, ...], path: str) -> int:
    if isinstance(value, str):
        for i, name in enumerate(names):
            if name.lower() == value.strip().lower():
                return i
    fail(path, f"unknown tier {safe_repr(value)} (tiers: {', '.join(names)})")


def parse_admin(node: Node, keys: tuple[ApiKey, ...], warnings: list[str]) -> str | None:
    """The admin key's SHA-256, or None: admin endpoints then answer loopback clients only."""
    if node.has("key") and node.has("key_sha256"):
        fail(node.path, "needs at most one of 'key' or 'key_sha256'")
    digest: str | None = None
    if node.has("key"):
        secret = node.secret("key")
        if secret is UNSET or (secret == "" and "${" in str(node.raw("key"))):
            warnings.append("admin.key: environment variable not set; admin endpoints answer "
                            "loopback clients only")
        elif not str(secret).strip():
            fail(node.sub("key"), "must not be empty")
        else:
            digest = hashlib.sha256(str(secret).encode()).hexdigest()
    elif node.has("key_sha256"):
        digest = node.string("key_sha256").strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            fail(node.sub("key_sha256"), "must be 64 hex digits")
    if digest is not None and any(k.sha256 == digest for k in keys):
        fail(node.path, "the admin key must differ from every client key")
    node.check_unknown()
    return digest


def parse_classify(
    node: Node, names: tuple[str, ...], models: Collection[str], warnings: list[str]
) -> tuple[tuple[ApiKey, ...], ClassifySettings]:
    default_tier = tier_index(
        node.raw("default_tier") if node.has("default_tier")
        else ("normal" if "normal" in names else names[-1]),
        names, node.sub("default_tier"),
    )
    keys: list[ApiKey] = []
    declared: set[str] = set()
    if node.has("keys") and not node.raw("keys"):
        fail(node.sub("keys"), "must list at least one key (leave it out for open access)")
    for path, key_node in node.items("keys"):
        name = key_node.string("name", required=True)
        tier = (
            tier_index(key_node.raw("tier"), names, f"{path}.tier")
            if key_node.has("tier") else None
        )
        # Fail closed: a key reaches no tier more urgent than its own unless told so.
        max_tier = (
            tier_index(key_node.raw("max_tier"), names, f"{path}.max_tier")
            if key_node.has("max_tier") else default_tier if tier is None else tier
        )
        if tier is not None and tier < max_tier:
            fail(f"{path}.max_tier", "is less urgent than the key's own tier")
        if name in declared:
            fail(f"{path}.name", f"duplicate key name {name!r}")
        declared.add(name)
        if key_node.has("key") == key_node.has("key_sha256"):
            fail(path, "needs exactly one of 'key' or 'key_sha256'")
        rpm = key_node.optional_integer("rpm", minimum=1)
        tpm = key_node.optional_integer("tpm", minimum=1)
        budget = _budget(key_node.node("budget_usd")) if key_node.has("budget_usd") else None
        weight = key_node.number("weight", 1.0, positive=True, maximum=1e6)
        if key_node.has("key"):
            secret = key_node.secret("key")
            if secret is UNSET or (secret == "" and "${" in str(key_node.raw("key"))):
                warnings.append(f"{path}.key: environment variable not set; key {name!r} disabled")
                key_node.check_unknown()
                continue
            if not str(secret).strip():
                fail(f"{path}.key", "must not be empty")
            digest = hashlib.sha256(str(secret).encode()).hexdigest()
        else:
            digest = key_node.string("key_sha256").strip().lower()
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                fail(f"{path}.key_sha256", "must be 64 hex digits")
        if any(k.sha256 == digest for k in keys):
            fail(path, "the same key is listed twice")
        keys.append(ApiKey(digest, Principal(
            name=name, tier=tier, max_tier=max_tier,
            rpm=rpm, tpm=tpm, budget=budget, weight=weight,
        )))
        key_node.check_unknown()
    rules = tuple(_rule(path, rule_node, names, declared, models)
                  for path, rule_node in node.items("rules"))
    node.check_unknown()
    return tuple(keys), ClassifySettings(tier_names=names, default_tier=default_tier, rules=rules)


def _budget(node: Node) -> Budget:
    amount = node.number("amount", positive=True)
    period = node.string("period", required=True)
    if period not in PERIODS:
        fail(node.sub("period"), f"must be one of {', '.join(PERIODS)}")
    node.check_unknown()
    return Budget(amount, period)


def _rule(
    path: str, node: Node, names: tuple[str, ...], keys: Collection[str], models: Collection[str]
) -> Rule:
    tier = tier_index(node.raw("tier"), names, f"{path}.tier")
    match = node.node("match")
    headers: dict[str, tuple[str, ...]] = {}
    for header, values in match.mapping("header").items():
        if isinstance(values, str):
            values = [values]
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            fail(f"{match.sub('header')}.{header}", "must be a string or a list of strings")
        headers[header.lower()] = tuple(values)
    pattern = match.optional_string("last_user_regex")
    try:
        compiled = re.compile(pattern) if pattern is not None else None
    except re.error as exc:
        fail(match.sub("last_user_regex"), f"invalid regular expression: {exc}")
    stream_value = match.raw("stream")
    if stream_value is not None and not isinstance(stream_value, bool):
        fail(match.sub("stream"), "must be true or false")
    patterns = match.string_list("model")
    for i, pattern in enumerate(patterns):
        if not any(fnmatch.fnmatchcase(model, pattern) for model in models):
            fail(f"{match.sub('model')}[{i}]", f"matches no model of models: ({pattern!r})")
    key_names = match.string_list("key")
    for i, key in enumerate(key_names):
        if key not in keys:
            fail(f"{match.sub('key')}[{i}]", f"unknown key {safe_repr(key)} (not in classify.keys)")
    rule = Rule(
        tier=tier,
        headers=headers,
        models=patterns,
        keys=key_names,
        min_prompt_tokens=match.optional_integer("min_prompt_tokens"),
        max_prompt_tokens=match.optional_integer("max_prompt_tokens"),
        last_user_pattern=compiled,
        stream=stream_value,
    )
    match.check_unknown()
    node.check_unknown()
    return rule


def parse_schedules(node: Node, names: tuple[str, ...]) -> tuple[str, tuple[Schedule, ...]]:
    timezone = node.string("timezone", "UTC")
    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        fail(node.sub("timezone"), f"unknown time zone {timezone!r}")
    schedules: list[Schedule] = []
    for path, s in node.items("windows"):
        hours = s.string("hours", required=True)
        match = re.fullmatch(r"\s*(\d{1,2})\s*-\s*(\d{1,2})\s*", hours)
        if not match or int(match[1]) > 23 or int(match[2]) > 24 or match[1] == match[2]:
            fail(f"{path}.hours", "must be START-END hours (0-23, 1-24), e.g. 18-23 or 22-6")
        days = s.raw("days") or []
        if not isinstance(days, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 7 for d in days
        ):
            fail(f"{path}.days", "must be a list of ISO weekdays 1 (Monday) .. 7 (Sunday)")
        weights: dict[str, float] = {}
        for tier, weight in s.mapping("weights").items():
            tier_name = names[tier_index(tier, names, f"{path}.weights.{tier}")]
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
                    0 <= weight < float("inf")):
                fail(f"{path}.weights.{tier}", "must be a finite number >= 0")
            weights[tier_name] = float(weight)
        reserves: dict[str, int] = {}
        for tier, reserve in s.mapping("reserves").items():
            tier_name = names[tier_index(tier, names, f"{path}.reserves.{tier}")]
            if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
                fail(f"{path}.reserves.{tier}", "must be an integer >= 0")
            reserves[tier_name] = reserve
        schedules.append(Schedule(
            name=s.string("name", f"window{len(schedules)}"),
            start_hour=int(match[1]), end_hour=int(match[2]), days=tuple(days),
            weights=weights, reserves=reserves,
        ))
        s.check_unknown()
    node.check_unknown()
    return timezone, tuple(schedules)
