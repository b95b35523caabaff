"""The call path's pieces for Anthropic's format, without sockets: its rate-limit headers,
a Messages stream relayed as it is (``MessagesTally``) or translated (``Translating``),
usage with cached tokens, and the response cache's Messages answers."""

from __future__ import annotations

import itertools
from collections import deque

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.formats.sse import SseReader
from proxy.http.call.cache import assemble, replay
from proxy.http.call.relay import usage_counts
from proxy.http.call.tally import MessagesTally
from proxy.http.call.translate import Translating
from proxy.http.upstream.anthropic import quota_headers

from .fake_anthropic import FakeAnthropic, error_body, frame
from .vendor_specs import problems

pytestmark = pytest.mark.unit

WALL = 1_796_000_000.0  # 2026-11-30T...Z
STREAM = b"".join(FakeAnthropic()._stream("claude-x", "ok"))
TOOL_STREAM = b"".join(FakeAnthropic()._stream("claude-x", "tool"))


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def test_anthropic_rate_limit_headers_read_as_x_ratelimit_ones() -> None:
    from datetime import UTC, datetime

    reset = datetime.fromtimestamp(WALL + 12.5, UTC).isoformat().replace("+00:00", "Z")
    headers = {"anthropic-ratelimit-requests-remaining": "0",
               "anthropic-ratelimit-requests-reset": reset,
               "anthropic-ratelimit-tokens-remaining": "900",
               "anthropic-ratelimit-tokens-reset": "not a time"}
    assert quota_headers(headers, WALL) == {
        "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "12.500",
        "x-ratelimit-remaining-tokens": "900"}
    past = datetime.fromtimestamp(WALL - 5, UTC).isoformat()
    assert quota_headers({"anthropic-ratelimit-requests-remaining": "3",
                          "anthropic-ratelimit-requests-reset": past}, WALL)[
        "x-ratelimit-reset-requests"] == "0.000"
    assert quota_headers({"anthropic-ratelimit-requests-reset": reset}, WALL) == {}


def test_usage_counts_anthropics_cached_tokens_as_prompt_tokens() -> None:
    assert usage_counts({"input_tokens": 12, "output_tokens": 3, "cache_read_input_tokens": 4,
                         "cache_creation_input_tokens": 2}) == (18, 3)
    assert usage_counts({"input_tokens": 12, "output_tokens": 3,
                         "cache_read_input_tokens": None,
                         "cache_creation_input_tokens": 2}) == (14, 3)
    assert usage_counts({"input_tokens": 7, "output_tokens": 1}) == (7, 1)  # Responses API's
    assert usage_counts({"prompt_tokens": 5, "completion_tokens": 2}) == (5, 2)


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_messages_stream_passes_through_whole_however_it_is_cut(cuts: list[int]) -> None:
    tally = MessagesTally(0, "req_1")
    out = b"".join(tally.feed(piece) for piece in pieces(TOOL_STREAM, cuts)) + tally.finish()
    assert out == TOOL_STREAM
    assert tally.done and tally.failure is None
    assert usage_counts(tally.usage or {}) == (18, 3)


def test_an_error_event_ends_a_messages_stream_and_nothing_follows_it() -> None:
    data = b"".join(FakeAnthropic()._stream("claude-x", "stream_error"))
    tally = MessagesTally(0, "req_1")
    assert tally.feed(data) + tally.finish() == data
    assert not tally.done and tally.failure == "Overloaded"
    assert tally.error_event("upstream stream failed", "x") == b""
    fresh = MessagesTally(0, "req_2")
    event = fresh.error_event("upstream stream failed: cut", "upstream_bad_response")
    (name, payload), = SseReader().feed(event)
    assert name == b"error"
    assert problems("anthropic", "ErrorResponse", orjson.loads(payload)) == []
    assert orjson.loads(payload)["request_id"] == "req_2"


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_translated_stream_is_the_same_however_the_upstream_cuts_it(cuts: list[int]) -> None:
    whole = Translating("chat_to_messages", include_usage=True, input_tokens=9,
                        request_id="r")
    expected = whole.feed(TOOL_STREAM) + whole.finish()
    tally = Translating("chat_to_messages", include_usage=True, input_tokens=9,
                        request_id="r")
    out = b"".join(tally.feed(piece) for piece in pieces(TOOL_STREAM, cuts)) + tally.finish()
    assert out.replace(b"\n\n", b"") == expected.replace(b"\n\n", b"")
    assert tally.done and tally.usage == {"prompt_tokens": 18, "completion_tokens": 3}


def test_a_translated_stream_keeps_the_clients_events_for_the_cache() -> None:
    tally = Translating("chat_to_messages", include_usage=False, input_tokens=9,
                        request_id="r", keep_bytes=1 << 20)
    tally.feed(STREAM)
    tally.finish()
    assert tally.kept is not None
    whole = assemble("chat", tally.kept)
    assert whole is not None
    answer = orjson.loads(whole)
    assert answer["choices"][0]["message"]["content"] == "Hello!"
    assert problems("openai", "CreateChatCompletionResponse", answer) == []
    small = Translating("chat_to_messages", include_usage=False, input_tokens=9,
                        request_id="r", keep_bytes=100)
    small.feed(STREAM)
    assert small.kept is None  # past its bound: nothing kept at all


def test_an_upstream_error_event_is_written_once_in_the_clients_format() -> None:
    data = b"".join(FakeAnthropic()._stream("claude-x", "stream_error"))
    tally = Translating("chat_to_messages", include_usage=False, input_tokens=9,
                        request_id="r")
    out = tally.feed(data) + tally.finish()
    last = out.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert orjson.loads(last.removeprefix(b"data: "))["error"]["code"] == "overloaded_error"
    assert tally.failure == "Overloaded" and not tally.done
    assert tally.error_event("again", "x") == b""


def test_a_messages_stream_is_cached_as_one_message_and_replayed_as_a_stream() -> None:
    tally = MessagesTally(1 << 20, "r")
    tally.feed(STREAM)
    assert tally.kept is not None
    whole = assemble("messages", tally.kept)
    assert whole is not None
    message = orjson.loads(whole)
    assert [b["text"] for b in message["content"]] == ["Hello!"]
    assert problems("anthropic", "Message", message) == []
    again = replay("messages", whole, include_usage=False)
    events = deque(SseReader().feed(again))
    assert events[0][0] == b"message_start" and events[-1][0] == b"message_stop"
    for _, payload in events:
        assert problems("anthropic", "MessageStreamEvent", orjson.loads(payload)) == []


def test_only_text_messages_streams_are_cached() -> None:
    tally = MessagesTally(1 << 20, "r")
    tally.feed(TOOL_STREAM)
    assert tally.kept is not None and assemble("messages", tally.kept) is None
    cut = MessagesTally(1 << 20, "r")
    cut.feed(STREAM[:len(STREAM) // 2])
    assert cut.kept is not None and assemble("messages", cut.kept) is None
    broken = [*(tally.kept[:2]), orjson.dumps(error_body("api_error", "x"))]
    assert assemble("messages", broken) is None
    assert frame("ping", {"type": "ping"}).startswith(b"event: ping")
