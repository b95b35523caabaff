"""OpenAI Chat Completions answers ↔ events: the API reference's own payloads decoded, and
what the encoders write checked against OpenAI's spec and read by the official SDK (in
process, through the mock transport of httpx2, the SDK's HTTP client: no socket)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from proxy.core.errors import QueueFull, UpstreamBadResponse
from proxy.core.formats import chat
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

# https://platform.openai.com/docs/api-reference/chat/create, example "Streaming" (its
# "...." left out, its [DONE] put back).
DOC_STREAM = b"".join(b"data: " + line + b"\n\n" for line in (
    b'{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini", "system_fingerprint": "fp_44709d6fcb", "choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',  # noqa: E501
    b'{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini", "system_fingerprint": "fp_44709d6fcb", "choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}',  # noqa: E501
    b'{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini", "system_fingerprint": "fp_44709d6fcb", "choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}',  # noqa: E501
    b"[DONE]"))
# https://platform.openai.com/docs/guides/function-calling, "Streaming": the deltas its
# example prints, in chunks, and the usage chunk stream_options.include_usage adds
# (https://platform.openai.com/docs/api-reference/chat/create#stream_options).
_CALLS = (
    {"index": 0, "id": "call_DdmO9pD3xa9XTPNJ32zg2hcA",
     "function": {"arguments": "", "name": "get_weather"}, "type": "function"},
    {"index": 0, "id": None, "function": {"arguments": '{"', "name": None}, "type": None},
    {"index": 0, "id": None, "function": {"arguments": "location", "name": None}, "type": None},
    {"index": 0, "id": None, "function": {"arguments": '":"', "name": None}, "type": None},
    {"index": 0, "id": None, "function": {"arguments": "Paris", "name": None}, "type": None},
    {"index": 0, "id": None, "function": {"arguments": '"}', "name": None}, "type": None})
TOOL_STREAM = b"".join(
    b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in (
        *({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
           "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
          for call in _CALLS),
        {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
         "choices": [], "usage": {"prompt_tokens": 1117, "completion_tokens": 46,
                                  "total_tokens": 1163,
                                  "prompt_tokens_details": {"cached_tokens": 1024}}})) \
    + b"data: [DONE]\n\n"
# The API reference's examples "Default" and "Functions" (the chat completion object).
DOC_ANSWER = b"""{"id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "object": "chat.completion",
  "created": 1741569952, "model": "gpt-5.4", "choices": [{"index": 0, "message": {
  "role": "assistant", "content": "Hello! How can I assist you today?", "refusal": null,
  "annotations": []}, "logprobs": null, "finish_reason": "stop"}], "usage": {
  "prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29, "prompt_tokens_details": {
  "cached_tokens": 0, "audio_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0,
  "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
  "service_tier": "default"}"""
DOC_TOOL_ANSWER = b"""{"id": "chatcmpl-abc123", "object": "chat.completion",
  "created": 1699896916, "model": "gpt-4o-mini", "choices": [{"index": 0, "message": {
  "role": "assistant", "content": null, "tool_calls": [{"id": "call_abc123",
  "type": "function", "function": {"name": "get_current_weather",
  "arguments": "{\\n\\"location\\": \\"Boston, MA\\"\\n}"}}]}, "logprobs": null,
  "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 82, "completion_tokens": 17,
  "total_tokens": 99}}"""

DECODED = [
    (DOC_STREAM, [Start("chatcmpl-123", "gpt-4o-mini"), TextDelta("Hello"), Finish("stop"),
                  End()]),
    (TOOL_STREAM, [Start("chatcmpl-9", "gpt-4o"),
                   ToolCallStart(0, "call_DdmO9pD3xa9XTPNJ32zg2hcA", "get_weather"),
                   ToolArgsDelta(0, '{"'), ToolArgsDelta(0, "location"), ToolArgsDelta(0, '":"'),
                   ToolArgsDelta(0, "Paris"), ToolArgsDelta(0, '"}'), Finish("tool_calls"),
                   Usage(1117, 46, cache_read=1024), End()]),
    # Errors: OpenAI's in a stream (https://platform.openai.com/docs/guides/error-codes),
    # a stream cut short, a chunk that is not JSON.
    (b'data: {"error": {"message": "Rate limit reached", "type": "requests", "param": null, '
     b'"code": "rate_limit_exceeded"}}\n\n',
     [Error(429, "Rate limit reached", "rate_limit_exceeded")]),
    (DOC_STREAM[:-len(b"data: [DONE]\n\n")],
     [Start("chatcmpl-123", "gpt-4o-mini"), TextDelta("Hello"), Finish("stop"),
      Error(502, "the upstream's stream ended before data: [DONE]", "upstream_error")]),
]


def decode(stream: bytes) -> list[Event]:
    decoder = chat.ChatStreamDecoder()
    return decoder.feed(stream) + decoder.close()


@pytest.mark.parametrize(("stream", "events"), DECODED, ids=["text", "tool", "error", "cut"])
def test_streams_decode_to_their_events(stream: bytes, events: list[Event]) -> None:
    assert decode(stream) == events


def test_a_chunk_that_is_not_json_ends_the_stream_in_an_error() -> None:
    events = decode(b'data: {"id": "x", "choi\n\ndata: [DONE]\n\n')
    assert [type(e) for e in events] == [Error] and isinstance(events[0], Error)
    assert events[0].status == 502


def test_whole_answers_decode_to_the_same_events() -> None:
    assert chat.decode_answer(DOC_ANSWER) == [
        Start("chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT", "gpt-5.4"),
        TextDelta("Hello! How can I assist you today?"), Finish("stop"), Usage(19, 10), End()]
    assert chat.decode_answer(DOC_TOOL_ANSWER) == [
        Start("chatcmpl-abc123", "gpt-4o-mini"),
        ToolCallStart(0, "call_abc123", "get_current_weather"),
        ToolArgsDelta(0, '{\n"location": "Boston, MA"\n}'), Finish("tool_calls"),
        Usage(82, 17), End()]
    with pytest.raises(UpstreamBadResponse):
        chat.decode_answer(b'{"id": "x", "choices": []}')


def test_error_bodies_both_ways() -> None:
    body = b'{"error": {"message": "bad", "type": "invalid_request_error", "param": "messages", ' \
           b'"code": null}}'
    assert chat.decode_error(400, body) == Error(400, "bad", None, "messages")
    assert chat.decode_error(502, b"<html>Bad gateway</html>") == Error(
        502, "<html>Bad gateway</html>")
    # Anthropic's 529 keeps its status; its type is the code, as an OpenAI client sees it.
    written = orjson.loads(chat.encode_error(Error(529, "Overloaded", "overloaded_error")))
    assert written == {"error": {"message": "Overloaded", "type": "server_error", "param": None,
                                 "code": "overloaded_error"}}
    assert problems("openai", "ErrorResponse", written) == []
    assert orjson.loads(chat.encode_error(error_of(QueueFull("full"))))["error"]["code"] == \
        "queue_full"


ANSWER: list[Event] = [
    Start("msg_01", "claude-sonnet-4-5"), ThinkingDelta("Hmm."), TextDelta("Let me "),
    TextDelta("look."), ToolCallStart(0, "toolu_01", "get_weather"),
    ToolArgsDelta(0, '{"city":'), ToolArgsDelta(0, ' "Paris"}'),
    ToolCallStart(1, "toolu_02", "get_time"), Finish("tool_calls"),
    Usage(2095, 503, cache_read=2000, cache_write=50), End()]


def frames(stream: bytes) -> list[bytes]:
    reader = SseReader()
    return [data for _, data in reader.feed(stream) + reader.close()]


@pytest.mark.parametrize("include_usage", [True, False])
def test_the_stream_written_is_openais(include_usage: bool) -> None:
    encoder = chat.ChatStreamEncoder(created=1700000000, include_usage=include_usage)
    written = frames(b"".join(encoder.encode(event) for event in ANSWER))
    assert written[-1] == b"[DONE]"
    chunks = [orjson.loads(data) for data in written[:-1]]
    for chunk in chunks:
        assert problems("openai", "CreateChatCompletionStreamResponse", chunk) == []
        ChatCompletionChunk.model_validate(chunk, strict=False)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ("usage" in chunks[0]) is include_usage
    assert [c["usage"] for c in chunks if c.get("usage")] == (
        [{"prompt_tokens": 2095, "completion_tokens": 503, "total_tokens": 2598,
          "prompt_tokens_details": {"cached_tokens": 2000}}] if include_usage else [])


def test_an_error_ends_the_stream_without_a_finish() -> None:
    encoder = chat.ChatStreamEncoder(created=1, include_usage=True)
    written = b"".join(encoder.encode(event) for event in (
        Start("m", "x"), TextDelta("Hi"), Error(529, "Overloaded", "overloaded_error"),
        Finish("stop"), End()))
    assert written.endswith(b'data: {"error":{"message":"Overloaded","type":"server_error",'
                            b'"param":null,"code":"overloaded_error"}}\n\n')
    assert b"finish_reason\":\"stop" not in written and b"[DONE]" not in written


def test_the_answer_written_is_openais() -> None:
    answer = orjson.loads(chat.encode_answer(ANSWER, created=1700000000))
    assert problems("openai", "CreateChatCompletionResponse", answer) == []
    ChatCompletion.model_validate(answer)
    assert answer["choices"][0]["message"] == {
        "role": "assistant", "content": "Let me look.", "refusal": None, "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_02", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]}


def sdk(answer: bytes, content_type: str) -> Iterator[openai.OpenAI]:
    def reply(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=answer, headers={"content-type": content_type})

    with httpx2.Client(transport=httpx2.MockTransport(reply)) as http:
        yield openai.OpenAI(api_key="k", base_url="http://proxy.invalid/v1", http_client=http)


def test_the_openai_sdk_reads_the_stream_and_the_answer() -> None:
    encoder = chat.ChatStreamEncoder(created=1700000000, include_usage=True)
    stream = b"".join(encoder.encode(event) for event in ANSWER)
    for client in sdk(stream, "text/event-stream"):
        with client.chat.completions.stream(model="m", messages=[]) as reading:
            final = reading.get_final_completion()
        message = final.choices[0].message
        assert message.content == "Let me look." and final.choices[0].finish_reason == "tool_calls"
        assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] \
            == [("toolu_01", "get_weather", '{"city": "Paris"}'), ("toolu_02", "get_time", "{}")]
        assert final.usage is not None and final.usage.prompt_tokens == 2095
    for client in sdk(chat.encode_answer(ANSWER, created=1), "application/json"):
        got = client.chat.completions.create(model="m", messages=[])
        assert got.choices[0].message.content == "Let me look."
