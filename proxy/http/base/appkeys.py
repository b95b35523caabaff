"""Typed keys for what the app and each request hold that every room reads: the
lifecycle, the access log, whether the fast lane serves, how a call is handed to work that
can wait, and a request's id, record and commit point. A room's own long-lived object has
its key beside it (``SERVICE`` in ``call.service``, ``WORK`` in ``work.runner``,
``RELOADER`` in ``ops.reload``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ...core.formats.request import Call
from .access import AccessLog, CallRecord
from .drain import Lifecycle
from .edge import Incoming


@dataclass
class LaneStatus:
    """Whether this process serves through the lane, and if not why (``/admin/status``)."""

    on: bool = False
    off_because: str | None = "not serving"

    def status(self) -> dict[str, object]:
        return {"aiohttp": aiohttp.__version__, "fast_lane": self.on,
                "fast_lane_off_because": None if self.on else self.off_because}


# A checked call with ``background: true``, for its owner: stored and answered at once
# (``work.batches.create_background``; the call path does not know the store).
Background = Callable[[Incoming, str, Call], Awaitable[web.Response]]

LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
ACCESS_LOG = web.AppKey("access_log", AccessLog)  # set only when the access log is on
LANE = web.AppKey("lane", LaneStatus)  # whether calls take the fast lane, and if not why
BACKGROUND: web.AppKey[Background] = web.AppKey("background")
REQUEST_ID = web.RequestKey("request_id", str)
RECORD = web.RequestKey("record", CallRecord)
COMMITTED = web.RequestKey("committed", bool)  # the response head has gone to the client
