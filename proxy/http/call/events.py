"""An SSE answer: aiohttp's own response, or, for a call the fast lane took, the lane's
(``proxy.http.lane.events``), written straight to its connection. Whichever server took
the call chooses, by ``ANSWER_EVENTS``: this module imports nothing of the lane, which runs
only on an aiohttp that has what it reads (``proxy.http.lane.check``).
"""

from __future__ import annotations

from aiohttp import web

from ..base.edge import Incoming


class EventStream(web.StreamResponse):
    """An SSE answer whose head goes out with its first event, in one write (the first
    event follows ``begin`` at once), not in a write of its own."""

    _send_headers_immediately = False

    async def begin(self, request: Incoming) -> None:
        """``prepare`` for the request the answer is to."""
        assert isinstance(request, web.BaseRequest), "a lane's request answers LaneEvents"
        await self.prepare(request)


# The SSE answer a request is given, where its server has one of its own (the lane's).
ANSWER_EVENTS = web.RequestKey[type[EventStream]]("answer_events")


def event_stream(request: Incoming, headers: dict[str, str]) -> EventStream:
    """The answer for a stream to ``request``, by whichever server took it."""
    kind = request.get(ANSWER_EVENTS)
    return (EventStream if kind is None else kind)(headers=headers)
