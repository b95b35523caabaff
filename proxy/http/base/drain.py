"""Graceful drain at SIGTERM: stop being ready, let calls in flight finish and queued calls
that still fit start, within ``drain_timeout_s``; then end what is left with an error the
client can read (an SSE error event, or a 503), never a silent cut."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# After the drain deadline, how long the calls still running get to write their error.
FAREWELL_S = 2.0


def uncancel() -> bool:
    """Undo the running task's cancellation by the drain; False outside a task.

    A helper, so that no frame of a call keeps its task in a local: the task holds its
    CancelledError, the error its traceback, the traceback that frame, and the cycle would
    keep the whole call alive until the garbage collector ran."""
    task = asyncio.current_task()
    if task is None:
        return False
    task.uncancel()
    return True


class Lifecycle:
    """Readiness, and the proxied calls in progress, for the drain to wait on."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False  # the drain deadline passed: calls still running are ended
        self._calls: set[asyncio.Task[object]] = set()
        self.started = 0  # proxied calls ever started
        self._idle = asyncio.Event()
        self._hurry = asyncio.Event()

    def call(self) -> _Call:
        """Around one proxied call's handler (``with``)."""
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        self.started += 1
        return _Call(self, task)

    def _ended(self, task: asyncio.Task[object]) -> None:
        self._calls.discard(task)
        if not self._calls:
            self._idle.set()

    @property
    def in_progress(self) -> int:
        return len(self._calls)

    def hurry(self) -> None:
        """End the drain now (a second SIGTERM or Ctrl-C)."""
        self._hurry.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait for the calls in progress, at most ``timeout_s``; then end the rest."""
        self.draining = True
        if self._calls:
            self._idle.clear()
            log.info("draining: %d calls in progress, up to %gs", len(self._calls), timeout_s)
            waiters = [asyncio.ensure_future(self._idle.wait()),
                       asyncio.ensure_future(self._hurry.wait())]
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
        if self._calls:
            log.warning("drain timeout: ending %d calls still in progress", len(self._calls))
            self.expired = True
            remaining = list(self._calls)
            for task in remaining:
                task.cancel()
            await asyncio.wait(remaining, timeout=FAREWELL_S)


class _Call:
    """``Lifecycle.call()``: a plain object, not a generator, as every call makes one."""

    __slots__ = ("_lifecycle", "_task")

    def __init__(self, lifecycle: Lifecycle, task: asyncio.Task[object]) -> None:
        self._lifecycle = lifecycle
        self._task = task

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lifecycle._ended(self._task)
