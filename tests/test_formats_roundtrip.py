"""Properties of both answer formats over generated answers: decode(encode(events)) is the
events, any chunking and line ending of a stream decodes alike, any bytes decode to events
that end once, and whatever either encoder writes (for answers of either format: that is
a translation) is valid by its owner's spec."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.formats import chat, messages
from proxy.core.formats.events import (
    End,
    Error,
    Event,
    Finish,
    Start,
    TextDelta,
    ThinkingDelta,
    ToolArgsDelta,
    ToolCallStart,
    Usage,
)
from proxy.core.formats.sse import SseReader

from .vendor_specs import problems

Format = Literal["chat", "messages"]
FORMATS: tuple[Format, ...] = ("chat", "messages")
PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(min_size=1, max_size=20)
NAME = st.from_regex(r"[a-zA-Z0-9_-]{1,16}", fullmatch=True)
COUNT = st.integers(0, 200_000)
# Statuses each format's error types name one by one (the others map onto these).
STATUSES: dict[Format, list[int]] = {
    "chat": [400, 429, 500], "messages": [400, 401, 402, 403, 404, 429, 500, 504, 529]}
KINDS = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
         403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
         500: "api_error", 504: "timeout_error", 529: "overloaded_error"}


@st.composite
def fragments(draw: st.DrawFn) -> list[str]:
    """A JSON object's text cut anywhere, as tool call arguments arrive."""
    text = orjson.dumps(draw(st.dictionaries(NAME, st.integers(-99, 99) | TEXT, max_size=3)))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=3)))
    edges = [0, *cuts, len(text)]
    pieces = [text[a:b].decode("utf-8", "ignore") for a, b in itertools.pairwise(edges)]
    # Cutting inside a multi-byte character loses it: cut between characters instead.
    return [p for p in pieces if p] if "".join(pieces) == text.decode() else [text.decode()]


@st.composite
def answers(draw: st.DrawFn, form: Format, errors: bool = True) -> list[Event]:
    """An answer as ``form``'s decoder gives it: what that format can say, in its order."""
    events: list[Event] = [Start(draw(NAME), draw(NAME))]
    calls = 0
    kinds = ["text", "tool"] + (["thinking"] if form == "messages" else [])
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=5)):
        if kind == "text":
            events += [TextDelta(t) for t in draw(st.lists(TEXT, min_size=1, max_size=3))]
        elif kind == "tool":
            events.append(ToolCallStart(calls, draw(NAME), draw(NAME)))
            events += [ToolArgsDelta(calls, piece) for piece in draw(fragments())]
            calls += 1
        else:
            events += draw(st.lists(st.builds(ThinkingDelta, TEXT) | st.builds(
                lambda s: ThinkingDelta("", s), TEXT), min_size=1, max_size=2))
    if errors and draw(st.integers(0, 4)) == 0:
        status = draw(st.sampled_from(STATUSES[form]))
        if form == "chat":
            return [*events, Error(status, draw(TEXT), draw(st.none() | NAME),
                                   draw(st.none() | NAME))]
        return [*events, Error(status, draw(TEXT), KINDS[status])]
    reasons = ["stop", "length", "tool_calls", "content_filter"]
    reason = draw(st.sampled_from([*reasons, "pause"] if form == "messages" else reasons))
    sequence = draw(st.none() | TEXT) if form == "messages" and reason == "stop" else None
    read, written = draw(COUNT), draw(COUNT) if form == "messages" else 0
    usage = Usage(read + written + draw(COUNT), draw(COUNT), read, written)
    return [*events, Finish(reason, sequence), usage, End()]  # type: ignore[arg-type]


def encode_stream(form: Format, events: list[Event]) -> bytes:
    encoder: chat.ChatStreamEncoder | messages.MessagesStreamEncoder = (
        chat.ChatStreamEncoder(created=1700000000, include_usage=True) if form == "chat"
        else messages.MessagesStreamEncoder(input_tokens=7, request_id="req_1"))
    return b"".join(encoder.encode(event) for event in events)


def decode_stream(form: Format, chunks: list[bytes]) -> list[Event]:
    decoder = chat.ChatStreamDecoder() if form == "chat" else messages.MessagesStreamDecoder()
    return [event for chunk in chunks for event in decoder.feed(chunk)] + decoder.close()


@PROPERTY
@given(st.sampled_from(FORMATS).flatmap(
    lambda form: st.tuples(st.just(form), answers(form))))
def test_a_stream_decodes_to_the_events_it_was_encoded_from(
        drawn: tuple[Format, list[Event]]) -> None:
    form, events = drawn
    assert decode_stream(form, [encode_stream(form, events)]) == events


def chunked(stream: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(min(cut, len(stream)) for cut in cuts), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges)]


@PROPERTY
@given(st.sampled_from(FORMATS).flatmap(
    lambda form: st.tuples(st.just(form), answers(form))),
    st.lists(st.integers(0, 5000), max_size=20), st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.booleans())
def test_any_chunking_and_line_ending_decodes_alike(
        drawn: tuple[Format, list[Event]], cuts: list[int], line_end: bytes,
        spaceless: bool) -> None:
    form, events = drawn
    stream = encode_stream(form, events)
    if spaceless:  # "data:x" is "data: x" (JSON strings hold no raw line feed)
        stream = (b"\n" + stream).replace(b"\ndata: ", b"\ndata:")[1:]
    stream = stream.replace(b"\n", line_end)
    assert decode_stream(form, chunked(stream, cuts)) == events


@PROPERTY
@given(st.sampled_from(FORMATS), st.lists(st.binary(max_size=40) | st.sampled_from(
    [b"data: [DONE]\n\n", b'data: {"type":"message_stop"}\n\n', b"\n\n", b"data: {",
     b'event: error\ndata: {"type":"error","error":{"type":"api_error"}}\n\n']), max_size=8))
def test_any_bytes_decode_to_events_that_end_once(form: Format, chunks: list[bytes]) -> None:
    events = decode_stream(form, chunks)
    assert events and isinstance(events[-1], End | Error)
    assert sum(isinstance(event, End | Error) for event in events) == 1


def whole(form: Format, events: list[Event]) -> list[Event]:
    """The events of ``events``' answer as a whole JSON answer decodes: one delta a block
    (Chat: all text in one, before the calls; arguments re-serialized by Anthropic's)."""
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolArgsDelta):
            arguments[event.index] = arguments.get(event.index, "") + event.fragment
    if form == "chat":
        rest = [e for e in events if not isinstance(e, TextDelta | ToolArgsDelta)]
        out: list[Event] = [rest[0], *([TextDelta(text)] if text else [])]
        for event in rest[1:]:
            out.append(event)
            if isinstance(event, ToolCallStart):
                out.append(ToolArgsDelta(event.index, arguments.get(event.index, "") or "{}"))
        return out
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(last.text + event.text)
        elif isinstance(event, ThinkingDelta) and isinstance(last, ThinkingDelta):
            merged[-1] = ThinkingDelta(last.text + event.text, last.signature + event.signature)
        elif isinstance(event, ToolCallStart):
            json = orjson.dumps(orjson.loads(arguments.get(event.index) or "{}")).decode()
            merged += [event, ToolArgsDelta(event.index, json)]
        elif not isinstance(event, ToolArgsDelta):
            merged.append(event)
    return merged


@PROPERTY
@given(st.sampled_from(FORMATS).flatmap(
    lambda form: st.tuples(st.just(form), answers(form, errors=False))))
def test_a_whole_answer_decodes_to_the_events_it_was_encoded_from(
        drawn: tuple[Format, list[Event]]) -> None:
    form, events = drawn
    if form == "chat":
        decoded = chat.decode_answer(chat.encode_answer(events, created=1700000000))
    else:
        decoded = messages.decode_answer(messages.encode_answer(events))
    assert decoded == whole(form, events)


def frames(stream: bytes) -> list[tuple[bytes, Any]]:
    reader = SseReader()
    return [(name, data if data == b"[DONE]" else orjson.loads(data))
            for name, data in reader.feed(stream) + reader.close()]


ANY_ANSWER = st.sampled_from(FORMATS).flatmap(lambda form: answers(form))


@PROPERTY
@given(ANY_ANSWER)
def test_what_the_chat_encoders_write_is_valid_by_openais_spec(events: list[Event]) -> None:
    written = frames(encode_stream("chat", events))
    assert (written[-1][1] == b"[DONE]") is isinstance(events[-1], End)
    for _, chunk in written:
        if chunk != b"[DONE]":
            schema = "ErrorResponse" if "error" in chunk else "CreateChatCompletionStreamResponse"
            assert problems("openai", schema, chunk) == []
    if isinstance(events[-1], End):
        answer = orjson.loads(chat.encode_answer(events, created=1700000000))
        assert problems("openai", "CreateChatCompletionResponse", answer) == []


@PROPERTY
@given(ANY_ANSWER)
def test_what_the_messages_encoders_write_is_valid_by_anthropics_spec(events: list[Event]) -> None:
    for name, event in frames(encode_stream("messages", events)):
        assert name.decode() == event["type"]
        schema = "ErrorResponse" if name == b"error" else "MessageStreamEvent"
        assert problems("anthropic", schema, event) == []
    if isinstance(events[-1], End):
        answer = orjson.loads(messages.encode_answer(events))
        assert problems("anthropic", "Message", answer) == []


TRANSLATE: dict[Format, Callable[[bytes], list[Event]]] = {
    "chat": lambda s: decode_stream("chat", [s]),
    "messages": lambda s: decode_stream("messages", [s])}


@PROPERTY
@given(answers("messages"))
def test_an_anthropic_stream_reaches_an_openai_client_with_its_text_calls_and_usage(
        events: list[Event]) -> None:
    upstream = encode_stream("messages", events)
    client = TRANSLATE["chat"](encode_stream("chat", TRANSLATE["messages"](upstream)))
    kept = (TextDelta, ToolCallStart, Usage)
    # Chat has no field for tokens written to a cache: the total keeps them, the split not.
    assert [e for e in client if isinstance(e, kept)] == [
        replace(e, cache_write=0) if isinstance(e, Usage) else e
        for e in events if isinstance(e, kept)]
    assert "".join(e.fragment for e in client if isinstance(e, ToolArgsDelta)) == "".join(
        e.fragment for e in events if isinstance(e, ToolArgsDelta))
    assert type(client[-1]) is type(events[-1])
