"""The store as the event loop sees it: every operation of the SQLite or the Redis store,
awaited, and run in a small thread pool of its own; the event loop never makes a store call
itself, so a slow disk or a Redis that hangs or is paused holds up the calls waiting for
the store, never the loop (nor an urgent call, which needs no store).

Why threads around the synchronous stores rather than ``redis.asyncio``: one wrapper serves
both backends (SQLite has no asynchronous driver: it needs a thread anyway), the stores,
their Lua scripts and their socket timeouts stay as they are, and each operation runs whole.
An operation is several round trips or statements (a response's status and then its index,
a finalization's dozens); a coroutine cancelled between two of them would leave the first
done and the second not (and redis-py's asyncio client once mixed up replies after a
cancellation in the middle of one: CVE-2023-28858, -28859). A thread is not interrupted:

- A caller cancelled while its call waits for a thread: the call never runs.
- A caller cancelled while its call runs: the thread finishes it (until its end or its
  socket timeout: 2 s for small calls, 60 s for bulk ones) and its answer is dropped; the
  store is left as that call, uncancelled, would leave it. Lines it took stay running until
  a runner's ``recover`` sends them back (as when a process dies); a result it recorded is
  recorded once.

Bounded: a few threads (``threads`` for small calls, ``bulk_threads`` for files, a batch's
lines, a finalization), so a Redis that hangs holds those threads and no more, each for at
most its socket timeout. Calls beyond them wait, as coroutines, for a free thread: as many
as there are callers (a batch's ``max_in_flight`` lines, the background responses running,
the API calls in progress).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .redis_store import RedisStore
    from .sqlite import Store

    SyncStore = Store | RedisStore

T = TypeVar("T")
Line = tuple[int, str | None, bytes | None, str, bytes | None]
CLOSE_WAIT_S = 2.5  # a close waits this long for the calls running: a small one's timeout


class StoreClosed(RuntimeError):
    """A call after ``close`` (a request still in progress while the proxy stops)."""


class AsyncStore:
    def __init__(self, open_store: Callable[[], SyncStore], path: str, *, threads: int,
                 bulk_threads: int) -> None:
        """``open_store`` runs in a worker thread on the first call (SQLite creates its
        file there). ``bulk_threads`` 0: bulk calls share the small calls' threads (one
        SQLite connection in ``:memory:``, which must not be used by two threads at once)."""
        self.path = path
        self._open = open_store
        self._store: SyncStore | None = None
        self._opening = threading.Lock()
        self._small = ThreadPoolExecutor(threads, thread_name_prefix="store")
        self._bulk: Executor = self._small if bulk_threads == 0 else ThreadPoolExecutor(
            bulk_threads, thread_name_prefix="store-bulk")
        self._closed = False

    def _open_once(self) -> SyncStore:
        """In a worker thread: the store, opened once."""
        with self._opening:
            if self._store is None:
                self._store = self._open()
            return self._store

    async def _run(self, pool: Executor, operation: Callable[[SyncStore], T]) -> T:
        if self._closed:
            raise StoreClosed("the store is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: operation(self._open_once()))

    async def _small_call(self, operation: Callable[[SyncStore], T]) -> T:
        return await self._run(self._small, operation)

    async def close(self) -> None:
        """After the calls already queued; waits at most ``CLOSE_WAIT_S`` for them (a call
        on a Redis that hangs ends at its socket timeout, and the store closes then)."""
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            with self._opening:
                if self._store is not None:
                    self._store.close()

        closing = asyncio.get_running_loop().run_in_executor(self._small, close)
        for pool in {self._small, self._bulk}:
            pool.shutdown(wait=False)
        done, _ = await asyncio.wait([closing], timeout=CLOSE_WAIT_S)
        for future in done:
            future.result()

    # --- the store's operations (see ``proxy.store.sqlite`` for what each one does) -----

    async def size_bytes(self) -> int:
        return await self._small_call(lambda s: s.size_bytes())

    async def hold_runner(self, holder: str, now: float, ttl_s: float) -> bool:
        return await self._small_call(lambda s: s.hold_runner(holder, now, ttl_s))

    async def add_file(self, row: dict[str, Any], content: bytes) -> None:
        await self._run(self._bulk, lambda s: s.add_file(row, content))

    async def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        return await self._small_call(lambda s: s.file(file_id, owner))

    async def files(self, owner: str) -> list[dict[str, Any]]:
        return await self._small_call(lambda s: s.files(owner))

    async def file_content(self, file_id: str, owner: str) -> bytes | None:
        return await self._run(self._bulk, lambda s: s.file_content(file_id, owner))

    async def delete_file(self, file_id: str, owner: str) -> bool:
        return await self._small_call(lambda s: s.delete_file(file_id, owner))

    async def add_batch(self, batch_id: str, owner: str, created_at: int, status: str,
                        doc: str, lines: Iterable[Line]) -> None:
        await self._run(self._bulk, lambda s: s.add_batch(batch_id, owner, created_at,
                                                          status, doc, lines))

    async def batch(self, batch_id: str,
                    owner: str | None = None) -> tuple[str, str, str] | None:
        return await self._small_call(lambda s: s.batch(batch_id, owner))

    async def batches(self, owner: str, after: str | None, limit: int) -> list[str]:
        return await self._small_call(lambda s: s.batches(owner, after, limit))

    async def batches_with_status(self, statuses: Sequence[str]) -> list[str]:
        return await self._small_call(lambda s: s.batches_with_status(statuses))

    async def cancel_batch(self, batch_id: str, doc: str) -> bool:
        return await self._small_call(lambda s: s.cancel_batch(batch_id, doc))

    async def take_lines(self, batch_id: str, limit: int) -> list[tuple[int, str, bytes]]:
        return await self._small_call(lambda s: s.take_lines(batch_id, limit))

    async def finish_line(self, batch_id: str, index: int, status: str,
                          result: bytes) -> bool:
        return await self._small_call(lambda s: s.finish_line(batch_id, index, status, result))

    async def finalize(self, batch_id: str, outcome: str, now: int,
                       new_file_id: Callable[[], str],
                       unanswered_line: Callable[[str | None, str], bytes]) -> bool:
        return await self._run(self._bulk, lambda s: s.finalize(batch_id, outcome, now,
                                                                new_file_id, unanswered_line))

    async def counts(self, batch_id: str) -> dict[str, int]:
        return await self._small_call(lambda s: s.counts(batch_id))

    async def recover(self, batch_id: str) -> int:
        return await self._small_call(lambda s: s.recover(batch_id))

    async def add_response(self, response_id: str, owner: str, created_at: int,
                           request: bytes, doc: bytes) -> None:
        await self._small_call(lambda s: s.add_response(response_id, owner, created_at,
                                                        request, doc))

    async def response(self, response_id: str,
                       owner: str | None = None) -> tuple[str, bytes] | None:
        return await self._small_call(lambda s: s.response(response_id, owner))

    async def response_request(self, response_id: str) -> tuple[str, int, bytes] | None:
        return await self._small_call(lambda s: s.response_request(response_id))

    async def set_response(self, response_id: str, status: str, doc: bytes,
                           only_if: Sequence[str] = ()) -> bool:
        return await self._small_call(lambda s: s.set_response(response_id, status, doc,
                                                               only_if))

    async def responses_with_status(self, statuses: Sequence[str]) -> list[str]:
        return await self._small_call(lambda s: s.responses_with_status(statuses))

    async def summary(self) -> dict[str, dict[str, int]]:
        return await self._small_call(lambda s: s.summary())

    async def forget_before(self, created_at: int) -> int:
        """With the small calls: SQLite's runs on its shared connection."""
        return await self._small_call(lambda s: s.forget_before(created_at))
