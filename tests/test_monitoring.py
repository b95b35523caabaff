"""The shipped Grafana dashboard and Prometheus rules use only metrics and labels that
``proxy.http.base.metrics.Metrics`` exposes, and are well formed (unique panel ids, alerts with a
``for``, a severity and a summary)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from proxy.http.base.metrics import Family, Metrics

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "triage-proxy.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"

TARGET_LABELS = frozenset({"job", "instance"})  # attached by Prometheus when it scrapes
KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "inf", "nan",
})
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}")
MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*(?:,|$)')
IDENTIFIER = re.compile(r"(?<![\w.:$])[A-Za-z_:][\w:]*")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*,\s*([A-Za-z_]\w*)\s*\)\s*$", re.S)
GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
TEMPLATE_LABEL = re.compile(r"\$labels\.(\w+)")


# --- what the proxy exposes ---------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    family: str
    labels: frozenset[str]


def exposed_series() -> dict[str, Series]:
    """Every series name ``/metrics`` can carry → its family and label names (with ``le``
    for buckets, and the target's ``job``/``instance``). One child per labelled family is
    created so that the exposition shows its samples (and their suffixes)."""
    metrics = Metrics()
    labels: dict[str, frozenset[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, Family):  # labelled: one child shows its samples
            labels[value.metric._name] = frozenset(value.metric._labelnames)
            value.get(*("x" for _ in value.metric._labelnames))
        elif isinstance(value, Counter | Gauge | Histogram):  # unlabelled
            labels[value._name] = frozenset()
    registered = {f.name for f in metrics.registry.collect()}
    assert registered == set(labels), "a registry family is not an attribute of Metrics"
    series: dict[str, Series] = {}
    for parsed in text_string_to_metric_families(metrics.render().decode()):
        if parsed.name not in labels:  # the 0.0.4 format shows *_created as gauges of their own
            assert parsed.name.endswith("_created"), parsed.name
            continue
        for sample in parsed.samples:
            extra = {"le"} if sample.name.endswith("_bucket") else set()
            series[sample.name] = Series(parsed.name, labels[parsed.name] | extra | TARGET_LABELS)
    return series


# --- PromQL, lexically -------------------------------------------------------------------


@dataclass
class Query:
    """What a PromQL expression refers to: series names, label matchers per series, and
    the label lists of its grouping clauses with the series inside their scope."""

    expr: str
    names: set[str] = field(default_factory=set)
    matchers: list[tuple[str, str]] = field(default_factory=list)  # (series, label)
    groupings: list[tuple[str, set[str], set[str]]] = field(default_factory=list)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def _opening(text: str, end: int) -> int:
    """Index of the parenthesis that opens the group closing at ``text[end - 1]``."""
    depth = 0
    for i in range(end - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def _names(text: str) -> set[str]:
    text = GROUPING.sub(" ", text)
    found = set()
    for match in IDENTIFIER.finditer(text):
        rest = text[match.end():].lstrip()
        if match.group() in KEYWORDS or rest.startswith("("):  # a function or aggregation
            continue
        found.add(match.group())
    return found


def parse(expr: str) -> Query:
    for open_, close in ("()", "[]", "{}"):
        assert expr.count(open_) == expr.count(close), f"unbalanced {open_}{close}: {expr!r}"
    query = Query(expr)
    for name, body in SELECTOR.findall(expr):
        assert MATCHER.sub("", body).strip() == "", f"bad matchers {body!r} in {expr!r}"
        query.matchers += [(name, label) for label, *_ in MATCHER.findall(body)]
    text = re.sub(r"\{[^{}]*\}", "", expr)  # matchers (the only place strings are used)
    assert '"' not in text, f"strings outside matchers are not checked: {expr!r}"
    text = re.sub(r"\[[^\[\]]*\]", "", text)  # ranges and subqueries, with $__rate_interval
    text = GRAFANA_VARIABLE.sub("0", text)
    for match in GROUPING.finditer(text):
        labels = {x.strip() for x in match.group(2).split(",") if x.strip()}
        after = text[match.end():].lstrip()
        if match.group(1) in ("by", "without") and after.startswith("("):  # sum by (x) (...)
            start = len(text) - len(after)
            scope = text[start:_balanced(text, start)]
        elif match.group(1) in ("by", "without"):  # sum(...) by (x)
            end = len(text[:match.start()].rstrip())
            scope = text[_opening(text, end):end]
        else:  # on/ignoring/group_*: both sides of the binary operator
            scope = text
        query.groupings.append((match.group(1), labels, _names(scope)))
    query.names = _names(text)
    return query


def output_labels(query: Query, known: dict[str, Series]) -> frozenset[str]:
    """The labels an expression's result carries (roughly: what its ``by`` clauses keep,
    else those of the series it selects)."""
    kept = [labels for kind, labels, _ in query.groupings if kind == "by"]
    if kept:
        return frozenset(set.intersection(*kept) - {"le"})
    return frozenset().union(*(known[n].labels for n in query.names if n in known))


# --- the files ----------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def rules() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def rule_list() -> list[dict[str, Any]]:
    return [rule for group in rules()["groups"] for rule in group["rules"]]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in all_panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        raw = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES.match(raw)
        assert match, f"variable {var['name']}: only label_values(metric, label) is checked"
        selector, label = match.groups()
        # label_values(m, l) reads l off m: check it like `max by (l) (m)`.
        yield f"variable {var['name']}", f"max by ({label}) ({selector})"


def known_series() -> dict[str, Series]:
    """The exposed series plus the recording rules (with the labels they keep)."""
    known = exposed_series()
    for rule in rule_list():
        if "record" in rule:
            query = parse(rule["expr"])
            known[rule["record"]] = Series(rule["record"], output_labels(query, known))
    return known


def all_queries() -> list[tuple[str, str]]:
    found = list(dashboard_queries())
    found += [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for r in rule_list()]
    assert found
    return found


# --- the tests ----------------------------------------------------------------------------


def check(where: str, expr: str, known: dict[str, Series]) -> list[str]:
    query = parse(expr)
    errors = [f"{where}: unknown series {n!r}" for n in sorted(query.names - set(known))]
    for name, label in query.matchers:
        if name in known and label not in known[name].labels:
            errors.append(f"{where}: {name} has no label {label!r}")
    for kind, labels, names in query.groupings:
        assert names, f"{where}: {kind} ({', '.join(labels)}) groups no series"
        for name in names & set(known):
            for label in labels - known[name].labels:
                errors.append(f"{where}: {kind} ({label}) over {name}, which has no {label!r}")
    return errors


def test_every_series_and_label_used_exists() -> None:
    known = known_series()
    errors = [e for where, expr in all_queries() for e in check(where, expr, known)]
    assert not errors, "\n".join(errors)


def test_the_checker_catches_mistakes() -> None:
    known = known_series()
    assert not check("ok", 'sum by (provider) (rate(proxy_upstream_attempts_total'
                     '{outcome="throttle"}[5m]))', known)
    assert check("typo", "rate(proxy_upstream_atempts_total[5m])", known)
    assert check("no _total", "rate(proxy_requests[5m])", known)
    assert check("matcher", 'proxy_upstream_attempts_total{result="throttle"}', known)
    assert check("by", "sum by (provider) (rate(proxy_rejections_total[5m]))", known)
    assert check("by, suffix", "sum(rate(proxy_rejections_total[5m])) by (provider)", known)
    assert check("le", "sum by (le) (proxy_queue_depth)", known)
    assert not check("le", "sum by (le) (rate(proxy_queue_wait_seconds_bucket[5m]))", known)
    assert check("recorded", "sum by (instance) (key:proxy_budget_spent:ratio)", known)
    assert check("function as series", "sum by (tier) (rate(proxy_queue_depth_total[5m]))", known)


def test_metrics_used_cover_the_important_families() -> None:
    used = set().union(*(parse(expr).names for _, expr in all_queries()))
    families = {s.family for name, s in exposed_series().items() if name in used}
    assert families >= {
        "proxy_requests", "proxy_queue_wait_seconds", "proxy_queue_depth", "proxy_rejections",
        "proxy_upstream_inflight", "proxy_upstream_limit", "proxy_upstream_attempts",
        "proxy_upstream_latency_seconds", "proxy_upstream_ttft_seconds", "proxy_breaker_state",
        "proxy_tokens", "proxy_cost_usd", "proxy_cache_lookups", "proxy_budget_spent_usd",
        "proxy_budget_usd", "proxy_config_reloads",
    }


def test_dashboard_is_importable() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 36
    panels = list(all_panels(data["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"tier", "provider"} <= set(variables)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    for where, expr in dashboard_queries():
        for var in GRAFANA_VARIABLE.findall(expr):
            name = var.strip("${}").split(":")[0]
            assert name.startswith("__") or name in variables, f"{where}: {var} undefined"


def test_rules_are_complete() -> None:
    rule_names = [r.get("alert") or r.get("record") for r in rule_list()]
    assert len(rule_names) == len(set(rule_names)), "duplicate rule names"
    alerts = [r for r in rule_list() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "ProxyQueueWaitHighCritical", "ProxyBreakerOpen", "ProxyUpstreamThrottled",
        "ProxyRejecting", "ProxyConfigReloadFailed", "ProxyBudgetNearlySpent",
    }
    known = known_series()
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), f"{name}: no for"
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = alert["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        carried = output_labels(parse(alert["expr"]), known)
        for text in annotations.values():
            for label in TEMPLATE_LABEL.findall(text):
                assert label in carried, f"{name}: $labels.{label} is not in its result"


@pytest.mark.parametrize("record", [r for r in rule_list() if "record" in r],
                         ids=lambda r: r["record"])
def test_recording_rule_names_follow_the_convention(record: dict[str, Any]) -> None:
    assert re.fullmatch(r"[a-z_]+:proxy_[a-z_]+:[a-z0-9_]+", record["record"])
