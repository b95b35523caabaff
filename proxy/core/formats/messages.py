"""Anthropic Messages answers ↔ the neutral events (``proxy.core.formats.events``): streams
(``message_start`` … ``message_stop``), whole ``message`` answers, error bodies.

Read, per field:

- ``message.id``, ``model`` → ``Start``; ``text`` blocks and ``text_delta`` → ``TextDelta``;
  ``tool_use`` blocks → ``ToolCallStart`` (numbered among the tool calls, whatever their
  block index) and their ``input`` / ``input_json_delta`` → ``ToolArgsDelta``; ``thinking``
  blocks, ``thinking_delta`` and ``signature_delta`` → ``ThinkingDelta``; ``stop_reason``
  and ``stop_sequence`` → ``Finish``; ``usage`` (``message_start``'s, then
  ``message_delta``'s, whose counts are the answer's so far) → one ``Usage``, its input
  ``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``;
  ``message_stop`` → ``End``; an ``error`` event → ``Error``.
- Not read: ``ping``, ``redacted_thinking``, server tools' blocks (``server_tool_use``,
  ``web_search_tool_result``, …), ``citations``, ``stop_details``, ``container``, usage's
  ``cache_creation`` split, ``server_tool_use``, ``service_tier``; an event type Anthropic
  adds later is read past, as its versioning policy asks.

Written: every field Anthropic's spec requires (null where this proxy knows nothing);
``message_start`` with the input tokens the request was estimated at (the stream's own
count is told only at its end, in ``message_delta.usage``, which is where Anthropic puts
the correction too); one block at a time, closed when the next starts; ``message_delta``
(stop reason, stop sequence, usage) and ``message_stop`` at ``End``; an ``Error`` is
``event: error`` and nothing after it. Error types follow the status as Anthropic's
errors page pairs them, within the spec's nine types (413 and 409 are
``invalid_request_error``, the spec having no ``request_too_large`` or ``conflict_error``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from ..errors import UpstreamBadResponse
from .events import (
    End,
    Error,
    Event,
    Finish,
    FinishReason,
    Start,
    TextDelta,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCallStart,
    Usage,
)
from .sse import SseReader, frame

_FINISH: dict[str, FinishReason] = {
    "end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
    "model_context_window_exceeded": "length", "tool_use": "tool_calls",
    "refusal": "content_filter", "pause_turn": "pause"}
_STOP_REASON: dict[FinishReason, str] = {
    "stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
    "content_filter": "refusal", "pause": "pause_turn"}
_STATUS_OF_TYPE = {
    "invalid_request_error": 400, "authentication_error": 401, "billing_error": 402,
    "permission_error": 403, "not_found_error": 404, "conflict_error": 409,
    "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
    "timeout_error": 504, "overloaded_error": 529}
_SPEC_TYPES = frozenset(_STATUS_OF_TYPE) - {"conflict_error", "request_too_large"}
_TYPE_OF_STATUS = {status: kind for kind, status in _STATUS_OF_TYPE.items()
                   if kind in _SPEC_TYPES} | {503: "overloaded_error"}
_MALFORMED = (AttributeError, KeyError, TypeError, ValueError)  # JSON not of the shape read
_TEXT, _THINKING = -1, -2  # a block's kind where a tool call's number would be


def decode_error(status: int, body: bytes) -> Error:
    """An upstream's error answer; a body not in Anthropic's shape becomes the message."""
    try:
        return _error(orjson.loads(body)["error"], status)
    except (*_MALFORMED, orjson.JSONDecodeError):
        return Error(status, body[:1000].decode(errors="replace") or f"HTTP {status}")


def encode_error(error: Error, request_id: str | None = None) -> bytes:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}, …}``."""
    return orjson.dumps({"type": "error", "error": _error_fields(error),
                         "request_id": request_id})


def decode_answer(body: bytes) -> list[Event]:
    """A whole ``message``; raises UpstreamBadResponse if it is not one."""
    try:
        answer = orjson.loads(body)
        events: list[Event] = [Start(str(answer["id"]), str(answer["model"]))]
        calls = 0
        for block in answer["content"]:
            kind = block["type"]
            if kind == "text" and block["text"]:
                events.append(TextDelta(block["text"]))
            elif kind == "tool_use":
                events.append(ToolCallStart(calls, block["id"], block["name"]))
                events.append(ToolArgsDelta(calls, orjson.dumps(block["input"]).decode()))
                calls += 1
            elif kind == "thinking":
                events.append(ThinkingDelta(block["thinking"], block.get("signature") or ""))
        if answer.get("stop_reason"):
            events.append(_finish(answer))
        events.append(_usage(answer.get("usage") or {}, {}))
    except (*_MALFORMED, orjson.JSONDecodeError) as exc:
        raise UpstreamBadResponse(
            f"the upstream's answer is not a message: {exc!r}") from None
    events.append(End())
    return events


def encode_answer(events: Iterable[Event], *, input_tokens: int = 0) -> bytes:
    """A whole ``message`` from an answer's events (``input_tokens``: the estimate, if no
    ``Usage`` comes); raises UpstreamBadResponse for tool arguments that are no object."""
    start, finish, usage = Start("", ""), Finish("stop"), Usage(input_tokens, 0)
    content: list[dict[str, Any]] = []
    args: dict[int, tuple[dict[str, Any], list[str]]] = {}
    for event in events:
        last = content[-1] if content else {}
        if isinstance(event, TextDelta):
            if last.get("type") == "text":
                last["text"] += event.text
            else:
                content.append({"type": "text", "text": event.text, "citations": None})
        elif isinstance(event, ToolArgsDelta) and event.index in args:
            args[event.index][1].append(event.fragment)
        elif isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {},
                     "caller": {"type": "direct"}}
            content.append(block)
            args[event.index] = (block, [])
        elif isinstance(event, ThinkingDelta):
            if last.get("type") == "thinking":
                last["thinking"] += event.text
                last["signature"] += event.signature
            else:
                content.append({"type": "thinking", "thinking": event.text,
                                "signature": event.signature})
        elif isinstance(event, Start):
            start = event
        elif isinstance(event, Finish):
            finish = event
        elif isinstance(event, Usage):
            usage = event
        elif isinstance(event, Error):
            raise ValueError("an Error is no answer: encode it with encode_error")
    for block, fragments in args.values():
        block["input"] = _arguments("".join(fragments))
    return orjson.dumps({
        "id": start.id, "type": "message", "role": "assistant", "content": content,
        "model": start.model, **_stop_fields(finish), "container": None,
        "usage": _usage_fields(usage) | {"cache_creation": None, "inference_geo": None,
                                         "service_tier": None}})


class MessagesStreamDecoder:
    """An upstream's SSE bytes, in chunks split anywhere, → events as they complete."""

    def __init__(self) -> None:
        self._sse = SseReader()
        self._blocks: dict[int, int] = {}  # block index → tool call number, _TEXT, _THINKING
        self._calls = 0
        self._started: dict[str, Any] = {}  # message_start's usage
        self._over = False  # End or Error given: the rest is not read

    def feed(self, chunk: bytes) -> list[Event]:
        if self._over:
            return []
        try:
            frames = self._sse.feed(chunk)
        except UpstreamBadResponse as exc:
            return self._fail(exc.message)
        events: list[Event] = []
        for _, data in frames:
            self._read(data, events)
            if self._over:
                break
        return events

    def close(self) -> list[Event]:
        """At the end of the upstream's bytes: an ``Error`` unless ``message_stop`` came."""
        events: list[Event] = []
        for _, data in self._sse.close():
            if not self._over:
                self._read(data, events)
        if not self._over:
            events += self._fail("the upstream's stream ended before message_stop")
        return events

    def _fail(self, message: str) -> list[Event]:
        self._over = True
        return [Error(502, message, "api_error")]

    def _read(self, data: bytes, events: list[Event]) -> None:
        try:
            event = orjson.loads(data)
            kind = event["type"]
            if kind == "content_block_delta":
                self._delta(self._blocks.get(event["index"]), event["delta"], events)
            elif kind == "content_block_start":
                self._block(event["index"], event["content_block"], events)
            elif kind == "message_start":
                message = event["message"]
                self._started = message.get("usage") or {}
                events.append(Start(str(message["id"]), str(message["model"])))
            elif kind == "message_delta":
                if event["delta"].get("stop_reason"):
                    events.append(_finish(event["delta"]))
                events.append(_usage(event.get("usage") or {}, self._started))
            elif kind == "message_stop":
                events.append(End())
                self._over = True
            elif kind == "error":
                events.append(_error(event["error"], None))
                self._over = True
        except (*_MALFORMED, orjson.JSONDecodeError) as exc:
            events += self._fail(f"the upstream sent an event that is not one: {exc!r}")

    def _block(self, index: int, block: dict[str, Any], events: list[Event]) -> None:
        kind = block["type"]
        if kind == "text":
            self._blocks[index] = _TEXT
            if block.get("text"):
                events.append(TextDelta(block["text"]))
        elif kind == "tool_use":
            self._blocks[index] = number = self._calls
            self._calls += 1
            events.append(ToolCallStart(number, block["id"], block["name"]))
            if block.get("input"):
                events.append(ToolArgsDelta(number, orjson.dumps(block["input"]).decode()))
        elif kind == "thinking":
            self._blocks[index] = _THINKING
            if block.get("thinking") or block.get("signature"):
                events.append(ThinkingDelta(block.get("thinking") or "",
                                            block.get("signature") or ""))

    def _delta(self, block: int | None, delta: dict[str, Any], events: list[Event]) -> None:
        kind = delta["type"]
        if kind == "text_delta" and block == _TEXT:
            if delta["text"]:
                events.append(TextDelta(delta["text"]))
        elif kind == "input_json_delta" and block is not None and block >= 0:
            if delta["partial_json"]:
                events.append(ToolArgsDelta(block, delta["partial_json"]))
        elif kind == "thinking_delta" and block == _THINKING:
            events.append(ThinkingDelta(delta["thinking"]))
        elif kind == "signature_delta" and block == _THINKING:
            events.append(ThinkingDelta("", delta["signature"]))


class MessagesStreamEncoder:
    """Events → the SSE bytes an Anthropic SDK reads, one block open at a time."""

    def __init__(self, *, input_tokens: int = 0, request_id: str | None = None) -> None:
        """``input_tokens``: the request's estimate, for ``message_start`` (corrected at
        the end by the upstream's count)."""
        self._input_tokens = input_tokens
        self._request_id = request_id
        self._blocks = 0  # blocks opened
        self._open: int | None = None  # the open block: _TEXT, _THINKING, a tool call's number
        self._tools: dict[int, bytes] = {}  # tool call number → its deltas' head
        self._finish = Finish("stop")
        self._usage: Usage | None = None
        self._over = False

    def encode(self, event: Event) -> bytes:
        if self._over:
            return b""
        if isinstance(event, TextDelta):
            return self._into(_TEXT, b'{"type":"text","text":"","citations":null}') + (
                self._delta_head + b'{"type":"text_delta","text":'
                + orjson.dumps(event.text) + b"}}\n\n")
        if isinstance(event, ToolArgsDelta):
            head = self._tools.get(event.index)
            if head is None:
                return b""
            return (head + b'{"type":"input_json_delta","partial_json":'
                    + orjson.dumps(event.fragment) + b"}}\n\n")
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": {},
                     "caller": {"type": "direct"}}
            opened = self._into(event.index, orjson.dumps(block))
            self._tools[event.index] = self._delta_head
            return opened
        if isinstance(event, ThinkingDelta):
            out = self._into(_THINKING, b'{"type":"thinking","thinking":"","signature":""}')
            for key, text in ((b"thinking", event.text), (b"signature", event.signature)):
                if text:
                    out += (self._delta_head + b'{"type":"' + key + b'_delta","' + key
                            + b'":' + orjson.dumps(text) + b"}}\n\n")
            return out
        if isinstance(event, Start):
            return frame(orjson.dumps({"type": "message_start", "message": {
                "id": event.id, "type": "message", "role": "assistant", "content": [],
                "model": event.model, "stop_reason": None, "stop_sequence": None,
                "stop_details": None, "container": None,
                "usage": _usage_fields(Usage(self._input_tokens, 0)) | {
                    "cache_creation": None, "inference_geo": None, "service_tier": None}}}),
                b"message_start")
        if isinstance(event, Finish):
            self._finish = event
        elif isinstance(event, Usage):
            self._usage = event
        elif isinstance(event, End):
            self._over = True
            usage = _usage_fields(self._usage or Usage(self._input_tokens, 0))
            delta = {"type": "message_delta", "delta": _stop_fields(self._finish) | {
                "container": None}, "usage": usage}
            return (self._close() + frame(orjson.dumps(delta), b"message_delta")
                    + frame(b'{"type":"message_stop"}', b"message_stop"))
        elif isinstance(event, Error):
            self._over = True
            return frame(encode_error(event, self._request_id), b"error")
        return b""

    @property
    def _delta_head(self) -> bytes:
        return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                + str(self._blocks - 1).encode() + b',"delta":')

    def _into(self, kind: int, block: bytes) -> bytes:
        """Opens a block of ``kind`` unless it is the one open, closing that one."""
        if self._open == kind:
            return b""
        closed = self._close()
        self._open = kind
        self._blocks += 1
        return closed + (b'event: content_block_start\ndata: {"type":"content_block_start",'
                         b'"index":' + str(self._blocks - 1).encode()
                         + b',"content_block":' + block + b"}\n\n")

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return frame(b'{"type":"content_block_stop","index":' + str(self._blocks - 1).encode()
                     + b"}", b"content_block_stop")


def _finish(fields: dict[str, Any]) -> Finish:
    reason = fields["stop_reason"]
    sequence = fields.get("stop_sequence") if reason == "stop_sequence" else None
    return Finish(_FINISH.get(reason, "stop"), sequence)


def _stop_fields(finish: Finish) -> dict[str, Any]:
    reason = _STOP_REASON[finish.reason]
    if finish.stop_sequence is not None and finish.reason == "stop":
        reason = "stop_sequence"
    return {"stop_reason": reason, "stop_sequence": finish.stop_sequence,
            "stop_details": None}


def _usage(usage: dict[str, Any], started: dict[str, Any]) -> Usage:
    def count(name: str) -> int:
        found = usage.get(name)
        return int(found if found is not None else started.get(name) or 0)

    read, written = count("cache_read_input_tokens"), count("cache_creation_input_tokens")
    return Usage(count("input_tokens") + read + written, count("output_tokens"), read, written)


def _usage_fields(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": max(0, usage.input - usage.cache_read - usage.cache_write),
            "cache_creation_input_tokens": usage.cache_write,
            "cache_read_input_tokens": usage.cache_read, "output_tokens": usage.output,
            "output_tokens_details": None, "server_tool_use": None}


def _arguments(joined: str) -> dict[str, Any]:
    try:
        found = orjson.loads(joined or "{}")
    except orjson.JSONDecodeError:
        found = None
    if not isinstance(found, dict):
        raise UpstreamBadResponse("the upstream's tool call arguments are not a JSON object")
    return found


def _error(error: Any, status: int | None) -> Error:
    if not isinstance(error, dict):
        return Error(status or 500, str(error))
    kind = error.get("type")
    if not isinstance(kind, str):
        kind = None
    if status is None:
        status = _STATUS_OF_TYPE.get(kind or "", 500)
    return Error(status, str(error.get("message") or f"HTTP {status}"), kind)


def _error_fields(error: Error) -> dict[str, str]:
    kind = error.code if error.code in _SPEC_TYPES else _TYPE_OF_STATUS.get(error.status)
    if kind is None:
        kind = "invalid_request_error" if error.status < 500 else "api_error"
    return {"type": kind, "message": error.message}
