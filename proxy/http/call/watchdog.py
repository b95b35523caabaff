"""A stream's client write timeout: one timer, armed only once a write has to wait.

Writes to a client that reads return at once (the lane's write only waits while the
transport is paused, aiohttp's once its buffer fills), so most streams never arm it: a
write step is run to its first wait by hand, and only if it waits does the rest run under
the timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


class ClientGone(Exception):
    """The client stopped reading (a write timed out) or disconnected."""


class Watchdog:
    """A write to the client still waiting after ``timeout_s`` cancels the task that
    wrote it, and ``send`` raises ClientGone for it."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._since: float | None = None  # when the write now waiting began
        self._fired = False
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _check(self) -> None:
        since, now = self._since, self._loop.time()
        if since is not None and now - since >= self._timeout_s:
            assert self._task is not None
            self._fired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at((now if since is None else since)
                                             + self._timeout_s, self._check)

    async def send(self, step: Coroutine[Any, Any, object]) -> None:
        try:
            waiting = step.send(None)  # as far as it goes without waiting
        except StopIteration:
            return
        except ConnectionResetError as exc:
            raise ClientGone() from exc
        self._since = self._loop.time()
        if self._timer is None:
            self._task = asyncio.current_task()
            self._timer = self._loop.call_at(self._since + self._timeout_s, self._check)
        try:
            await _Rest(step, waiting)
        except asyncio.CancelledError:
            assert self._task is not None
            if self._fired and self._task.uncancel() == 0:
                raise ClientGone() from None
            raise
        except ConnectionResetError as exc:
            raise ClientGone() from exc
        finally:
            self._since = None

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Rest:
    """Awaiting the rest of a coroutine that ran to its first wait: what awaiting the
    coroutine would have done from there (what it waits on goes to the task; what the task
    sends or throws goes back to it)."""

    __slots__ = ("_coro", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, object], waiting: object) -> None:
        self._coro = coro
        self._waiting = waiting

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waiting = self._coro, self._waiting
        while True:
            try:
                sent = yield waiting
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the task: passed on
                try:
                    waiting = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    waiting = coro.send(sent)
                except StopIteration:
                    return
