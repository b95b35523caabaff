"""The SSE reader: events as the WHATWG spec reads them, whatever the chunks and line ends."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.errors import UpstreamBadResponse
from proxy.core.formats import sse
from proxy.core.formats.sse import SseReader

# Anthropic's stream opens like this (docs.claude.com/en/docs/build-with-claude/streaming).
STREAM = (b'event: message_start\ndata: {"type": "message_start"}\n\n'
          b'event: ping\ndata: {"type": "ping"}\n\n'
          b": a comment\n\n"
          b"id: 7\nretry: 100\ndata: first\ndata:second\ndata\n\n"
          b"event: only a name\n\n"
          b"data: [DONE]\n\n")
FRAMES = [(b"message_start", b'{"type": "message_start"}'), (b"ping", b'{"type": "ping"}'),
          (b"", b"first\nsecond\n"), (b"", b"[DONE]")]


def read(chunks: list[bytes]) -> list[sse.Frame]:
    reader = SseReader()
    return [frame for chunk in chunks for frame in reader.feed(chunk)] + reader.close()


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_events_by_any_line_end(line_end: bytes) -> None:
    assert read([STREAM.replace(b"\n", line_end)]) == FRAMES


def test_a_cr_last_in_a_chunk_waits_for_the_next_byte() -> None:
    # Half of a CRLF, then its LF: one line end, so both data lines are one event.
    assert read([b"data: a\r", b"\ndata: b\r\n\r\n"]) == [(b"", b"a\nb")]


def test_at_the_end_an_ended_line_is_an_event_and_a_cut_one_is_not() -> None:
    assert read([b"data: [DONE]\n"]) == [(b"", b"[DONE]")]
    assert read([b"data: [DONE]\r"]) == [(b"", b"[DONE]")]
    assert read([b'data: {"choi']) == []


def test_an_event_past_the_bound_breaks_the_stream() -> None:
    reader = SseReader()
    assert reader.feed(b"data: " + b"x" * (sse.MAX_EVENT_BYTES - 6)) == []
    with pytest.raises(UpstreamBadResponse):
        reader.feed(b"x")


def test_frame_writes_what_the_reader_reads() -> None:
    assert sse.frame(b"{}", b"ping") == b"event: ping\ndata: {}\n\n"
    assert read([sse.frame(b"{}", b"ping"), sse.frame(b"[DONE]")]) == [
        (b"ping", b"{}"), (b"", b"[DONE]")]


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12),
       line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_chunking_reads_the_same_events(cuts: list[int], line_end: bytes) -> None:
    stream = STREAM.replace(b"\n", line_end)
    edges = [0, *sorted(min(cut, len(stream)) for cut in cuts), len(stream)]
    assert read([stream[a:b] for a, b in itertools.pairwise(edges)]) == FRAMES
