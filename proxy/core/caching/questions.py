"""Which calls the semantic cache may answer, and what of them must match exactly.

A call is a candidate when its model has a ``semantic_cache``, it is a chat or legacy
completions call, and it may be answered from the past: ``temperature: 0``, a ``seed``, or
the request header ``x-proxy-cache: semantic``. Of a candidate only the last user message
(a completions call's ``prompt``) is compared by meaning; everything else (the system
prompt, the earlier turns, the parameters, the key, the model) must match exactly: its
hash is the *scope* the nearest neighbour is searched in, so one key never gets another
key's answer and one conversation never another's. Bypassed (never looked up, never
stored): tools or functions offered, a tool call or tool result in the conversation,
content that is not text (images, audio, files), a conversation whose last message is not
the user's, an empty question.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from typing import Any

import orjson

from ..value import value

HEADER = "x-proxy-cache"
HEADER_VALUE = "semantic"
SEMANTIC_KINDS = frozenset({"chat", "completions"})
# Fields that never change the answer (as the exact cache leaves them out).
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store",
                            "service_tier", "model"})
TOOL_FIELDS = frozenset({"tools", "functions", "tool_choice", "function_call"})
MAX_QUESTION_CHARS = 32_000  # longer questions are not embedded (nor cached)
# The similarity bands a lookup's best match is counted in (fixed: bounded labels).
BAND_EDGES = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


@value
class Question:
    scope: bytes  # the hash of everything that must match exactly
    text: str  # what is compared by meaning


def may_answer_from_past(body: Mapping[str, Any], headers: Mapping[str, str]) -> bool:
    temperature = body.get("temperature")
    zero = (isinstance(temperature, int | float) and not isinstance(temperature, bool)
            and temperature == 0)
    return (zero or body.get("seed") is not None
            or headers.get(HEADER, "").strip().lower() == HEADER_VALUE)


def question(kind: str, key_name: str, model: str,
             body: Mapping[str, Any]) -> Question | str:
    """The call's question, or why it is bypassed (``tools``, ``media``, ``shape``)."""
    if TOOL_FIELDS & body.keys():
        return "tools"
    rest = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    if kind == "completions":
        prompt = rest.pop("prompt", None)
        if not isinstance(prompt, str):
            return "shape"
        text = prompt
    else:
        messages = rest.pop("messages", None)
        if not isinstance(messages, list) or not messages:
            return "shape"
        for message in messages:
            if not isinstance(message, dict):
                return "shape"
            if message.get("role") in ("tool", "function") or message.get("tool_calls") \
                    or message.get("function_call"):
                return "tools"
            if _text(message.get("content")) is None:
                return "media"
        last = messages[-1]
        if last.get("role") != "user":
            return "shape"
        text = _text(last.get("content")) or ""
        rest["messages"] = messages[:-1]
    if not text.strip() or len(text) > MAX_QUESTION_CHARS:
        return "shape"
    canonical = orjson.dumps([kind, key_name, model, _canonical(rest)],
                             option=orjson.OPT_SORT_KEYS)
    return Question(hashlib.sha256(canonical).digest(), text)


def band(similarity: float) -> str:
    """The fixed band ``similarity`` falls in: ``<0.5``, ``0.5-0.7``, … ``0.98-1``."""
    if similarity < BAND_EDGES[0]:
        return f"<{BAND_EDGES[0]:g}"
    for low, high in itertools.pairwise(BAND_EDGES):
        if similarity < high:
            return f"{low:g}-{high:g}"
    return f"{BAND_EDGES[-1]:g}-1"


BANDS = (f"<{BAND_EDGES[0]:g}",
         *(f"{a:g}-{b:g}" for a, b in itertools.pairwise(BAND_EDGES)),
         f"{BAND_EDGES[-1]:g}-1")


def _text(content: object) -> str | None:
    """A message's text; None if it carries anything but text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    pieces = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            return None
        pieces.append(part["text"])
    return "\n".join(pieces)


def _canonical(item: Any) -> Any:
    if isinstance(item, dict):
        return {k: _canonical(v) for k, v in item.items()}
    if isinstance(item, list):
        return [_canonical(v) for v in item]
    if isinstance(item, float) and item.is_integer():
        return int(item)
    return item
