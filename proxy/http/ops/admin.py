"""The operator's endpoints under ``/admin/`` and the dashboard page, behind one guard:
the admin key when ``admin.key`` is configured, else loopback clients only."""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web
from aiohttp_sse import sse_response

from ...core.errors import AdminLoopbackOnly, InvalidAdminKey
from ..base.appkeys import LANE, LIFECYCLE
from ..base.edge import is_loopback, secret_digest
from ..call.auth import bearer
from ..call.service import SERVICE, Service
from ..work.runner import WORK, Work
from .dashboard import DASHBOARD_HTML
from .reload import RELOADER

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def check_admin(request: web.Request) -> None:
    """Raises unless the caller may use admin endpoints. The peer is the socket's: a
    forwarded-for header is never believed."""
    digest = request.app[SERVICE].config.admin_sha256
    if digest is None:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        host = peer[0] if isinstance(peer, tuple) and peer else ""
        if not is_loopback(host):
            raise AdminLoopbackOnly(
                "Admin endpoints answer loopback clients only while no admin.key is "
                "configured.")
        return
    token = bearer(request.headers.get("Authorization", "")) or request.headers.get(
        "X-Admin-Key", "")
    if not token or not hmac.compare_digest(secret_digest(token), digest):
        raise InvalidAdminKey(
            "Admin endpoints need the admin key: 'Authorization: Bearer <admin key>' or "
            "'X-Admin-Key'.")


def admin(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        check_admin(request)
        return await handler(request)

    return guarded


@admin
async def status(request: web.Request) -> web.StreamResponse:
    shown = {**request.app[SERVICE].status(), "work": await request.app[WORK].status(),
             "server": request.app[LANE].status()}
    return web.Response(body=orjson.dumps(shown), content_type="application/json")


async def dashboard(request: web.Request) -> web.StreamResponse:
    """The page itself holds no data: it asks for the admin key when its data needs one."""
    return web.Response(text=DASHBOARD_HTML, content_type="text/html")


def throttles(service: Service) -> dict[str, int]:
    """Upstream 429s per provider since the start (``proxy_upstream_attempts_total`` with
    ``outcome="throttle"``)."""
    counts = dict.fromkeys(service.config.providers, 0)
    for family in service.metrics.attempts.metric.collect():
        for series in family.samples:
            if series.name.endswith("_total") and series.labels["outcome"] == "throttle":
                counts[series.labels["provider"]] = int(series.value)
    return counts


async def live_event(service: Service, work: Work, now: float,
                     after: int | None) -> dict[str, object]:
    """What the dashboard shows, all of it: ``/admin/status`` as it is now, the 429s, the
    usage, the rejections, the batches running, and the history's seconds after ``after``
    (all of them when ``after`` is None)."""
    live = service.live
    return {
        "t": math.floor(now), "window_s": live.window_s, "status": service.status(),
        "throttles": throttles(service), "points": live.points(now, after),
        "usage": live.usage(), "rejections": live.rejections(),
        "batches": await work.running(),
    }


@admin
async def reload(request: web.Request) -> web.StreamResponse:
    """Re-read the config file: 200 with its version, or 400 with where it is wrong."""
    answer = await request.app[RELOADER].reload(request.app[SERVICE])
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


@admin
async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a ``snapshot`` (``live_event``) at once, with the whole history,
    then one a second with the seconds since. Ends when the proxy starts draining."""
    service, lifecycle = request.app[SERVICE], request.app[LIFECYCLE]
    after: int | None = None
    async with sse_response(request, send_timeout=10) as stream:
        while not (lifecycle.draining or service.live.stopped):
            try:
                check_admin(request)  # again: a reload may have changed the admin key
            except (InvalidAdminKey, AdminLoopbackOnly):
                break
            now = service.clock.now()
            event = await live_event(service, request.app[WORK], now, after)
            try:
                await stream.send(orjson.dumps(event).decode(), event="snapshot")
            except (ConnectionError, TimeoutError):
                break  # the dashboard went away or stopped reading
            after = math.floor(now) - 1
            await service.live.next_sample()
    return stream


@admin
async def history(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    event = await live_event(service, request.app[WORK], service.clock.now(), None)
    return web.Response(body=orjson.dumps(event), content_type="application/json")


def sample(service: Service) -> None:
    scheduler = service.scheduler
    service.live.sample(
        service.clock.now(),
        {name: scheduler.depth(i) for i, name in enumerate(service.config.tier_names)},
        {name: scheduler.inflight(name) for name in service.config.providers},
    )


async def sampling(app: web.Application) -> AsyncIterator[None]:
    """Once a second for as long as the app runs: queue depths and calls in flight into
    the live history (so a dashboard opened later draws the minutes before it)."""
    service = app[SERVICE]
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal timer
        sample(service)
        timer = loop.call_later(1.001 - service.clock.now() % 1.0, tick)  # just past a second

    tick()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        service.live.stop()


def add_routes(app: web.Application) -> None:
    """The admin routes and the dashboard's 1 Hz sampler (after the service is built)."""
    app.router.add_get("/admin/status", status)
    app.router.add_post("/admin/reload", reload)
    app.router.add_get("/admin/events", events)
    app.router.add_get("/admin/history", history)
    app.router.add_get("/dashboard", dashboard)
    app.cleanup_ctx.append(sampling)
