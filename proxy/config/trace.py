"""Request traces: the Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``,
optionally with ``tier``, ``key``, ``model``, ``max_tokens``, ``stream`` columns), JSONL
objects ``{"t", "prompt_tokens", "output_tokens", "tier"?, "key"?, "model"?, "max_tokens"?,
"stream"?}``, or
the proxy's own JSON access log (``.jsonl`` or ``.log``: observe, then replay), for the
simulator, the benchmarks and the tests that replay real arrivals."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.formats.endpoints import ENDPOINTS
from .reader import ConfigError

__all__ = ["SHIPPED_TRACE", "TraceCall", "read_calls", "read_trace"]

# The first 11 minutes of the public Azure conversation trace, shipped with the repo.
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "traces/azure_llm_conv_2023_first11min.csv"


@dataclass(frozen=True)
class TraceCall:
    t: float  # seconds after the trace's first call
    prompt_tokens: int
    output_tokens: int  # what the call really produced
    tier: str | None = None
    key: str | None = None
    model: str | None = None
    max_tokens: int | None = None  # what the client asked for
    # Whether the client streamed: the proxy sees a call's time to first token, and its
    # estimator learns it, only from a stream. Traces that do not say are taken as streams.
    stream: bool = True


def _count(value: object, where: str, name: str, optional: bool = False) -> int | None:
    if optional and value in (None, ""):
        return None
    try:
        number = int(str(value))
    except ValueError:
        raise ConfigError(f"{where}: {name} must be a whole number") from None
    if number < 0:
        raise ConfigError(f"{where}: {name} must not be negative")
    return number


def _text(value: object) -> str | None:
    return None if value in (None, "") else str(value)


def _stream(value: object, where: str) -> bool:
    """A row's ``stream`` (true or false, 1 or 0); a row without one is a stream."""
    if value is None or value == "":
        return True
    text = str(value).strip().lower()
    if text in ("true", "1", "false", "0"):
        return text in ("true", "1")
    raise ConfigError(f"{where}: stream must be true or false")


def read_calls(path: Path) -> list[TraceCall]:
    """Every call of the trace at ``path`` (``.jsonl`` or ``.log``: JSON lines; else the CSV
    form), sorted by arrival; raises ConfigError naming the line of a bad row. In a
    ``.log`` file, lines that are not JSON objects (``serve`` prints ``listening on …``
    to the same stdout as the access log) are skipped."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            calls = _json_lines(path, f) if path.suffix in (".jsonl", ".log") else _csv(
                path, f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    calls.sort(key=lambda c: c.t)
    return calls


def _json_lines(path: Path, lines: Iterable[str]) -> list[TraceCall]:
    calls = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or (path.suffix == ".log" and not line.lstrip().startswith("{")):
            continue
        call = _json_call(line, f"{path}:{number}")
        if call is not None:
            calls.append(call)
    first_t = min((c.t for c in calls), default=0.0)
    if first_t > ACCESS_LOG_EPOCH:  # access-log times: make them relative
        calls = [dataclasses.replace(c, t=c.t - first_t) for c in calls]
    return calls


_LONG_FRACTION = re.compile(r"(\.\d{6})\d+")


def _stamp(text: str) -> datetime.datetime:
    """A timestamp as naive UTC (the Azure traces' 7-digit fractions cut to 6)."""
    stamp = datetime.datetime.fromisoformat(_LONG_FRACTION.sub(r"\1", text.strip()))
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(datetime.UTC).replace(tzinfo=None)
    return stamp


def _csv(path: Path, lines: Iterable[str]) -> list[TraceCall]:
    reader = csv.DictReader(lines)
    missing = [c for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
               if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(f"{path}:1: missing column {', '.join(missing)} (the header needs "
                          "TIMESTAMP,ContextTokens,GeneratedTokens)")
    calls = []
    first: datetime.datetime | None = None
    for number, row in enumerate(reader, 2):
        where = f"{path}:{number}"
        try:
            stamp = _stamp(row["TIMESTAMP"] or "")
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: TIMESTAMP is missing or not a time") from None
        first = first or stamp
        calls.append(TraceCall(
            (stamp - first).total_seconds(),
            _count(row.get("ContextTokens"), where, "ContextTokens") or 0,
            _count(row.get("GeneratedTokens"), where, "GeneratedTokens") or 0,
            _text(row.get("tier")), _text(row.get("key")), _text(row.get("model")),
            _count(row.get("max_tokens"), where, "max_tokens", optional=True),
            _stream(row.get("stream"), where)))
    return calls


def _json_call(line: str, where: str) -> TraceCall | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise ConfigError(f"{where}: not a JSON object") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if "ts" in row and "t" not in row:
        return _logged_call(row, where)
    t = row.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
        raise ConfigError(f"{where}: t must be a number of seconds, at least 0")
    return TraceCall(
        float(t), _count(row.get("prompt_tokens", 0), where, "prompt_tokens") or 0,
        _count(row.get("output_tokens", 0), where, "output_tokens") or 0,
        _text(row.get("tier")), _text(row.get("key")), _text(row.get("model")),
        _count(row.get("max_tokens"), where, "max_tokens", optional=True),
        _stream(row.get("stream"), where))


# Seconds since the epoch of 2001: trace times past it are wall-clock times (access logs).
ACCESS_LOG_EPOCH = 1e9
GENERATING_PATHS = frozenset(e.path for e in ENDPOINTS if e.generates)


def _logged_call(row: dict[str, object], where: str) -> TraceCall | None:
    """A line of the proxy's JSON access log as a trace row (arrival, tokens, tier, key,
    model, and a stream where it logged a time to first token, which only streams have);
    None for what never waited for a slot (refused before classification, cache hits,
    other endpoints)."""
    if row.get("path") not in GENERATING_PATHS or row.get("tier") is None or row.get(
            "cache") == "hit":
        return None
    try:
        stamp = datetime.datetime.fromisoformat(str(row["ts"]).replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{where}: ts is not a time") from None
    return TraceCall(
        stamp.timestamp(), _count(row.get("prompt_tokens") or 0, where, "prompt_tokens") or 0,
        _count(row.get("completion_tokens") or 0, where, "completion_tokens") or 0,
        _text(row.get("tier")), _text(row.get("key")), _text(row.get("model")),
        stream=row.get("ttft_ms") is not None)


def read_trace(path: Path, start_s: float = 0.0,
               length_s: float = float("inf")) -> list[tuple[float, int, int]]:
    """(seconds after ``start_s``, prompt tokens, output tokens) of the calls that arrived
    in ``[start_s, start_s + length_s)`` after the trace's first call."""
    return [(c.t - start_s, c.prompt_tokens, c.output_tokens) for c in read_calls(path)
            if 0 <= c.t - start_s < length_s]
