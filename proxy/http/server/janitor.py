"""Giving memory back after a burst.

The server freezes its start-up objects and collects the young generation rarely (see
``server.py``), so the cyclic garbage of thousands of calls (cancelled handlers, their
exceptions and frames) waits for a full collection that may not come for a long time, and
glibc's malloc keeps the pages it freed: after a burst of queued calls most of the memory
it took stays resident until a full collection and ``malloc_trim`` give it back (the
figures: docs/operations.md, "Memory after a burst").

So once the proxy has been quiet for a tick (no call in progress, none started since the
last tick, so the burst's connections are closed too) after at least ``MIN_CALLS`` calls
since the last sweep, it runs one full collection and trims the heap. Quiet means no
call waits for the pause it costs (a full collection of a large heap is not short).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from ..base.appkeys import LIFECYCLE
from ..base.drain import Lifecycle

log = logging.getLogger(__name__)

EVERY_S = 5.0
MIN_CALLS = 1000


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, where there is one."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


class Janitor:
    def __init__(self, lifecycle: Lifecycle, min_calls: int = MIN_CALLS,
                 collect: Callable[[], object] = gc.collect,
                 trim: Callable[[], object] | None = None) -> None:
        self._lifecycle = lifecycle
        self._min_calls = min_calls
        self._collect = collect
        self._trim = trim
        self._seen = lifecycle.started  # calls started by the last sweep
        self._last = lifecycle.started  # ... and by the last tick
        self.sweeps = 0

    def tick(self) -> bool:
        """Sweep if the proxy has been quiet since the last tick (no call in progress, none
        started: connections of the burst closed too) after enough calls; True if it did."""
        lifecycle = self._lifecycle
        started = lifecycle.started
        quiet = not lifecycle.in_progress and started == self._last
        self._last = started
        if not quiet or started - self._seen < self._min_calls:
            return False
        self._seen = started
        self._collect()
        if self._trim is not None:
            self._trim()
        self.sweeps += 1
        log.debug("idle after a burst: garbage collected and the heap trimmed")
        return True


async def sweeping(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: tick a Janitor every ``EVERY_S`` while the app runs."""
    sweeper = Janitor(app[LIFECYCLE], trim=_malloc_trim())
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal timer
        sweeper.tick()
        timer = loop.call_later(EVERY_S, tick)

    timer = loop.call_later(EVERY_S, tick)
    try:
        yield
    finally:
        timer.cancel()
