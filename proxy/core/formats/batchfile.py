"""A Batch API input file (JSONL) read into lines the proxy can run, or the reasons it
cannot: pure, so a million lines are checked without I/O and the rules are testable.

Each line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's shape); ``url``
must be the batch's endpoint. A line that breaks a rule is reported in the batch's error
file; the batch runs the others. Duplicate ``custom_id`` values are refused (the output
is matched to the input by them).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .endpoints import ENDPOINTS

BATCH_PATHS = tuple(e.path for e in ENDPOINTS if e.batch)
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    index: int
    custom_id: str
    body: bytes  # the request body, re-serialised (stream off)


@dataclass(frozen=True, slots=True)
class BadLine:
    index: int
    custom_id: str | None  # None: the line has no usable one (its error line says null)
    message: str


def read_lines(data: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[BadLine]]:
    """Good lines and bad ones, in file order; empty lines are skipped. Lines end at
    ``\n`` only (JSON may hold U+2028). Raises ValueError if the file as a whole is unusable
    (no line, too many lines)."""
    good: list[Line] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    index = start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        raw = data[start:end]
        start = end + 1
        index += 1
        if not raw.strip():
            continue
        if len(good) + len(bad) >= max_lines:
            raise ValueError(f"the file has more than {max_lines} lines")
        line = _line(index - 1, raw, endpoint, seen)
        if isinstance(line, BadLine):
            bad.append(line)
        else:
            good.append(line)
    if not good and not bad:
        raise ValueError("the file has no lines")
    return good, bad


def _line(index: int, raw: bytes, endpoint: str, seen: set[str]) -> Line | BadLine:
    try:
        item = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return BadLine(index, None, "not a JSON object (or not UTF-8)")
    if not isinstance(item, dict):
        return BadLine(index, None, "not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return BadLine(index, None, f"custom_id: a string of 1 to {MAX_CUSTOM_ID} characters")
    if custom_id in seen:  # each custom_id is answered once, by its first line
        return BadLine(index, None, f"custom_id: {custom_id[:64]!r} is used by an earlier line")
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        return BadLine(index, custom_id, "method: must be POST")
    if item.get("url") != endpoint:
        return BadLine(index, custom_id, f"url: must be the batch's endpoint, {endpoint}")
    body = item.get("body")
    if not isinstance(body, dict):
        return BadLine(index, custom_id, "body: must be a JSON object")
    if "background" in body:  # a line is already work that can wait
        return BadLine(index, custom_id, "body.background: not allowed in a batch line")
    if body.get("stream"):
        body = {**body, "stream": False}  # a batch line's answer is stored whole
    try:
        encoded = orjson.dumps(body)
    except orjson.JSONEncodeError:
        return BadLine(index, custom_id, "body: nested too deeply")
    return Line(index, custom_id, encoded)
