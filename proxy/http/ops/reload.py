"""Hot reload: re-read the config file ``serve`` was given (``SIGHUP``, ``POST /admin/reload``),
validate it whole, and only then swap it in (``Service.reconfigure``), one reload at a time.

What the running server was built with cannot change without a restart: the listening
address, the access log, the body size aiohttp accepts and the drain timeout (aiohttp's own
shutdown wait is set from it at start). A reload keeps those as they are
and says which of them the file changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from aiohttp import web

from ...config import Config, ConfigError, load_config
from ...core.errors import InvalidConfig
from ..call.service import Service

log = logging.getLogger(__name__)


def restart_needed(old: Config, new: Config) -> list[str]:
    """The settings ``new`` changes that only a restart applies."""
    changed = []
    if new.listen != old.listen:
        changed.append("listen")
    log_settings = new.access_log
    if log_settings.enabled and (not old.access_log.enabled
                                 or log_settings.format != old.access_log.format):
        changed.append("access_log")
    if new.limits.max_body_bytes != old.limits.max_body_bytes:
        changed.append("limits.max_body_bytes")
    if new.drain_timeout_s != old.drain_timeout_s:
        changed.append("drain_timeout_s")
    if new.server != old.server:
        changed.append("server")
    if new.state != old.state:
        changed.append("state")
    if new.telemetry != old.telemetry:
        changed.append("telemetry")
    return changed


def kept_for_restart(old: Config, new: Config) -> Config:
    """``new`` with the settings only a restart applies as they are now."""
    return dataclasses.replace(
        new, listen=old.listen, access_log=old.access_log, drain_timeout_s=old.drain_timeout_s,
        server=old.server, state=old.state, telemetry=old.telemetry,
        limits=dataclasses.replace(new.limits, max_body_bytes=old.limits.max_body_bytes))


class Reloader:
    def __init__(self, path: str | Path | None) -> None:
        self.path = path
        self._lock = asyncio.Lock()

    async def reload(self, service: Service) -> dict[str, object]:
        """Raises InvalidConfig (the old config keeps serving) or answers what the contract
        says: ``{"status": "reloaded", "version": ...}``, with what needs a restart."""
        async with self._lock:
            if self.path is None:
                raise InvalidConfig("This proxy was started without a config file to reload.")
            try:
                new = await asyncio.to_thread(load_config, self.path)
            except ConfigError as exc:
                service.last_error = str(exc)
                service.metrics.reloads.get("error").inc()
                log.warning("reload refused, the old config keeps serving: %s", exc)
                raise InvalidConfig(f"invalid config: {exc}") from None
            old = service.config
            restart = restart_needed(old, new)
            service.reconfigure(kept_for_restart(old, new))
            service.metrics.reloads.get("ok").inc()
            for warning in new.warnings:
                log.warning("%s", warning)
            log.info("config reloaded: version %s%s", new.version,
                     f" ({', '.join(restart)} need a restart)" if restart else "")
            return {"status": "reloaded", "version": new.version, "restart_needed": restart,
                    "warnings": list(new.warnings)}


RELOADER = web.AppKey("reloader", Reloader)
