"""Classification: which priority tier a call belongs to.

Precedence, first that applies wins: the ``X-Priority`` header, the body's
``service_tier``, the first matching rule, the key's default tier, ``default_tier``.
The result is always clamped to the key's ``max_tier`` so a key cannot buy urgency
with a header. Tier indices run from 0 (most urgent) to ``len(tier_names) - 1``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..value import value
from .budgets import Budget

ANY_VALUE = "*"
"""A header value pattern that matches any value, as long as the header is present."""

PRIORITY_HEADER = "x-priority"

# The regex of a rule runs on user text; scanning only a bounded prefix keeps the cost of
# one classification bounded whatever the prompt size.
DEFAULT_PATTERN_WINDOW = 8192

# int() refuses strings past 4300 digits with a ValueError; no real rank needs more than a few.
_MAX_RANK_DIGITS = 4

Source = Literal["header", "service_tier", "rule", "key", "default"]


@dataclass(frozen=True)
class Principal:
    """Who is calling: the proxy key's name, its tier policy and its own rate limits.

    ``max_tier`` is the most urgent tier the key may reach (0 = the most urgent of
    all); configured keys default it to their own tier, so they fail closed.
    """

    name: str
    tier: int | None = None
    max_tier: int = 0
    rpm: int | None = None  # past these: 429 rate_limit_exceeded
    tpm: int | None = None
    budget: Budget | None = None  # past it: 429 budget_exceeded
    weight: float = 1.0  # its share of its tier's slot-seconds beside the tier's other keys


@dataclass(frozen=True)
class Rule:
    """Matches when every field that is set matches (AND); an unset field matches anything.

    ``headers`` maps a header name to the values it may have (OR); the value ``"*"`` matches
    any value of a present header. Header names are compared case-insensitively, values
    exactly. ``models`` are exact names or shell-style patterns (``gpt-4o*``). Token
    bounds are inclusive. ``last_user_pattern`` is searched (not anchored) in the last
    user message.
    """

    tier: int
    headers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    last_user_pattern: re.Pattern[str] | None = None
    stream: bool | None = None

    def __post_init__(self) -> None:
        # A bare string would otherwise become a tuple of its characters.
        normalised = {
            name.lower(): (values,) if isinstance(values, str) else tuple(values)
            for name, values in self.headers.items()
        }
        for name, values in normalised.items():
            if not values:
                raise ValueError(f"rule header {name!r} needs at least one value")
        object.__setattr__(self, "headers", normalised)

    def matches(self, facts: RequestFacts, principal: Principal, pattern_window: int) -> bool:
        for name, allowed in self.headers.items():
            value = facts.headers.get(name)
            if value is None:
                return False
            if ANY_VALUE not in allowed and value.strip() not in allowed:
                return False
        if self.models and not any(fnmatch.fnmatchcase(facts.model, m) for m in self.models):
            return False
        if self.keys and principal.name not in self.keys:
            return False
        if self.min_prompt_tokens is not None and facts.prompt_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and facts.prompt_tokens > self.max_prompt_tokens:
            return False
        if self.stream is not None and facts.stream != self.stream:
            return False
        if self.last_user_pattern is not None:
            text = facts.last_user_message[:pattern_window]
            if self.last_user_pattern.search(text) is None:
                return False
        return True


@dataclass(frozen=True)
class ClassifySettings:
    tier_names: tuple[str, ...]
    default_tier: int
    rules: tuple[Rule, ...] = ()
    pattern_window: int = DEFAULT_PATTERN_WINDOW

    def __post_init__(self) -> None:
        count = len(self.tier_names)
        if count == 0:
            raise ValueError("at least one tier is required")
        if len({name.lower() for name in self.tier_names}) != count:
            raise ValueError("tier names must be unique (case-insensitively)")
        if not 0 <= self.default_tier < count:
            raise ValueError(f"default_tier {self.default_tier} is not a tier index")
        for position, rule in enumerate(self.rules):
            if not 0 <= rule.tier < count:
                raise ValueError(f"rules[{position}].tier {rule.tier} is not a tier index")

    @property
    def lowest_tier(self) -> int:
        return len(self.tier_names) - 1


ANONYMOUS = Principal(name="anonymous")  # every call's principal when no proxy keys are configured


@value
class RequestFacts:
    """What classification may look at; header names are lower-case."""

    headers: Mapping[str, str]
    model: str
    prompt_tokens: int
    last_user_message: str
    stream: bool
    service_tier: str | None


@value
class Classification:
    tier: int
    source: Source
    clamped: bool = False


def parse_priority(value: str, tier_names: Sequence[str]) -> int | None:
    """A tier index from a tier name (any case) or 1-based rank; anything else is None."""
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        if len(text) > _MAX_RANK_DIGITS:
            return None
        rank = int(text)
        return rank - 1 if 1 <= rank <= len(tier_names) else None
    wanted = text.casefold()
    for index, name in enumerate(tier_names):
        if name.casefold() == wanted:
            return index
    return None


def classify(
    facts: RequestFacts, principal: Principal, settings: ClassifySettings
) -> Classification:
    """The tier of one call; never raises on odd client input."""
    tier, source = _requested_tier(facts, principal, settings)
    floor = clamp_tier(principal.max_tier, settings.lowest_tier)
    bounded = clamp_tier(tier, settings.lowest_tier)
    if bounded < floor:
        return Classification(floor, source, clamped=True)
    return Classification(bounded, source)


def clamp_tier(tier: int, lowest: int) -> int:
    """``tier`` within 0..``lowest`` (conditions, not ``min(max())``: this runs on every call)."""
    return 0 if tier < 0 else lowest if tier > lowest else tier


def upstream_service_tier(requested: str | None, tier: int) -> str | None:
    """The ``service_tier`` to forward for a call resolved to ``tier``: ``priority`` is
    billed at a premium, so it goes upstream only with calls of the most urgent tier;
    other values pass unchanged."""
    if requested == "priority" and tier != 0:
        return None
    return requested


def _requested_tier(
    facts: RequestFacts, principal: Principal, settings: ClassifySettings
) -> tuple[int, Source]:
    header = facts.headers.get(PRIORITY_HEADER)
    if header is not None:
        tier = parse_priority(header, settings.tier_names)
        if tier is not None:
            return tier, "header"
    if facts.service_tier == "priority":
        return principal.max_tier, "service_tier"
    if facts.service_tier == "flex":
        return settings.lowest_tier, "service_tier"
    for rule in settings.rules:
        if rule.matches(facts, principal, settings.pattern_window):
            return rule.tier, "rule"
    if principal.tier is not None:
        return principal.tier, "key"
    return settings.default_tier, "default"
