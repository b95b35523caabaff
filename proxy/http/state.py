"""Typed keys for the state aiohttp keeps on the app and on each request."""

from __future__ import annotations

from aiohttp import web

from .access import AccessLog, CallRecord
from .drain import Lifecycle
from .lanecheck import LaneStatus
from .reload import Reloader
from .service import Service
from .work import Work

SERVICE = web.AppKey("service", Service)
WORK = web.AppKey("work", Work)  # batches and background responses
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
RELOADER = web.AppKey("reloader", Reloader)
LANE = web.AppKey("lane", LaneStatus)  # whether calls take the fast lane, and if not why
REQUEST_ID = web.RequestKey("request_id", str)
RECORD = web.RequestKey("record", CallRecord)
ACCESS_LOG = web.AppKey("access_log", AccessLog)  # set only when the access log is on
COMMITTED = web.RequestKey("committed", bool)  # the response head has gone to the client
