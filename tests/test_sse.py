"""Relaying SSE (``proxy.http.call.tally.StreamTally``): whole events only, however the bytes
are chunked, ``data:`` read as the SSE spec defines it."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.errors import UpstreamBadResponse
from proxy.http.call.tally import _BOUNDARY, MAX_EVENT_BYTES, StreamTally, boundaries, event_data


def chunk(event: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


CONTENT = [chunk({"choices": [{"delta": {"content": w}}]}) for w in ("a", "b", "c")]
USAGE = chunk({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
STREAM = b"".join([*CONTENT, USAGE, b"data: [DONE]\n\n"])


def relay(pieces: list[bytes], strip_usage: bool = False) -> tuple[bytes, StreamTally]:
    tally = StreamTally(strip_usage)
    out = b"".join(tally.feed(piece) for piece in pieces) + tally.finish()
    return out, tally


def cuts(data: bytes) -> st.SearchStrategy[list[bytes]]:
    return st.lists(st.integers(0, len(data)), max_size=12).map(
        lambda points: [data[a:b] for a, b in zip([0, *sorted(points)],
                                                  [*sorted(points), len(data)], strict=True)])


@pytest.mark.parametrize(("event", "data"), [
    (b"data: [DONE]", b"[DONE]"),
    (b"data:[DONE]", b"[DONE]"),
    (b"data:  two spaces", b" two spaces"),
    (b"event: done\r\ndata: [DONE]", b"[DONE]"),
    (b": keep-alive", None),
    (b"id: 7\ndata: {\"a\":\ndata: 1}", b'{"a":\n1}'),
    (b"data", b""),
    (b"database: x", None),
])
def test_event_data_follows_the_spec(event: bytes, data: bytes | None) -> None:
    assert event_data(event) == data


@pytest.mark.parametrize("stream", [
    STREAM,
    STREAM.replace(b"\n\n", b"\r\n\r\n"),
    STREAM.replace(b"\n\n", b"\r\r"),
    STREAM.replace(b"data: [DONE]", b"data:[DONE]"),
    b": hello\n\n" + STREAM.replace(b"data: [DONE]", b"event: end\ndata: [DONE]"),
])
def test_done_is_seen_in_every_spelling(stream: bytes) -> None:
    out, tally = relay([stream])
    assert out == stream and tally.done
    assert tally.usage == {"prompt_tokens": 4, "completion_tokens": 3}


def test_a_last_event_without_its_blank_line_is_completed_at_a_clean_end() -> None:
    out, tally = relay([STREAM[:-2]])
    assert out == STREAM and tally.done


def test_the_usage_chunk_the_proxy_asked_for_is_removed() -> None:
    out, tally = relay([STREAM], strip_usage=True)
    assert out == STREAM.replace(USAGE, b"") and tally.usage is not None
    assert tally.events == 3


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), strip=st.booleans(),
       style=st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n"]))
def test_chunking_never_changes_what_the_client_gets(data: st.DataObject, strip: bool,
                                                     style: bytes) -> None:
    stream = STREAM.replace(b"\n\n", style)
    whole, _ = relay([stream], strip)
    pieces = data.draw(cuts(stream))
    assert relay(pieces, strip)[0] == whole


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), strip=st.booleans())
def test_a_stream_cut_anywhere_has_relayed_only_whole_events(data: st.DataObject,
                                                             strip: bool) -> None:
    cut = data.draw(st.integers(0, len(STREAM)))
    tally = StreamTally(strip)
    out = b"".join(tally.feed(piece) for piece in data.draw(cuts(STREAM[:cut])))
    events = out.split(b"\n\n")
    assert events[-1] == b""  # ends at a boundary (or is empty)
    for event in events[:-1]:
        payload = event_data(event)
        assert payload == b"[DONE]" or isinstance(orjson.loads(payload or b"null"), dict)


def test_an_event_past_the_bound_breaks_the_stream() -> None:
    tally = StreamTally(False)
    tally.feed(b"data: " + b"x" * (MAX_EVENT_BYTES // 2))
    with pytest.raises(UpstreamBadResponse, match="larger than"):
        tally.feed(b"x" * (MAX_EVENT_BYTES // 2 + 1))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(buffer=st.binary(max_size=60).map(
    lambda raw: bytes(b"\n\r:d "[byte % 5] for byte in raw)), pos=st.integers(0, 8))
def test_event_boundaries_by_find_and_by_the_pattern_agree(buffer: bytes, pos: int) -> None:
    by_pattern = [m.span() for m in _BOUNDARY.finditer(buffer, pos)]
    assert boundaries(buffer, pos) == by_pattern
    assert boundaries(buffer.replace(b"\r", b""), pos) == [
        m.span() for m in _BOUNDARY.finditer(buffer.replace(b"\r", b""), pos)]



class EventByEvent(StreamTally):
    """The reference: every buffer cut by ``boundaries`` and every event inspected."""

    def _split(self, buffer: bytes, pos: int) -> bytes:
        return self._cut(buffer, pos)


PIECES = [
    *CONTENT, USAGE, b"data: [DONE]\n\n", b": keep-alive\n\n", b"\n\n",
    b"event: delta\ndata: {\"a\": 1}\n\n", b"data: {\"a\":\ndata: 1}\n\n", b"data: [1, 2]\n\n",
    chunk({"type": "response.created", "response": {"id": "resp_1"}}),
    chunk({"type": "response.completed", "response": {"usage": {"input_tokens": 2}}}),
    chunk({"choices": [{"delta": {"content": "response. and [DONE] as text"}}]}),
]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), strip=st.booleans(), keep=st.sampled_from([0, 60, 10_000]))
def test_counting_whole_buffers_tallies_as_inspecting_every_event(
        data: st.DataObject, strip: bool, keep: int) -> None:
    stream = b"".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=12)))
    pieces = data.draw(cuts(stream))
    fast, slow = StreamTally(strip, keep), EventByEvent(strip, keep)
    out = [tally_out(t, pieces) for t in (fast, slow)]
    assert out[0] == out[1]
    assert (fast.events, fast.usage, fast.done, fast.response_id, fast.kept) == (
        slow.events, slow.usage, slow.done, slow.response_id, slow.kept)


def tally_out(tally: StreamTally, pieces: list[bytes]) -> bytes:
    return b"".join(tally.feed(piece) for piece in pieces) + tally.finish()
