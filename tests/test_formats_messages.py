"""Anthropic Messages answers ↔ events: the docs' own payloads decoded, and what the
encoders write checked against Anthropic's spec, event by event, and read by the official
SDK (in process, through the mock transport of httpx2, the SDK's HTTP client: no socket)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx2
import orjson
import pytest

from proxy.core.errors import InvalidApiKey, QueueFull, UpstreamBadResponse
from proxy.core.formats import messages
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
    error_of,
)
from proxy.core.formats.sse import SseReader

from .vendor_specs import problems


def sse(*events: str) -> bytes:
    return b"".join(
        f"event: {orjson.loads(data)['type']}\ndata: {data}\n\n".encode() for data in events)


# https://docs.claude.com/en/docs/build-with-claude/streaming: "Basic streaming request".
DOC_BASIC = sse(
    '{"type": "message_start", "message": {"id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", '
    '"type": "message", "role": "assistant", "content": [], "model": "claude-opus-4-6", '
    '"stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 25, '
    '"output_tokens": 1}}}',
    '{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}',
    '{"type": "ping"}',
    '{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", '
    '"text": "Hello"}}',
    '{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}}',
    '{"type": "content_block_stop", "index": 0}',
    '{"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence":null}, '
    '"usage": {"output_tokens": 15}}',
    '{"type": "message_stop"}')
# The same page: "Streaming request with tool use" (some text deltas left out).
DOC_TOOL = sse(
    '{"type":"message_start","message":{"id":"msg_014p7gG3wDgGV9EUtLvnow3U","type":"message",'
    '"role":"assistant","model":"claude-opus-4-6","stop_sequence":null,"usage":{'
    '"input_tokens":472,"output_tokens":2},"content":[],"stop_reason":null}}',
    '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}',
    '{"type": "ping"}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Okay"}}',
    '{"type":"content_block_stop","index":0}',
    '{"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
    '"id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{}}}',
    '{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":""}}',
    '{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":"{\\"location\\":"}}',
    '{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
    '"partial_json":" \\"San Francisco, CA\\"}"}}',
    '{"type":"content_block_stop","index":1}',
    '{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
    '"usage":{"output_tokens":89}}',
    '{"type":"message_stop"}')
# The same page: "Streaming request with extended thinking" (shortened), with the usage of
# a prompt read from the cache (https://docs.claude.com/en/docs/build-with-claude/prompt-caching:
# "total input tokens = cache_read_input_tokens + cache_creation_input_tokens + input_tokens").
DOC_THINKING = sse(
    '{"type": "message_start", "message": {"id": "msg_01", "type": "message", '
    '"role": "assistant", "content": [], "model": "claude-opus-4-6", "stop_reason": null, '
    '"stop_sequence": null, "usage": {"input_tokens": 21, "cache_creation_input_tokens": 188, '
    '"cache_read_input_tokens": 1000, "output_tokens": 1}}}',
    '{"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", '
    '"thinking": ""}}',
    '{"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", '
    '"thinking": "1071 = 2 \u00d7 462 + 147"}}',
    '{"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", '
    '"signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"}}',
    '{"type": "content_block_stop", "index": 0}',
    '{"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}',
    '{"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", '
    '"text": "The GCD is **21**."}}',
    '{"type": "content_block_stop", "index": 1}',
    '{"type": "message_delta", "delta": {"stop_reason": "stop_sequence", '
    '"stop_sequence": "###"}, "usage": {"output_tokens": 30}}',
    '{"type": "message_stop"}')
# The same page: "Error events".
DOC_ERROR = sse('{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}')

DECODED = [
    (DOC_BASIC, [Start("msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "claude-opus-4-6"),
                 TextDelta("Hello"), TextDelta("!"), Finish("stop"), Usage(25, 15), End()]),
    (DOC_TOOL, [Start("msg_014p7gG3wDgGV9EUtLvnow3U", "claude-opus-4-6"), TextDelta("Okay"),
                ToolCallStart(0, "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "get_weather"),
                ToolArgsDelta(0, '{"location":'), ToolArgsDelta(0, ' "San Francisco, CA"}'),
                Finish("tool_calls"), Usage(472, 89), End()]),
    (DOC_THINKING, [Start("msg_01", "claude-opus-4-6"),
                    ThinkingDelta("1071 = 2 \u00d7 462 + 147"),
                    ThinkingDelta("", "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"),
                    TextDelta("The GCD is **21**."), Finish("stop", "###"),
                    Usage(1209, 30, cache_read=1000, cache_write=188), End()]),
    (DOC_ERROR, [Error(529, "Overloaded", "overloaded_error")]),
    (DOC_BASIC[:DOC_BASIC.index(b"event: message_delta")],
     [Start("msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "claude-opus-4-6"), TextDelta("Hello"),
      TextDelta("!"), Error(502, "the upstream's stream ended before message_stop", "api_error")]),
]


def decode(stream: bytes) -> list[Event]:
    decoder = messages.MessagesStreamDecoder()
    return decoder.feed(stream) + decoder.close()


@pytest.mark.parametrize(("stream", "events"), DECODED,
                         ids=["basic", "tool", "thinking", "error", "cut"])
def test_streams_decode_to_their_events(stream: bytes, events: list[Event]) -> None:
    assert decode(stream) == events


def test_unknown_events_and_blocks_are_read_past() -> None:
    # Anthropic's versioning policy: new event types may come; server tools' blocks too.
    stream = DOC_BASIC.replace(b"event: ping", b"event: brand_new", 1).replace(
        b'{"type": "ping"}', b'{"type": "brand_new"}') + b""
    assert decode(stream) == DECODED[0][1]
    assert decode(sse(
        '{"type":"message_start","message":{"id":"m","model":"c","usage":{}}}',
        '{"type":"content_block_start","index":0,"content_block":{"type":"server_tool_use",'
        '"id":"srvtoolu_1","name":"web_search","input":{}}}',
        '{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta",'
        '"partial_json":"{}"}}',
        '{"type":"message_delta","delta":{"stop_reason":"pause_turn"},"usage":'
        '{"output_tokens":3}}',
        '{"type":"message_stop"}')) == [Start("m", "c"), Finish("pause"), Usage(0, 3), End()]


# https://docs.claude.com/en/api/messages (the response example) and
# https://docs.claude.com/en/docs/agents-and-tools/tool-use/implement-tool-use (a tool call).
DOC_ANSWER = b"""{"content": [{"text": "Hi! My name is Claude.", "type": "text"}],
  "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "model": "claude-opus-4-6", "role": "assistant",
  "stop_reason": "end_turn", "stop_sequence": null, "type": "message",
  "usage": {"input_tokens": 2095, "output_tokens": 503}}"""
DOC_TOOL_ANSWER = b"""{"id": "msg_01Aq9w938a90dw8q", "model": "claude-opus-4-6",
  "stop_reason": "tool_use", "role": "assistant", "content": [
  {"type": "text", "text": "I'll check the current weather in San Francisco for you."},
  {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
   "input": {"location": "San Francisco, CA", "unit": "celsius"}}],
  "usage": {"input_tokens": 21, "cache_creation_input_tokens": 188086,
            "cache_read_input_tokens": 0, "output_tokens": 393}}"""


def test_whole_answers_decode_to_the_same_events() -> None:
    assert messages.decode_answer(DOC_ANSWER) == [
        Start("msg_013Zva2CMHLNnXjNJJKqJ2EF", "claude-opus-4-6"),
        TextDelta("Hi! My name is Claude."), Finish("stop"), Usage(2095, 503), End()]
    assert messages.decode_answer(DOC_TOOL_ANSWER) == [
        Start("msg_01Aq9w938a90dw8q", "claude-opus-4-6"),
        TextDelta("I'll check the current weather in San Francisco for you."),
        ToolCallStart(0, "toolu_01A09q90qw90lq917835lq9", "get_weather"),
        ToolArgsDelta(0, '{"location":"San Francisco, CA","unit":"celsius"}'),
        Finish("tool_calls"), Usage(188107, 393, cache_write=188086), End()]
    with pytest.raises(UpstreamBadResponse):
        messages.decode_answer(b'{"type": "message"}')


@pytest.mark.parametrize(("error", "kind"), [
    (Error(529, "Overloaded"), "overloaded_error"),
    (error_of(QueueFull("The queue is full")), "overloaded_error"),
    (Error(429, "slow down", "rate_limit_exceeded"), "rate_limit_error"),
    (Error(400, "bad"), "invalid_request_error"),
    (Error(413, "too big"), "invalid_request_error"),
    (error_of(InvalidApiKey("who?")), "authentication_error"),
    (Error(403, "no"), "permission_error"),
    (Error(404, "gone"), "not_found_error"),
    (Error(402, "pay"), "billing_error"),
    (Error(500, "oops"), "api_error"),
    (Error(502, "upstream"), "api_error"),
    (Error(504, "late"), "timeout_error"),
    (Error(500, "kept", "overloaded_error"), "overloaded_error"),
])
def test_errors_are_written_in_anthropics_types(error: Error, kind: str) -> None:
    written = orjson.loads(messages.encode_error(error, "req_011"))
    assert written == {"type": "error", "error": {"type": kind, "message": error.message},
                       "request_id": "req_011"}
    assert problems("anthropic", "ErrorResponse", written) == []


def test_error_bodies_are_read() -> None:
    # https://docs.claude.com/en/api/errors: the error shape.
    body = (b'{"type":"error","error":{"type":"not_found_error","message":"The requested '
            b'resource could not be found."},"request_id":"req_011CSHoEeqs5C35K2UUqR7Fy"}')
    assert messages.decode_error(404, body) == Error(
        404, "The requested resource could not be found.", "not_found_error")
    assert messages.decode_error(503, b"upstream connect error") == Error(
        503, "upstream connect error")


ANSWER: list[Event] = [
    Start("chatcmpl-9", "gpt-4o"), TextDelta("Let me "), TextDelta("look."),
    ToolCallStart(0, "call_1", "get_weather"), ToolArgsDelta(0, '{"city":'),
    ToolCallStart(1, "call_2", "get_time"), ToolArgsDelta(0, ' "Paris"}'),
    ToolArgsDelta(1, "{}"), ThinkingDelta("so"), ThinkingDelta("", "sig"),
    Finish("tool_calls"), Usage(1117, 46, cache_read=1024), End()]


def events_written(stream: bytes) -> list[tuple[bytes, dict[str, object]]]:
    reader = SseReader()
    return [(name, orjson.loads(data)) for name, data in reader.feed(stream) + reader.close()]


def test_the_stream_written_is_anthropics() -> None:
    encoder = messages.MessagesStreamEncoder(input_tokens=1100)
    written = events_written(b"".join(encoder.encode(event) for event in ANSWER))
    for name, event in written:
        assert name.decode() == event["type"]  # the SDKs dispatch on the event's name
        assert problems("anthropic", "MessageStreamEvent", event) == []
    assert [name for name, _ in written] == [
        b"message_start", b"content_block_start", b"content_block_delta", b"content_block_delta",
        b"content_block_stop", b"content_block_start", b"content_block_delta",
        b"content_block_stop", b"content_block_start", b"content_block_delta",
        b"content_block_delta", b"content_block_stop", b"content_block_start",
        b"content_block_delta", b"content_block_delta", b"content_block_stop",
        b"message_delta", b"message_stop"]
    assert written[0][1]["message"]["usage"]["input_tokens"] == 1100  # type: ignore[index]
    # The late fragment of the first call still goes to its block (index 1), by index.
    assert (written[9][1]["index"], written[10][1]["index"]) == (1, 2)
    assert written[-2][1]["usage"] == {
        "input_tokens": 93, "cache_read_input_tokens": 1024, "cache_creation_input_tokens": 0,
        "output_tokens": 46, "output_tokens_details": None, "server_tool_use": None}


def test_an_error_ends_the_stream_without_a_finish() -> None:
    encoder = messages.MessagesStreamEncoder(request_id="req_1")
    written = events_written(b"".join(encoder.encode(event) for event in (
        Start("m", "x"), TextDelta("Hi"), Error(500, "upstream broke"), End())))
    assert written[-1] == (b"error", {"type": "error", "request_id": "req_1", "error": {
        "type": "api_error", "message": "upstream broke"}})
    assert problems("anthropic", "ErrorResponse", written[-1][1]) == []
    assert b"message_stop" not in [name for name, _ in written]


def test_the_answer_written_is_anthropics() -> None:
    answer = orjson.loads(messages.encode_answer(ANSWER))
    assert problems("anthropic", "Message", answer) == []
    assert [block["type"] for block in answer["content"]] == [
        "text", "tool_use", "tool_use", "thinking"]
    assert answer["content"][1]["input"] == {"city": "Paris"}
    assert (answer["stop_reason"], answer["usage"]["input_tokens"]) == ("tool_use", 93)
    with pytest.raises(UpstreamBadResponse):
        messages.encode_answer([Start("m", "x"), ToolCallStart(0, "c", "f"),
                                ToolArgsDelta(0, "[1]"), End()])


def sdk(answer: bytes, content_type: str) -> Iterator[anthropic.Anthropic]:
    def reply(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=answer, headers={"content-type": content_type})

    with httpx2.Client(transport=httpx2.MockTransport(reply)) as http:
        yield anthropic.Anthropic(api_key="k", base_url="http://proxy.invalid", http_client=http)


def test_the_anthropic_sdk_reads_the_stream_the_error_and_the_answer() -> None:
    encoder = messages.MessagesStreamEncoder(input_tokens=1100)
    for client in sdk(b"".join(encoder.encode(event) for event in ANSWER), "text/event-stream"):
        with client.messages.stream(model="m", max_tokens=9, messages=[]) as reading:
            final = reading.get_final_message()
        assert [block.type for block in final.content] == [
            "text", "tool_use", "tool_use", "thinking"]
        assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Paris"}
        assert (final.stop_reason, final.usage.output_tokens,
                final.usage.cache_read_input_tokens) == ("tool_use", 46, 1024)
    encoder = messages.MessagesStreamEncoder()
    broken = b"".join(encoder.encode(event) for event in (
        Start("m", "x"), TextDelta("Hi"), Error(529, "Overloaded", "overloaded_error")))
    for client in sdk(broken, "text/event-stream"):
        with (pytest.raises(anthropic.APIStatusError, match="Overloaded"),
              client.messages.stream(model="m", max_tokens=9, messages=[]) as reading):
            reading.get_final_message()
    for client in sdk(messages.encode_answer(ANSWER), "application/json"):
        answer = client.messages.create(model="m", max_tokens=9, messages=[])
        assert answer.content[0].type == "text" and answer.content[0].text == "Let me look."
