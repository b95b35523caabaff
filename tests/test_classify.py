from __future__ import annotations

import re
from collections.abc import Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.call.classify import (
    Classification,
    ClassifySettings,
    Principal,
    RequestFacts,
    Rule,
    classify,
    parse_priority,
)

TIERS = ("critical", "high", "normal", "low")
CRITICAL, HIGH, NORMAL, LOW = range(4)

# The seed scenario map from issue 3, as rules: listed scenarios first, then a catch-all
# for any other (unknown) scenario value.
SEED_RULES = (
    Rule(tier=HIGH, headers={"X-Scenario": ("realtime_chat",)}),
    Rule(
        tier=NORMAL,
        headers={"x-scenario": ("emotion_analysis", "recipe_recommend", "schedule_plan")},
    ),
    Rule(tier=LOW, headers={"x-scenario": ("morning_brief",)}),
    Rule(tier=HIGH, headers={"x-scenario": ("*",)}),
)
SEED = ClassifySettings(tier_names=TIERS, default_tier=NORMAL, rules=SEED_RULES)
ANON = Principal("anonymous")


def facts(
    headers: Mapping[str, str] | None = None,
    *,
    model: str = "gpt-4o-mini",
    prompt_tokens: int = 100,
    last_user: str = "hello",
    stream: bool = False,
    service_tier: str | None = None,
) -> RequestFacts:
    return RequestFacts(
        headers=dict(headers or {}),
        model=model,
        prompt_tokens=prompt_tokens,
        last_user_message=last_user,
        stream=stream,
        service_tier=service_tier,
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("critical", CRITICAL),
        ("HIGH", HIGH),
        (" Normal ", NORMAL),
        ("low", LOW),
        ("1", CRITICAL),
        ("4", LOW),
        (" 2 ", HIGH),
        ("0", None),
        ("5", None),
        ("-1", None),
        ("+1", None),
        ("1.0", None),
        ("", None),
        ("   ", None),
        ("urgent", None),
        ("high,low", None),
        ("9" * 5000, None),
        ("\u0661", None),
        ("hígh", None),
        ("\x00", None),
    ],
)
def test_parse_priority(value: str, expected: int | None) -> None:
    assert parse_priority(value, TIERS) == expected


@given(st.text(max_size=50))
@settings(max_examples=300, deadline=None)
def test_parse_priority_never_raises_and_stays_in_range(value: str) -> None:
    result = parse_priority(value, TIERS)
    assert result is None or 0 <= result < len(TIERS)


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("realtime_chat", HIGH),
        ("emotion_analysis", NORMAL),
        ("recipe_recommend", NORMAL),
        ("schedule_plan", NORMAL),
        ("morning_brief", LOW),
        ("something_new", HIGH),
        ("", HIGH),
        ("Realtime_Chat", HIGH),
        ("MORNING_BRIEF", HIGH),
        (None, NORMAL),
    ],
)
def test_seed_scenario_map(scenario: str | None, expected: int) -> None:
    headers = {} if scenario is None else {"x-scenario": scenario}
    result = classify(facts(headers), ANON, SEED)
    assert result.tier == expected
    assert result.source == ("default" if scenario is None else "rule")


KEYED = Principal("app", tier=HIGH, max_tier=CRITICAL)
FREE = Principal("free", tier=LOW, max_tier=NORMAL)


@pytest.mark.parametrize(
    ("name", "request_facts", "principal", "expected"),
    [
        # X-Priority beats everything below it.
        ("header beats service_tier", facts({"x-priority": "low"}, service_tier="priority"),
         KEYED, Classification(LOW, "header")),
        ("header beats rule", facts({"x-priority": "2", "x-scenario": "morning_brief"}),
         ANON, Classification(HIGH, "header")),
        ("header beats key default", facts({"x-priority": "normal"}), KEYED,
         Classification(NORMAL, "header")),
        ("garbage header falls through to rules", facts({"x-priority": "asap",
         "x-scenario": "morning_brief"}), ANON, Classification(LOW, "rule")),
        ("garbage header falls through to key", facts({"x-priority": "0"}), KEYED,
         Classification(HIGH, "key")),
        # service_tier.
        ("priority means the most urgent allowed", facts(service_tier="priority"), KEYED,
         Classification(CRITICAL, "service_tier")),
        ("priority for a limited key", facts(service_tier="priority"), FREE,
         Classification(NORMAL, "service_tier")),
        ("flex means the lowest tier", facts(service_tier="flex"), KEYED,
         Classification(LOW, "service_tier")),
        ("flex beats rules", facts({"x-scenario": "realtime_chat"}, service_tier="flex"),
         ANON, Classification(LOW, "service_tier")),
        ("other service_tier is ignored", facts(service_tier="default"), KEYED,
         Classification(HIGH, "key")),
        ("auto service_tier is ignored", facts({"x-scenario": "morning_brief"},
         service_tier="auto"), KEYED, Classification(LOW, "rule")),
        # Rules beat the key's default, which beats default_tier.
        ("rule beats key default", facts({"x-scenario": "morning_brief"}), KEYED,
         Classification(LOW, "rule")),
        ("key default without a matching rule", facts(), KEYED, Classification(HIGH, "key")),
        ("default tier last", facts(), ANON, Classification(NORMAL, "default")),
        # Clamping to max_tier.
        ("header clamped", facts({"x-priority": "critical"}), FREE,
         Classification(NORMAL, "header", clamped=True)),
        ("rule clamped", facts({"x-scenario": "realtime_chat"}), FREE,
         Classification(NORMAL, "rule", clamped=True)),
        ("key default clamped", facts(), Principal("odd", tier=CRITICAL, max_tier=LOW),
         Classification(LOW, "key", clamped=True)),
        ("default clamped", facts(), Principal("batch", max_tier=LOW),
         Classification(LOW, "default", clamped=True)),
        ("less urgent than the clamp is kept", facts({"x-priority": "low"}), FREE,
         Classification(LOW, "header")),
        ("out-of-range key tier bounded", facts(), Principal("x", tier=17),
         Classification(LOW, "key")),
        ("out-of-range max_tier bounded", facts({"x-priority": "1"}),
         Principal("x", max_tier=9), Classification(LOW, "header", clamped=True)),
    ],
)
def test_precedence_and_clamp(
    name: str, request_facts: RequestFacts, principal: Principal, expected: Classification
) -> None:
    assert classify(request_facts, principal, SEED) == expected, name


def settings_with(*rules: Rule) -> ClassifySettings:
    return ClassifySettings(tier_names=TIERS, default_tier=NORMAL, rules=rules)


@pytest.mark.parametrize(
    ("rule", "request_facts", "principal", "matches"),
    [
        (Rule(CRITICAL, models=("gpt-4o",)), facts(model="gpt-4o"), ANON, True),
        (Rule(CRITICAL, models=("gpt-4o",)), facts(model="gpt-4o-mini"), ANON, False),
        (Rule(CRITICAL, models=("gpt-4o*",)), facts(model="gpt-4o-mini"), ANON, True),
        (Rule(CRITICAL, models=("a", "b")), facts(model="b"), ANON, True),
        (Rule(CRITICAL, keys=("app",)), facts(), KEYED, True),
        (Rule(CRITICAL, keys=("app",)), facts(), FREE, False),
        (Rule(CRITICAL, min_prompt_tokens=100), facts(prompt_tokens=100), ANON, True),
        (Rule(CRITICAL, min_prompt_tokens=101), facts(prompt_tokens=100), ANON, False),
        (Rule(CRITICAL, max_prompt_tokens=100), facts(prompt_tokens=100), ANON, True),
        (Rule(CRITICAL, max_prompt_tokens=99), facts(prompt_tokens=100), ANON, False),
        (Rule(CRITICAL, stream=True), facts(stream=True), ANON, True),
        (Rule(CRITICAL, stream=True), facts(stream=False), ANON, False),
        (Rule(CRITICAL, stream=False), facts(stream=False), ANON, True),
        (Rule(CRITICAL, last_user_pattern=re.compile(r"(?i)\burgent\b")),
         facts(last_user="This is URGENT please"), ANON, True),
        (Rule(CRITICAL, last_user_pattern=re.compile(r"(?i)\burgent\b")),
         facts(last_user="not urgently"), ANON, False),
        (Rule(CRITICAL, headers={"x-team": ("*",)}), facts({"x-team": "a"}), ANON, True),
        (Rule(CRITICAL, headers={"x-team": ("*",)}), facts(), ANON, False),
        # A bare string from config is one value, not a tuple of characters.
        (Rule(CRITICAL, headers={"X-Team": "ops"}),  # type: ignore[dict-item]
         facts({"x-team": "ops"}), ANON, True),
        (Rule(CRITICAL, headers={"X-Team": "ops"}),  # type: ignore[dict-item]
         facts({"x-team": "o"}), ANON, False),
        # AND across fields.
        (Rule(CRITICAL, models=("m",), stream=True), facts(model="m", stream=True), ANON,
         True),
        (Rule(CRITICAL, models=("m",), stream=True), facts(model="m", stream=False), ANON,
         False),
        (Rule(CRITICAL, headers={"a": ("1",), "b": ("2",)}), facts({"a": "1"}), ANON, False),
        (Rule(CRITICAL, headers={"a": ("1",), "b": ("2",)}), facts({"a": "1", "b": "2"}),
         ANON, True),
        # An empty rule matches everything.
        (Rule(CRITICAL), facts(), ANON, True),
    ],
)
def test_rule_fields(
    rule: Rule, request_facts: RequestFacts, principal: Principal, matches: bool
) -> None:
    result = classify(request_facts, principal, settings_with(rule))
    assert (result.source == "rule") is matches
    fallback = NORMAL if principal.tier is None else principal.tier
    assert result.tier == (CRITICAL if matches else fallback)


def test_first_matching_rule_wins() -> None:
    rules = settings_with(Rule(LOW, models=("m",)), Rule(CRITICAL, models=("m",)))
    assert classify(facts(model="m"), ANON, rules) == Classification(LOW, "rule")


def test_pattern_only_scans_a_bounded_prefix() -> None:
    rule = Rule(CRITICAL, last_user_pattern=re.compile("needle"))
    bounded = ClassifySettings(TIERS, NORMAL, (rule,), pattern_window=100)
    near = facts(last_user="x" * 50 + "needle")
    far = facts(last_user="x" * 200 + "needle")
    assert classify(near, ANON, bounded).tier == CRITICAL
    assert classify(far, ANON, bounded).tier == NORMAL


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tier_names": (), "default_tier": 0}, "at least one tier"),
        ({"tier_names": ("a", "A"), "default_tier": 0}, "unique"),
        ({"tier_names": TIERS, "default_tier": 4}, "default_tier"),
        ({"tier_names": TIERS, "default_tier": 0, "rules": (Rule(4),)}, r"rules\[0\]"),
    ],
)
def test_settings_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClassifySettings(**kwargs)  # type: ignore[arg-type]


def test_rule_header_needs_a_value() -> None:
    with pytest.raises(ValueError, match="x-a"):
        Rule(0, headers={"X-A": ()})


header_values = st.one_of(
    st.sampled_from(["critical", "HIGH", "3", "4", "0", "junk", ""]), st.text(max_size=8)
)


@given(
    priority=st.none() | header_values,
    scenario=st.none() | st.sampled_from(["realtime_chat", "morning_brief", "other"]),
    service_tier=st.none() | st.sampled_from(["priority", "flex", "auto", "default"]),
    key_tier=st.none() | st.integers(-2, 6),
    max_tier=st.integers(-2, 6),
)
@settings(max_examples=400, deadline=None)
def test_result_is_a_tier_and_respects_the_clamp(
    priority: str | None,
    scenario: str | None,
    service_tier: str | None,
    key_tier: int | None,
    max_tier: int,
) -> None:
    headers = {}
    if priority is not None:
        headers["x-priority"] = priority
    if scenario is not None:
        headers["x-scenario"] = scenario
    principal = Principal("k", tier=key_tier, max_tier=max_tier)
    result = classify(facts(headers, service_tier=service_tier), principal, SEED)
    assert 0 <= result.tier < len(TIERS)
    assert result.tier >= min(max(max_tier, 0), len(TIERS) - 1)
    if priority is not None and parse_priority(priority, TIERS) is not None:
        assert result.source == "header"
