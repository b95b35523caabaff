"""docs/reference.md names every key of routing.yaml, with the default the code has, and no
key the code does not know.

There is no table of keys in the code to compare with: a section's keys are the ones its
parser reads (``Node.raw``), and ``Node.check_unknown`` refuses every other. So the test
asks the parsers themselves. It parses a file that writes every key (FULL), one that leaves
every key out that may be left out (SPARSE) and one whose secrets are unset (DISABLED), and
records, with the YAML path normalized (``providers[].timeouts.connect_s``,
``models.<name>.strategy``):

- every key a parser read: the keys a user can write;
- what a typed reader (``integer``, ``number``, ``string``, …) returned for a key that was
  left out: the default;
- the line of every call of a reader in proxy/config/, so that a key read only by a branch
  none of the three files takes fails the test instead of going unnoticed.

A key is *required* when leaving it out of SPARSE is an error that names it.

The reference's tables under "## routing.yaml" have one row per key: its path in code font,
then the default, then the meaning. The default cell reads:

- the default as YAML in code font (``10``, ``127.0.0.1``, ``[1, 5, 30]``); a default that
  depends on the rest of the file (per kind, per position) lists each value the files give;
- ``required`` (possibly with a condition: "required for kind azure");
- ``retired`` for a scheduler setting that became a config error (``RETIRED_SCHEDULER_KEYS``);
- otherwise words first ("none: no limit", "the key's `tier`"): no fixed default.

The dataclasses the sections parse into keep defaults of their own; where a field has the
name of its YAML key, its default must be one the parser gives (one source a reader of the
code may trust).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from proxy.config import ConfigError, parse_config
from proxy.config import batch as batch_config
from proxy.config import load as load_config
from proxy.config import state as state_config
from proxy.config.reader import Node
from proxy.core.call.classify import Principal
from proxy.core.call.estimate import EstimateSettings
from proxy.core.call.retry import RetrySettings
from proxy.core.call.route import CacheSettings, Degradation, Deployment, SemanticSettings
from proxy.core.health.breaker import BreakerSettings
from proxy.core.health.provider import Provider, SimSettings, Timeouts
from proxy.core.scheduling.scheduler import SchedulerSettings, TierSpec
from proxy.core.scheduling.schedules import Schedule

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "proxy" / "config"
REFERENCE = ROOT / "docs" / "reference.md"
DIGEST = "0" * 64

# Every key written, every branch of the parsers taken.
FULL: dict[str, Any] = {
    "listen": {"host": "127.0.0.1", "port": 8080},
    "tiers": [
        {"name": "critical", "weight": 8, "max_wait_s": 10, "max_queue": 100, "reserve": 1},
        {"name": "high"}, {"name": "normal"}, {"name": "low"},
    ],
    "scheduler": {
        "max_queue": 100, "level_bounds_s": [1, 5], "promote_after_s": [1, 2, 3],
        "tier_promote_after_s": 60, "headroom_spread": 1.5, "headroom_horizon_s": 20,
        "headroom_budget": 0.02, "rescue_fraction": 0.3, "refuse_early": False,
    },
    "schedules": {"timezone": "Europe/Berlin", "windows": [
        {"name": "peak", "hours": "18-23", "days": [1, 2], "weights": {"low": 1},
         "reserves": {"high": 2}},
    ]},
    "classify": {
        "default_tier": "normal",
        "keys": [
            {"name": "app", "key": "${APP_KEY}", "tier": "high", "max_tier": "critical",
             "rpm": 60, "tpm": 6000, "weight": 2, "budget_usd": {"amount": 5, "period": "day"}},
            {"name": "batch", "key_sha256": DIGEST},
        ],
        "rules": [{"tier": "low", "match": {
            "header": {"X-Scenario": ["a", "b"]}, "model": "chat*", "key": "app",
            "min_prompt_tokens": 1, "max_prompt_tokens": 9, "last_user_regex": "x",
            "stream": True,
        }}],
    },
    "providers": [
        {"name": "openai", "kind": "openai", "base_url": "https://api.openai.com/v1",
         "api_key": "${OPENAI_KEY}", "max_concurrency": 4, "rpm": 60, "tpm": 6000,
         "headers": {"X-Team": "${TEAM}"}, "accepts_service_tier": True,
         "max_response_bytes": 1024,
         "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 3, "response_s": 4},
         "breaker": {"consecutive_failures": 2, "error_rate": 0.4, "window_s": 10,
                     "min_calls": 5, "cooldown_s": 1, "cooldown_max_s": 9,
                     "half_open_probes": 2},
         "simulate": {"ttft_s": 0.1}},
        {"name": "azure", "kind": "azure", "base_url": "https://x.openai.azure.com/openai",
         "api_key": "az", "api_version": "2024-10-21"},
        {"name": "claude", "kind": "anthropic", "base_url": "https://api.anthropic.com",
         "api_key": "sk-ant", "anthropic_version": "2023-06-01"},
        {"name": "gpu", "kind": "openai", "base_url": "http://10.0.0.5:8000/v1",
         "engine": "vllm", "max_concurrency": "auto", "priority": True, "read_every_s": 0.5},
        {"name": "sim", "kind": "simulated", "simulate": {
            "ttft_s": 0.1, "tokens_per_s": 10, "prefill_tokens_per_s": 1000,
            "default_output_tokens": 8, "max_output_tokens": 16, "error_rate": 0.1,
            "capacity": 2, "seed": 7, "slots": 3, "slows_past": 2}},
    ],
    "models": {
        "chat": {
            "strategy": "cheapest", "tiers": {"critical": "best_quality"},
            "max_cost": {"low": 0.01},
            "degrade": {"tiers": ["low"], "max_wait_s": 5, "allow": ["sim/small"],
                        "shed_wait_s": 60},
            "cache": {"ttl_s": 60, "max_entries": 10},
            "semantic_cache": {"embedding_model": "chain", "threshold": 0.9, "ttl_s": 60,
                               "max_entries": 10},
            "candidates": [
                {"provider": "openai", "model": "gpt", "input_cost": 1, "output_cost": 2,
                 "quality": 0.9, "weight": 2, "max_output_tokens": 100,
                 "service_tier": {"critical": "priority", "low": "flex"},
                 "costs": {"flex": {"input": 0.5, "output": 1}}},
                {"provider": "sim", "model": "small"},
                {"provider": "gpu", "model": "llama", "priority": {"critical": 0, "low": 9}},
            ],
        },
        "chain": [{"provider": "azure", "model": "gpt"}],
    },
    "admin": {"key": "${ADMIN_KEY}"},
    "access_log": {"enabled": True, "format": "text"},
    "drain_timeout_s": 10,
    "retry": {"max_attempts": 2, "budget": 0.1, "backoff_base_s": 0.1, "backoff_max_s": 1},
    "limits": {"max_body_bytes": 1024, "write_timeout_s": 5, "exact_token_chars": 100,
               "max_json_depth": 10, "max_json_containers": 100},
    "estimate": {"output_tokens": 10, "ttft_s": 0.1, "seconds_per_token": 0.01,
                 "prefill_seconds_per_token": 0.001},
    "state": {"backend": "memory", "url": "redis://127.0.0.1:6379/1", "prefix": "t",
              "lease_ttl_s": 5, "on_error": "reject"},
    "batch": {"tier": "low", "max_in_flight": 8, "retention_days": 1,
              "max_file_bytes": 1024, "max_lines": 10},
    "storage": {"path": ":memory:", "max_bytes": 1024 * 1024},
}
FULL_ENV = {"APP_KEY": "app", "OPENAI_KEY": "sk-x", "TEAM": "search", "ADMIN_KEY": "admin"}

# What must be written, and the sections whose keys are read only when they are present.
SPARSE: dict[str, Any] = {
    "tiers": [{"name": "critical"}, {"name": "high"}, {"name": "normal"}, {"name": "low"}],
    "schedules": {"windows": [{"hours": "18-23"}]},
    "classify": {
        "keys": [{"name": "batch", "key_sha256": DIGEST,
                  "budget_usd": {"amount": 5, "period": "month"}}],
        "rules": [{"tier": "low", "match": {}}],
    },
    "providers": [
        {"name": "openai", "base_url": "https://api.openai.com/v1"},
        {"name": "azure", "kind": "azure", "base_url": "https://x.openai.azure.com/openai",
         "api_version": "2024-10-21"},
        {"name": "claude", "kind": "anthropic"},
        {"name": "sim", "kind": "simulated"},
    ],
    "models": {"chat": {"degrade": {"max_wait_s": 5}, "cache": {},
                        "semantic_cache": {"embedding_model": "chat"},
                        "candidates": [{"provider": "sim", "model": "small"},
                                       {"provider": "openai", "model": "x",
                                        "costs": {"flex": {"input": 1, "output": 1}}}]}},
    "admin": {"key_sha256": "1" * 64},
}

# Every secret's variable set to nothing: the provider, the key and the admin key disabled.
DISABLED = {
    **SPARSE,
    "classify": {"keys": [{"name": "app", "key": "${APP_KEY}"}]},
    "providers": [*SPARSE["providers"], {"name": "off", "base_url": "https://x",
                                         "api_key": "${OPENAI_KEY}"}],
    "admin": {"key": "${ADMIN_KEY}"},
}
DISABLED_ENV = {"APP_KEY": "", "OPENAI_KEY": "", "ADMIN_KEY": ""}

# Defaults the parsers compute outside the typed readers, read off the parsed SPARSE.
COMPUTED: dict[str, Callable[[Any], object]] = {
    "scheduler.level_bounds_s": lambda c: list(c.scheduler.level_bounds_s),
    "scheduler.promote_after_s": lambda c: list(c.scheduler.promote_after_s),
    "classify.default_tier": lambda c: c.tier_names[c.classify.default_tier],
}

# The dataclass each section is parsed into, for the check of their own defaults.
SECTION_TYPES: dict[str, type] = {
    "": load_config.Config,
    "listen": load_config.Listen,
    "limits": load_config.Limits,
    "access_log": load_config.AccessLogSettings,
    "retry": RetrySettings,
    "estimate": EstimateSettings,
    "state": state_config.StateSettings,
    "batch": batch_config.BatchSettings,
    "storage": batch_config.StorageSettings,
    "scheduler": SchedulerSettings,
    "tiers[]": TierSpec,
    "schedules.windows[]": Schedule,
    "classify.keys[]": Principal,
    "providers[]": Provider,
    "providers[].timeouts": Timeouts,
    "providers[].breaker": BreakerSettings,
    "providers[].simulate": SimSettings,
    "models.<name>.candidates[]": Deployment,
    "models.<name>.degrade": Degradation,
    "models.<name>.cache": CacheSettings,
    "models.<name>.semantic_cache": SemanticSettings,
}

READERS = ("raw", "node", "items", "string", "secret", "choice", "optional_string",
           "integer", "optional_integer", "number", "optional_number", "boolean", "mapping",
           "string_list")
TYPED = ("string", "secret", "choice", "optional_string", "integer", "optional_integer",
         "number", "optional_number", "boolean")


def normalized(path: str) -> str:
    """``providers[2].timeouts`` → ``providers[].timeouts``; a model's name → ``<name>``;
    a model written as a list is its ``candidates``."""
    path = re.sub(r"\[\d+\]", "[]", path)
    path = re.sub(r"^models\.[^.\[]+", "models.<name>", path)
    path = re.sub(r"\.costs\.[^.]+", ".costs.<tier>", path)  # a provider tier's prices
    return re.sub(r"^models\.<name>\[\]", "models.<name>.candidates[]", path)


@dataclass
class Schema:
    keys: set[str] = field(default_factory=set)
    defaults: dict[str, list[object]] = field(default_factory=lambda: defaultdict(list))
    lines: set[tuple[str, int]] = field(default_factory=set)
    required: set[str] = field(default_factory=set)

    def leaves(self) -> set[str]:
        """Keys with no key beneath them (a mapping of names, like ``headers``, is a leaf)."""
        return {k for k in self.keys
                if not any(o.startswith((k + ".", k + "[")) for o in self.keys)}


def wrapped(name: str, into: Schema, depth: list[int]) -> Callable[..., object]:
    """Node's reader ``name``, recording what it reads, where it is called from and what it
    returns for a key that is left out (only the outermost typed reader: ``string`` calls
    ``secret``)."""
    original = getattr(Node, name)

    @functools.wraps(original)
    def reader(self: Node, key: str, *args: object, **kwargs: object) -> object:
        caller = sys._getframe(1).f_code.co_filename
        if Path(caller).parent == CONFIG_DIR:
            into.lines.add((Path(caller).name, sys._getframe(1).f_lineno))
        path = normalized(self.sub(key))
        if name == "raw":  # what Node.check_unknown counts as known
            into.keys.add(path)
        if name not in TYPED or depth[0]:
            return original(self, key, *args, **kwargs)
        depth[0] += 1
        try:
            value = original(self, key, *args, **kwargs)
        finally:
            depth[0] -= 1
        if key not in self.data:
            into.defaults[path].append(value)
        return value

    return reader


@contextlib.contextmanager
def recording(into: Schema) -> Iterator[None]:
    depth = [0]
    with contextlib.ExitStack() as stack:
        for name in READERS:
            stack.enter_context(mock.patch.object(Node, name, wrapped(name, into, depth)))
        yield


def concrete_keys(data: object, path: str = "") -> Iterator[tuple[str, list[object]]]:
    """Each key written in ``data``: its YAML path and the route to it through the data."""
    if isinstance(data, dict):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            yield sub, [key]
            for deeper, route in concrete_keys(value, sub):
                yield deeper, [key, *route]
    elif isinstance(data, list):
        for i, value in enumerate(data):
            for deeper, route in concrete_keys(value, f"{path}[{i}]"):
                yield deeper, [i, *route]


def without(data: Any, route: list[object]) -> Any:
    if len(route) == 1:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k != route[0]}
        return data
    head, rest = route[0], route[1:]
    if isinstance(data, dict):
        return {**data, head: without(data[head], rest)}
    return [without(v, rest) if i == head else v for i, v in enumerate(data)]


@functools.cache
def schema() -> Schema:
    result = Schema()
    with recording(result):
        parse_config(FULL, FULL_ENV)
        sparse = parse_config(SPARSE, {})
        parse_config(DISABLED, DISABLED_ENV)
    for path, route in concrete_keys(SPARSE):
        key = normalized(path)
        if key not in result.keys:
            continue  # a model's name, not a key
        try:
            parse_config(without(SPARSE, route), {})
        except ConfigError as exc:
            parent, _, name = path.rpartition(".")
            message = str(exc)
            if message.startswith(f"{path}:") or (
                    message.startswith(f"{parent}:") and f"'{name}'" in message):
                result.required.add(key)
    for key, read in COMPUTED.items():
        result.defaults[key].append(read(sparse))
    return result


@dataclass(frozen=True)
class Row:
    key: str
    default: str
    meaning: str
    line: int


def cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


@functools.cache
def documented() -> dict[str, Row]:
    text = REFERENCE.read_text(encoding="utf-8")
    start = text.index("\n## routing.yaml\n")
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    rows: dict[str, Row] = {}
    first_line = text[:start].count("\n") + 2
    for number, line in enumerate(text[start:end].splitlines(), first_line - 1):
        if not line.startswith("|") or line.startswith(("| key ", "| ---")):
            continue
        row = cells(line)
        assert len(row) == 3, f"reference.md:{number}: a row needs key | default | meaning"
        spans = re.findall(r"`([^`]+)`", row[0])
        assert len(spans) == 1 and row[0] == f"`{spans[0]}`", (
            f"reference.md:{number}: the key cell is one key in code font: {row[0]!r}")
        assert spans[0] not in rows, f"reference.md:{number}: {spans[0]} is listed twice"
        rows[spans[0]] = Row(spans[0], row[1], row[2], number)
    return rows


def same(a: object, b: object) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and (
            not isinstance(b, bool)):
        return float(a) == float(b) or (math.isinf(a) and math.isinf(b) and a == b)
    return type(a) is type(b) and a == b


def values_in(cell: str) -> list[object]:
    values: list[object] = []
    for span in re.findall(r"`([^`]+)`", cell):
        try:
            values.append(yaml.safe_load(span))
        except yaml.YAMLError:
            values.append(span)
    return values


def test_the_recording_reads_every_key_the_parsers_know() -> None:
    """Every call of a reader in proxy/config/ ran while the three files were parsed: a
    key only a branch they miss reads would be missing from this test, so it fails."""
    calls: set[tuple[str, int, int]] = set()
    for source in sorted(CONFIG_DIR.glob("*.py")):
        if source.name == "reader.py":
            continue
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in READERS and node.args):
                calls.add((source.name, node.lineno, node.end_lineno or node.lineno))
    assert len(calls) > 100  # the scan sees the parsers
    ran = schema().lines
    missed = sorted(f"proxy/config/{name}:{first}" for name, first, last in calls
                    if not any(n == name and first <= line <= last for n, line in ran))
    assert not missed, f"reader calls no test file reaches (extend FULL/SPARSE): {missed}"


def test_every_key_is_documented() -> None:
    missing = sorted(schema().leaves() - set(documented()))
    assert not missing, f"keys the code reads that docs/reference.md does not list: {missing}"


def test_the_reference_names_no_key_the_code_does_not_know() -> None:
    retired = {f"scheduler.{key}" for key in load_config.RETIRED_SCHEDULER_KEYS}
    unknown = sorted(set(documented()) - schema().keys - retired)
    assert not unknown, f"docs/reference.md lists keys the code does not read: {unknown}"
    for key in sorted(retired):
        assert key in documented(), f"{key}: a retired key the reference should name"
        assert documented()[key].default == "retired", key


def test_every_default_is_the_codes() -> None:
    known = schema()
    wrong: list[str] = []
    for key, row in sorted(documented().items()):
        if key not in known.keys:
            continue  # retired
        given = [v for v in known.defaults.get(key, []) if v is not None]
        spans = values_in(row.default)
        where = f"reference.md:{row.line}: {key}"
        if key in known.required:
            if "required" not in row.default:
                wrong.append(f"{where}: is required, the reference says {row.default!r}")
        elif given:
            absent = [v for v in given if not any(same(v, s) for s in spans)]
            if absent:
                wrong.append(f"{where}: the code's default is {absent[0]!r}, "
                             f"the reference says {row.default!r}")
        elif row.default.startswith(("`", "required")):
            wrong.append(f"{where}: has no fixed default, the reference says {row.default!r}")
    assert not wrong, "\n".join(wrong)


def test_the_computed_defaults_are_those_no_typed_reader_gives() -> None:
    for key in COMPUTED:
        assert key in schema().leaves(), key
        assert len(schema().defaults[key]) == 1, f"{key}: a typed reader gives its default"


def test_the_dataclasses_defaults_are_the_parsers() -> None:
    """A section's dataclass may hold defaults of its own (``Timeouts().connect_s``); a
    field named as its YAML key must default to what the parser gives for that key."""
    known = schema()
    checked, wrong = 0, []
    for section, kind in SECTION_TYPES.items():
        for f in dataclasses.fields(kind):
            if f.default is dataclasses.MISSING:
                continue
            key = f"{section}.{f.name}" if section else f.name
            given = known.defaults.get(key)
            if key not in known.keys or not given:
                continue
            checked += 1
            if not any(same(f.default, v) for v in given):
                wrong.append(f"{kind.__name__}.{f.name} = {f.default!r}, the parser: {given}")
    assert checked > 50
    assert not wrong, wrong


@pytest.mark.parametrize(("path", "key"), [
    ("providers[3].timeouts.connect_s", "providers[].timeouts.connect_s"),
    ("models.chat.strategy", "models.<name>.strategy"),
    ("models.chat.candidates[1].model", "models.<name>.candidates[].model"),
    ("models.chat[0].provider", "models.<name>.candidates[].provider"),  # a list: its chain
])
def test_paths_are_normalized(path: str, key: str) -> None:
    assert normalized(path) == key


def test_the_reader_methods_are_the_ones_wrapped() -> None:
    public = {name for name, _ in inspect.getmembers(Node, inspect.isfunction)
              if not name.startswith("_")}
    # ``has`` and ``sub`` look at a key without reading it; ``check_unknown`` reads none.
    assert public - set(READERS) == {"has", "sub", "check_unknown"}
