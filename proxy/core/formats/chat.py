"""OpenAI Chat Completions answers ↔ the neutral events (``proxy.core.formats.events``):
streams of ``chat.completion.chunk``, whole ``chat.completion`` answers, error bodies.

Read, per field:

- ``id``, ``model`` → ``Start``; the first choice's ``delta.content`` / ``message.content``
  and ``refusal`` → ``TextDelta``; ``tool_calls`` by ``index`` (``id`` and ``name`` on a
  call's first fragment) → ``ToolCallStart``, ``arguments`` → ``ToolArgsDelta``;
  ``finish_reason`` → ``Finish`` (``function_call`` as ``tool_calls``); ``usage`` →
  ``Usage`` (``prompt_tokens_details.cached_tokens`` as cache reads); ``data: [DONE]`` →
  ``End``; ``{"error": …}`` → ``Error``.
- Not read: other choices (``n`` > 1), ``logprobs``, ``annotations``, ``audio``,
  ``system_fingerprint``, ``service_tier``, reasoning fields outside OpenAI's spec.

Written: ``role`` and an empty ``content`` in the first chunk, one chunk per delta, a chunk
with ``finish_reason``, the usage chunk (``choices: []``) only when the client asked for
``stream_options.include_usage``, then ``data: [DONE]``; an ``Error`` is ``data: {"error":
…}`` and nothing after it, never a made-up finish. Not written: thinking (Chat has no
place for it), cache writes (no field), ``Finish.stop_sequence`` (no field); ``pause``
becomes ``stop`` and ``content_filter`` stays.
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
    ToolArgsDelta,
    ToolCallStart,
    Usage,
)
from .sse import SseReader

_FINISH: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls",
    "content_filter": "content_filter", "function_call": "tool_calls"}
_FINISH_OUT: dict[FinishReason, str] = {
    "stop": "stop", "length": "length", "tool_calls": "tool_calls",
    "content_filter": "content_filter", "pause": "stop"}
# The error types OpenAI's API and this proxy send, for an error that has no HTTP status
# (one in a stream); an unknown type is a server's.
_STATUS_OF_TYPE = {
    "invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
    "not_found_error": 404, "rate_limit_error": 429, "insufficient_quota": 429,
    "requests": 429, "tokens": 429, "server_error": 500}
_MALFORMED = (AttributeError, KeyError, TypeError, ValueError)  # JSON not of the shape read
DONE = b"data: [DONE]\n\n"


def decode_error(status: int, body: bytes) -> Error:
    """An upstream's error answer; a body not in OpenAI's shape becomes the message."""
    try:
        error = orjson.loads(body)["error"]
        return _error(error, status)
    except (*_MALFORMED, orjson.JSONDecodeError):
        return Error(status, body[:1000].decode(errors="replace") or f"HTTP {status}")


def encode_error(error: Error) -> bytes:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps({"error": _error_fields(error)})


def decode_answer(body: bytes) -> list[Event]:
    """A whole ``chat.completion``; raises UpstreamBadResponse if it is not one."""
    try:
        answer = orjson.loads(body)
        events: list[Event] = [Start(str(answer["id"]), str(answer["model"]))]
        choice = answer["choices"][0]
        message = choice["message"]
        for text in (message.get("content"), message.get("refusal")):
            if isinstance(text, str) and text:
                events.append(TextDelta(text))
        for index, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            events.append(ToolCallStart(index, call["id"], function["name"]))
            if function.get("arguments"):
                events.append(ToolArgsDelta(index, function["arguments"]))
        events.append(Finish(_FINISH.get(choice.get("finish_reason"), "stop")))
        if answer.get("usage"):
            events.append(_usage(answer["usage"]))
    except (*_MALFORMED, IndexError, orjson.JSONDecodeError) as exc:
        raise UpstreamBadResponse(
            f"the upstream's answer is not a chat completion: {exc!r}") from None
    events.append(End())
    return events


def encode_answer(events: Iterable[Event], *, created: int) -> bytes:
    """A whole ``chat.completion`` from an answer's events; ``created`` in epoch seconds."""
    start, reason, usage = Start("", ""), "stop", Usage(0, 0)
    text: list[str] = []
    calls: dict[int, tuple[str, str, list[str]]] = {}
    for event in events:
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = (event.id, event.name, [])
        elif isinstance(event, ToolArgsDelta) and event.index in calls:
            calls[event.index][2].append(event.fragment)
        elif isinstance(event, Start):
            start = event
        elif isinstance(event, Finish):
            reason = _FINISH_OUT[event.reason]
        elif isinstance(event, Usage):
            usage = event
        elif isinstance(event, Error):
            raise ValueError("an Error is no answer: encode it with encode_error")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = [
            {"id": id_, "type": "function",
             "function": {"name": name, "arguments": "".join(args) or "{}"}}
            for _, (id_, name, args) in sorted(calls.items())]
    return orjson.dumps({
        "id": start.id, "object": "chat.completion", "created": created, "model": start.model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        "usage": _usage_fields(usage)})


class ChatStreamDecoder:
    """An upstream's SSE bytes, in chunks split anywhere, → events as they complete."""

    def __init__(self) -> None:
        self._sse = SseReader()
        self._id = ""
        self._calls: set[int] = set()  # tool calls started
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
        """At the end of the upstream's bytes: an ``Error`` unless ``[DONE]`` came."""
        events: list[Event] = []
        for _, data in self._sse.close():
            if not self._over:
                self._read(data, events)
        if not self._over:
            events += self._fail("the upstream's stream ended before data: [DONE]")
        return events

    def _fail(self, message: str) -> list[Event]:
        self._over = True
        return [Error(502, message, "upstream_error")]

    def _read(self, data: bytes, events: list[Event]) -> None:
        if data == b"[DONE]":
            events.append(End())
            self._over = True
            return
        try:
            chunk = orjson.loads(data)
            if chunk.get("error") is not None:
                events.append(_error(chunk["error"], None))
                self._over = True
                return
            if not self._id:
                self._id = str(chunk.get("id") or "chatcmpl")
                events.append(Start(self._id, str(chunk.get("model") or "")))
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) == 0:
                    self._choice(choice, events)
            if chunk.get("usage"):
                events.append(_usage(chunk["usage"]))
        except (*_MALFORMED, orjson.JSONDecodeError) as exc:
            events += self._fail(f"the upstream sent a chunk that is not one: {exc!r}")

    def _choice(self, choice: dict[str, Any], events: list[Event]) -> None:
        delta = choice.get("delta") or {}
        for text in (delta.get("content"), delta.get("refusal")):
            if isinstance(text, str) and text:
                events.append(TextDelta(text))
        for position, call in enumerate(delta.get("tool_calls") or ()):
            index = call.get("index", position)
            function = call.get("function") or {}
            if index not in self._calls:
                self._calls.add(index)
                events.append(ToolCallStart(index, call.get("id") or f"{self._id}_{index}",
                                            function.get("name") or ""))
            if function.get("arguments"):
                events.append(ToolArgsDelta(index, function["arguments"]))
        if choice.get("finish_reason"):
            events.append(Finish(_FINISH.get(choice["finish_reason"], "stop")))


class ChatStreamEncoder:
    """Events → the SSE bytes an OpenAI SDK reads. Each chunk is the answer's fixed head
    and tail around the one delta serialized, never the answer so far."""

    def __init__(self, *, created: int, include_usage: bool) -> None:
        self._created = created
        self._include_usage = include_usage
        self._head = b""  # a chunk up to its delta, once Start is known
        self._usage: Usage | None = None
        self._bare: set[int] = set()  # tool calls started that no arguments followed yet
        self._over = False
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        self._tail = b',"logprobs":null,"finish_reason":null}]' + tail
        self._tail_usage = tail

    def encode(self, event: Event) -> bytes:
        if self._over:
            return b""
        if isinstance(event, TextDelta):
            return self._chunk(orjson.dumps({"content": event.text}))
        if isinstance(event, ToolArgsDelta):
            self._bare.discard(event.index)
            return self._arguments(event.index, event.fragment)
        if isinstance(event, ToolCallStart):
            self._bare.add(event.index)
            return self._chunk(orjson.dumps({"tool_calls": [{
                "index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}]}))
        if isinstance(event, Start):
            head = orjson.dumps({"id": event.id, "object": "chat.completion.chunk",
                                 "created": self._created, "model": event.model})
            self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":'
            return self._chunk(b'{"role":"assistant","content":""}')
        if isinstance(event, Finish):
            reason = _FINISH_OUT[event.reason].encode()
            return (self._fill() + self._head + b'{},"logprobs":null,"finish_reason":"' + reason
                    + b'"}]' + self._tail_usage)
        if isinstance(event, Usage):
            self._usage = event
        elif isinstance(event, End):
            self._over = True
            return self._fill() + self._usage_chunk() + DONE
        elif isinstance(event, Error):
            self._over = True
            return b"data: " + encode_error(event) + b"\n\n"
        return b""  # a ThinkingDelta too: Chat has no place for it

    def _chunk(self, delta: bytes) -> bytes:
        return self._head + delta + self._tail

    def _arguments(self, index: int, fragment: str) -> bytes:
        call = {"index": index, "function": {"arguments": fragment}}
        return self._chunk(orjson.dumps({"tool_calls": [call]}))

    def _fill(self) -> bytes:
        """``{}`` for the calls that got no arguments (a tool without parameters: Anthropic
        sends none), which a client would otherwise parse from an empty string."""
        filled = b"".join(self._arguments(index, "{}") for index in sorted(self._bare))
        self._bare.clear()
        return filled

    def _usage_chunk(self) -> bytes:
        if not (self._include_usage and self._head):
            return b""
        usage = orjson.dumps(_usage_fields(self._usage or Usage(0, 0)))
        return self._head[:-len(b'{"index":0,"delta":')] + b'],"usage":' + usage + b"}\n\n"


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0))


def _usage_fields(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.input, "completion_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
            "prompt_tokens_details": {"cached_tokens": usage.cache_read}}


def _error(error: Any, status: int | None) -> Error:
    if not isinstance(error, dict):  # some servers send {"error": "text"}
        return Error(status or 500, str(error))
    kind, code, param = error.get("type"), error.get("code"), error.get("param")
    if status is None:
        status = _STATUS_OF_TYPE.get(kind, 500) if isinstance(kind, str) else 500
    return Error(status, str(error.get("message") or f"HTTP {status}"),
                 code if isinstance(code, str) else None,
                 param if isinstance(param, str) else None)


def _error_fields(error: Error) -> dict[str, Any]:
    status = error.status
    kind = ("rate_limit_error" if status == 429 else "server_error" if status >= 500
            else "invalid_request_error")
    return {"message": error.message, "type": kind, "param": error.param, "code": error.code}
