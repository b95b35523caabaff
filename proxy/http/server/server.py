"""Running the app for real: uvloop, explicit handler cancellation, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any

from aiohttp import web

from ...config import Config
from ...core.errors import InvalidConfig
from ..base.appkeys import LANE, LIFECYCLE
from ..base.edge import is_loopback
from ..call import forward
from ..call.service import SERVICE
from ..lane.check import lane_off_because
from ..lane.refusals import Runner
from ..ops.reload import RELOADER
from ..work.runner import WORK
from .app import build_app

log = logging.getLogger(__name__)

# aiohttp's own wait for handlers, after the proxy's drain: only a fallback.
AIOHTTP_GRACE_S = 5.0


async def reload_on_signal(app: web.Application) -> None:
    """SIGHUP: reload, and say how it went in the log (there is no one to answer)."""
    try:
        answer = await app[RELOADER].reload(app[SERVICE])
    except InvalidConfig:
        return  # logged, and shown in /admin/status as config.last_error
    except Exception:
        log.exception("reload failed")
        return
    log.info("SIGHUP: %s", answer)


def tune_gc() -> None:
    """Everything built so far lives as long as the process: keep it out of the collector's
    way, and collect young objects less often (per-call garbage is mostly acyclic)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


async def serve(config: Config, host: str, port: int, config_path: str | None = None,
                reuse_port: bool = False, internal_token: str | None = None) -> None:
    app = build_app(config, config_path=config_path, internal_token=internal_token)
    # A client that disconnects must cancel its handler, so a queued call leaves the queue
    # and a running one frees its slot; aiohttp's own default is not to. The access log is
    # the proxy's own (one line per call, however it ends), not aiohttp's. Proxied calls
    # take the fast lane (``lane.front``) where they can, if it is on and this aiohttp has what
    # it reads.
    settings: dict[str, Any] = {"handler_cancellation": True, "access_log": None,
                                "shutdown_timeout": config.drain_timeout_s + AIOHTTP_GRACE_S}
    runner = lane_runner(app, settings) if config.server.fast_lane else None
    if runner is None:
        runner = Runner(app, **settings)
        if not config.server.fast_lane:
            app[LANE].off_because = "turned off (server.fast_lane: false, or --no-fast-lane)"
    await runner.setup()
    tune_gc()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
    await site.start()
    if not config.auth_required and not is_loopback(host):
        log.warning("no proxy keys configured and listening on %s: anyone can use it", host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def on_sighup() -> None:
        task = asyncio.ensure_future(reload_on_signal(app))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    # Announced only once every signal has its handler: a signal sent on seeing this line
    # must not meet the default action (which ends the process).
    bound = runner.addresses[0] if runner.addresses else (host, port)
    # Work that can wait calls this proxy back, on loopback when it listens everywhere.
    local = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else (
        f"[{host}]" if ":" in host else host)
    app[SERVICE].semantic.listening(f"http://{local}:{bound[1]}")
    await app[WORK].start(f"http://{local}:{bound[1]}")
    print(f"listening on http://{host}:{bound[1]}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("shutting down: no new connections, finishing calls in flight (up to "
                 "%gs; signal again to end them now)", config.drain_timeout_s)
        lifecycle = app[LIFECYCLE]
        lifecycle.draining = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lifecycle.hurry)
        try:
            await runner.cleanup()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(sig)


def lane_runner(app: web.Application, settings: dict[str, Any]) -> web.AppRunner | None:
    """The runner whose server has the fast lane; None, said once in the log, where this
    aiohttp lacks what the lane reads (``lane.check``)."""
    off_because = lane_off_because(app)
    if off_because is not None:
        log.warning("fast lane off: %s; calls are served through aiohttp's own handling",
                    off_because)
        app[LANE].off_because = off_because
        return None
    from ..lane.front import FrontRunner  # imported only where it can run

    return FrontRunner(app, forward.HANDLERS, **settings)


def run(config: Config, host: str, port: int, config_path: str | None = None,
        reuse_port: bool = False, internal_token: str | None = None) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, host, port, config_path, reuse_port, internal_token))
    else:
        uvloop.run(serve(config, host, port, config_path, reuse_port, internal_token))
