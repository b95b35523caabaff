"""The operator's endpoints under ``/admin/`` and the dashboard page, behind one guard:
the admin key when ``admin.key`` is configured, else loopback clients only."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from ..core.errors import AdminLoopbackOnly, InvalidAdminKey
from .auth import bearer
from .dashboard import DASHBOARD_HTML
from .edge import is_loopback, secret_digest
from .state import SERVICE

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
    return web.Response(body=orjson.dumps(request.app[SERVICE].status()),
                        content_type="application/json")


async def dashboard(request: web.Request) -> web.StreamResponse:
    """The page itself holds no data: it asks for the admin key when its data needs one."""
    return web.Response(text=DASHBOARD_HTML, content_type="text/html")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/status", status)
    app.router.add_get("/dashboard", dashboard)
