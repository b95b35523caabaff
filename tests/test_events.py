"""The fast lane's SSE answer writes what aiohttp's response and writer would write."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.http.call.events import EventStream, event_stream
from proxy.http.lane.events import LaneEvents
from proxy.http.lane.front import FrontProtocol
from proxy.http.lane.head import Head
from proxy.http.lane.request import FastRequest

from .fakes import Sink, aiohttp_request


class Protocol(BaseProtocol):
    """What the answer needs of the lane's protocol."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    ssl_context = peername = sockname = None


def lane_request(keep_alive: bool) -> tuple[FastRequest, BaseProtocol, Sink]:
    loop = asyncio.get_running_loop()
    protocol = Protocol(loop)
    sink = Sink()
    protocol.transport = sink
    head = Head("/v1/chat/completions", CIMultiDictProxy(CIMultiDict({"Host": "x"})), 0, 0,
                keep_alive)
    request = FastRequest(web.Application(), head, cast(FrontProtocol, protocol))
    return request, protocol, sink


HEADERS = {"content-type": "text/event-stream", "x-request-id": "req_1",
           "x-proxy-tier": "normal", "cache-control": "no-cache", "x-é": "vé"}
steps = st.lists(st.tuples(st.sampled_from(["write", "eof"]),
                           st.binary(max_size=40)), max_size=5)


async def run(response: EventStream, request: object, writes: list[tuple[str, bytes]],
              status: int) -> None:
    response.set_status(status)
    await response.begin(cast(web.BaseRequest, request))
    for kind, data in writes:
        if kind == "eof":
            await response.write_eof(data)
            break
        await response.write(data)
    else:
        await response.write_eof()


@settings(max_examples=100, deadline=None)
@given(writes=steps, keep_alive=st.booleans(),
       status=st.sampled_from([200, 201, 204, 304, 503]), cookie=st.booleans())
async def test_the_lane_writes_the_bytes_aiohttp_writes(
        writes: list[tuple[str, bytes]], keep_alive: bool, status: int, cookie: bool) -> None:
    """The lane's own writing for what the relay sends; aiohttp's for anything else (an
    empty-body status, a cookie), through the lane's answer all the same."""
    lane, _, lane_sink = lane_request(keep_alive)
    ours = event_stream(lane, dict(HEADERS))
    theirs = EventStream(headers=dict(HEADERS))
    if cookie:
        ours.set_cookie("a", "b")
        theirs.set_cookie("a", "b")
    await run(ours, lane, writes, status)

    mocked, sink = aiohttp_request(keep_alive)
    await run(theirs, mocked, writes, status)
    date = [line for line in bytes(sink.data).split(b"\r\n") if line.startswith(b"Date:")]
    written = bytes(lane_sink.data)
    for line in written.split(b"\r\n"):  # the two may fall on either side of a second
        if line.startswith(b"Date:"):
            written = written.replace(line, date[0])
    assert written == bytes(sink.data)


async def test_only_a_lane_request_gets_the_lane_answer() -> None:
    lane, _, _ = lane_request(True)
    assert type(event_stream(lane, {})) is LaneEvents
    mocked = make_mocked_request("POST", "/v1/chat/completions")
    assert type(event_stream(mocked, {})) is EventStream


async def test_a_write_waits_while_the_client_is_not_reading() -> None:
    lane, protocol, sink = lane_request(True)
    answer = event_stream(lane, {})
    await answer.begin(lane)
    protocol.pause_writing()
    write = asyncio.ensure_future(answer.write(b"data: 1\n\n"))
    await asyncio.sleep(0.01)
    assert not write.done() and b"data: 1" in sink.data  # written, waiting for room
    protocol.resume_writing()
    await asyncio.wait_for(write, 1)


async def test_writing_to_a_closed_connection_raises_as_aiohttp_does() -> None:
    lane, _, sink = lane_request(True)
    answer = event_stream(lane, {})
    await answer.begin(lane)
    sink.closing = True
    with pytest.raises(ClientConnectionResetError):
        await answer.write(b"data: 1\n\n")


async def test_after_its_end_the_answer_is_prepared_and_writes_nothing_more() -> None:
    lane, _, sink = lane_request(True)
    answer = event_stream(lane, {})
    assert not answer.prepared
    await answer.begin(lane)
    assert answer.prepared
    await answer.write_eof(b"data: [DONE]\n\n")
    sent = bytes(sink.data)
    assert sent.endswith(b"\r\n0\r\n\r\n")
    await answer.begin(lane)
    await answer.write_eof()
    assert bytes(sink.data) == sent and answer.prepared
    with pytest.raises(RuntimeError):
        await answer.write(b"x")
