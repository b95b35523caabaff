"""One replica's link to Redis: its two connections, and whether Redis is trusted now.

A command that fails switches the link to the ``on_error`` mode (``local``: a per-replica
share of each limit; ``reject``: 503). The heartbeat trusts Redis again at its second answer
a period after the first: by then every live replica has written back what it holds. Every
switch is counted, and so is the time spent out of shared mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ..config.state import StateSettings
from .base import Hooks

log = logging.getLogger("proxy.state.shared")

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
COMMAND_TIMEOUT_S = 0.5  # a Redis that answers slower than this counts as unreachable
CLOSE_WAIT_S = 2.0
MODES = ("shared", "local", "reject")


class Link:
    def __init__(self, settings: StateSettings, beat_s: float) -> None:
        self.settings = settings
        self.prefix = settings.prefix + ":"
        self.beat_s = beat_s
        self.mode = "shared"
        self.alive = 1
        self.errors = 0
        self.last_error: str | None = None
        self.rebuild = False  # Redis may have lost what this replica holds: write it back
        self.entered = dict.fromkeys(MODES, 0)  # times each mode was entered since start
        self.hooks: Hooks | None = None
        self.on_lost: Callable[[], None] = lambda: None  # the mode just left shared
        self._since = time.monotonic()
        self._away_s = 0.0  # out of shared mode, not counting the current stretch
        self._back_at: float | None = None  # Redis answered again (not yet trusted)
        self._tasks: set[asyncio.Task[None]] = set()
        retry = Retry(NoBackoff(), 1)  # one immediate retry on a fresh connection
        self.client = Redis.from_url(
            settings.url, socket_timeout=COMMAND_TIMEOUT_S,
            socket_connect_timeout=COMMAND_TIMEOUT_S, retry=retry, decode_responses=True)
        self.blocking = Redis.from_url(
            settings.url, socket_timeout=beat_s + COMMAND_TIMEOUT_S + 1.0,
            socket_connect_timeout=COMMAND_TIMEOUT_S, retry=retry, decode_responses=True)

    @property
    def returning(self) -> bool:
        """Redis answered again and is not trusted yet: releases are sent to it."""
        return self._back_at is not None

    def failed(self, exc: BaseException) -> None:
        """A Redis command failed: the ``on_error`` mode until two heartbeats answer."""
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        self.rebuild = True
        self._back_at = None
        if self.mode != "shared":
            return
        log.warning("shared state: Redis unreachable (%s); %s until it is back",
                    self.last_error, "a per-replica share of each limit"
                    if self.settings.on_error == "local" else "refusing calls")
        self._set_mode(self.settings.on_error)
        self.on_lost()

    def answered(self) -> None:
        """A heartbeat answered (after writing what this replica holds)."""
        if self.mode == "shared":
            self.rebuild = False
            return
        now = time.monotonic()
        if self._back_at is None:
            self._back_at = now
        elif now - self._back_at >= self.beat_s * 0.9:
            log.warning("shared state: Redis is back; shared mode again")
            self.rebuild = False
            self._back_at = None
            self._set_mode("shared")

    def _set_mode(self, mode: str) -> None:
        now = time.monotonic()
        if self.mode != "shared":
            self._away_s += now - self._since
        self.mode, self._since = mode, now
        self.entered[mode] += 1
        if self.hooks is not None:
            self.hooks.on_mode(mode, self.alive)

    def away_s(self) -> float:
        """Seconds spent out of shared mode since start."""
        current = time.monotonic() - self._since if self.mode != "shared" else 0.0
        return self._away_s + current

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def call(self, pending: Awaitable[object]) -> None:
        """A command whose answer nobody waits for; a failure is reported."""
        try:
            await pending
        except REDIS_ERRORS as exc:
            self.failed(exc)

    async def close(self, last: Awaitable[object] | None = None,
                    *pending: asyncio.Future[None]) -> None:
        """Wait (bounded) for the commands still going, send ``last``, disconnect."""
        waiting = [*self._tasks, *pending]
        if waiting:
            await asyncio.wait(waiting, timeout=CLOSE_WAIT_S)
        if last is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await last
        await self.client.aclose()
        await self.blocking.aclose()

    def status(self) -> dict[str, object]:
        return {"mode": self.mode, "mode_for_s": round(time.monotonic() - self._since, 3),
                "entered": dict(self.entered), "fallback_s": round(self.away_s(), 3),
                "replicas_alive": self.alive, "errors": self.errors,
                "last_error": self.last_error}
