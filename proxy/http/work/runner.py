"""Work that can wait, run by the proxy itself in the capacity urgent work leaves idle.

Each batch line and each background response is a call of the batch tier sent through
this very proxy (over loopback, on behalf of the key that owns it, with the process's
internal token; by the client provider calls use, ``wire``, never through an egress
proxy): the same classification, routing, limits, breakers, metrics and access
log as any call, and only the capacity more urgent tiers leave. At most ``max_in_flight``
lines of a batch are calls at once; the rest wait in the store, so a million-line file
costs the memory of its window. A call the proxy itself turns away (429, 5xx: the queue
was long, every provider down) is tried again after a backoff until the batch's window
ends; an answer (2xx, or the upstream's 4xx) is recorded once.

Everything is in the store first. One process runs the work (the runner's lease, in the
store); lines a runner left running when it stopped run again under the next (sent again,
answered once).
Every store call is awaited (``proxy.store.offloop``): none runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from ...config import Config
from ...core.clock import Clock
from ...core.errors import StorageFull
from ...core.formats.batchdoc import (
    background_path,
    error_line,
    output_line,
    request_counts,
    response_doc,
)
from ...store import AsyncStore, open_store, store_errors
from ..base.metrics import Metrics
from .loopback import RETRY_MIN_S, Loopback, batch_tier

log = logging.getLogger(__name__)

TURN_S = 1.0  # a running batch looks at its status (a cancel from another worker) this often
RESPONSE_WINDOW_S = 24 * 3600  # a background response is tried again for at most this
RETENTION_EVERY_S = 3600.0
HEAVY_AT_ONCE = 2
LEAD_EVERY_S = 1.0  # the runner's lease is renewed, and new work looked for, this often
LEASE_S = 5.0  # a runner that stopped renewing is replaced after this
STATUS_WAIT_S = 0.25  # what /admin/status waits for the store's figures


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class Work:
    def __init__(self, config: Config, clock: Clock, token: str, metrics: Metrics,
                 owner_of: Callable[[Mapping[str, str]], str],
                 serves: Callable[[str], bool]) -> None:
        """``owner_of``: the name of the key a request's headers authenticate (raises
        InvalidApiKey); ``serves``: whether a public model name is in the routing table.
        Both follow reloads, as the call path's own do."""
        self.config = config
        self.owner_of = owner_of
        self.serves = serves
        self.metrics = metrics
        self.clock = clock
        self._token = token
        self._store: AsyncStore | None = None
        self.errors = store_errors(config.state.backend == "redis")
        self._tasks: dict[str, asyncio.Task[None]] = {}  # batch or response id → its run
        self._loopback: Loopback | None = None  # this proxy's own listener
        self._janitor: asyncio.Task[None] | None = None
        self._leader: asyncio.Task[None] | None = None
        self._me = new_id("runner-")
        self.leading = False  # this process holds the lease on running the work
        # Uploads, batch creations and file reads each hold up to max_file_bytes: a few at once.
        self.heavy = asyncio.Semaphore(HEAVY_AT_ONCE)
        self.base_url: str | None = None  # where this proxy listens (set once it does)
        self.stored_bytes = 0  # the store's size when last read (every second, by the lead)
        self.metrics.storage_bytes.set_function(lambda: self.stored_bytes)

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def opened(self) -> bool:
        return self._store is not None

    def exists(self) -> bool:
        """The store is there (Redis; a file from this process or an earlier one)."""
        if self.config.state.backend == "redis":
            return True
        path = self.config.storage.path
        return path != ":memory:" and Path(path).exists()

    def store(self) -> AsyncStore:
        """The store, opened by its first call (a proxy that never gets such work writes
        no file): SQLite, or Redis with the redis state backend (shared by every replica)."""
        if self._store is None:
            self._store = open_store(self.config)
            self._janitor = asyncio.ensure_future(self._forget_old())
        return self._store

    async def start(self, base_url: str) -> None:
        """Listening at ``base_url``: run the work (this process, or whichever worker of
        ``serve --workers`` holds the lease), resuming what a previous process left."""
        self.base_url = base_url.rstrip("/")
        self._loopback = Loopback(self.base_url, self._token, self.config, self.clock)
        await self._lead()
        self._leader = asyncio.ensure_future(self._lead_forever())

    async def _lead_forever(self) -> None:
        while True:
            await asyncio.sleep(LEAD_EVERY_S)
            await self._lead()

    async def _lead(self) -> None:
        """Take or keep the lease on running the work, and run what is there to run: work
        another worker took in, or a dead holder left. The safety sweep of ``--workers``
        (a process is not told when another one stores work)."""
        if self._store is None and not self.exists():
            return
        store = self.store()
        try:
            self.leading = await store.hold_runner(self._me, self.clock.wall(), LEASE_S)
            await self.size_bytes()
            if not self.leading:
                return
            for batch_id in await store.batches_with_status(("in_progress", "cancelling")):
                self.run_batch(batch_id)
            for response_id in await store.responses_with_status(("queued", "in_progress")):
                self.run_response(response_id)
        except self.errors as exc:  # tried again in a second
            log.warning("work that can wait: the store is unavailable (%s)", exc)

    async def close(self) -> None:
        """Stop running (what was running stays marked so, and runs again at the next
        start, or in the worker that takes the lease over)."""
        tasks = [*self._tasks.values(), *(t for t in (self._janitor, self._leader) if t)]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._loopback is not None:
            await self._loopback.close()
        if self._store is not None:
            await self._store.close()

    async def check_room(self, incoming: int) -> None:
        max_bytes = self.config.storage.max_bytes
        if await self.size_bytes() + incoming > max_bytes:
            raise StorageFull(f"The proxy's storage is full ({max_bytes} bytes); delete files or "
                              "wait for finished work to expire.")

    async def size_bytes(self) -> int:
        """The store's size now (kept for ``proxy_storage_bytes``, which reads no store)."""
        self.stored_bytes = await self.store().size_bytes()
        return self.stored_bytes

    async def running(self) -> list[dict[str, object]]:
        """The batches in progress (or being cancelled), oldest first, with their counts."""
        try:
            return await self._running()
        except self.errors:
            return []

    async def _running(self) -> list[dict[str, object]]:
        store = self._store
        if store is None:
            return []
        shown = []
        for batch_id in await store.batches_with_status(("in_progress", "cancelling")):
            found = await store.batch(batch_id)
            if found is None:
                continue
            doc = orjson.loads(found[1])
            counts = request_counts(doc["request_counts"]["total"],
                                    await store.counts(batch_id))
            shown.append({"id": batch_id, "owner": found[2], "status": found[0],
                          "endpoint": doc["endpoint"], "created_at": doc["created_at"],
                          "expires_at": doc["expires_at"], **counts})
        return shown

    async def status(self) -> dict[str, object]:
        """For ``/admin/status``: the store's size and what it holds, what runs now."""
        storage = self.config.storage
        shown: dict[str, object] = {
            "path": storage.path if self._store is None else self._store.path,
            "bytes": self.stored_bytes, "max_bytes": storage.max_bytes,
            "running": sorted(self._tasks), "tier": batch_tier(self.config)}
        if self._store is not None:
            try:  # a paused or slow store must not hold the status page up
                async with asyncio.timeout(STATUS_WAIT_S):
                    shown["bytes"] = await self.size_bytes()
                    shown.update(await self._store.summary())
            except TimeoutError:
                shown["error"] = f"the store did not answer within {STATUS_WAIT_S} s"
            except self.errors as exc:
                shown["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return shown

    async def _forget_old(self) -> None:
        while True:
            cutoff = self.clock.wall() - self.config.batch.retention_days * 86400
            try:
                gone = await self.store().forget_before(int(cutoff))
            except self.errors as exc:
                log.warning("work that can wait: retention skipped (%s)", exc)
                gone = 0
            if gone:
                log.info("work that can wait: %d rows past retention deleted", gone)
            await asyncio.sleep(RETENTION_EVERY_S)

    # --- batches ------------------------------------------------------------------------

    async def _answer_of(self, owner: str, path: str, body: bytes, request_id: str,
                         until: float) -> tuple[int, bytes] | None:
        while self._loopback is None:  # not listening yet: wait, as for a refusal
            if self.clock.wall() + RETRY_MIN_S >= until:
                return None
            await asyncio.sleep(RETRY_MIN_S)
        return await self._loopback.answer(owner, path, body, request_id, until)

    def run_batch(self, batch_id: str) -> None:
        """Run it here if this process runs the work (else the runner finds it)."""
        if self.leading and batch_id not in self._tasks:
            self._start(batch_id, self._recover_and_run)

    async def _recover_and_run(self, batch_id: str) -> None:
        # Nothing here runs it, and nothing else may: what it left running (a runner that
        # died, or this one's run that the store failed) runs again.
        again = await self.store().recover(batch_id)
        if again:
            log.warning("batch %s: %d lines were left running; they run again", batch_id,
                        again)
        await self._run_batch(batch_id)

    def _start(self, work_id: str, run: Callable[[str], Awaitable[None]]) -> None:
        """Run ``run(work_id)`` as the one task for that batch or response."""
        task = self._tasks[work_id] = asyncio.ensure_future(self._survive(work_id, run))
        task.add_done_callback(lambda _: self._tasks.pop(work_id, None))

    async def _survive(self, work_id: str, run: Callable[[str], Awaitable[None]]) -> None:
        try:
            await run(work_id)
        except self.errors as exc:  # the lead loop starts it again once the store is back
            log.warning("%s: stopped, the store is unavailable (%s)", work_id, exc)

    async def _run_batch(self, batch_id: str) -> None:
        store = self.store()
        found = await store.batch(batch_id)
        if found is None:
            return
        _, text, owner = found
        doc: dict[str, Any] = orjson.loads(text)
        expires_at = float(doc["expires_at"])
        running: set[asyncio.Task[None]] = set()
        outcome = "completed"
        try:
            while True:
                if not self.leading:  # another runner has it now (this one stalled)
                    return
                status = await store.batch(batch_id)
                if status is None or status[0] == "cancelling":  # cancelled, on any worker
                    outcome = "cancelled"
                    break
                if self.clock.wall() >= expires_at:
                    outcome = "expired"
                    break
                room = self.config.batch.max_in_flight - len(running)
                taken = await store.take_lines(batch_id, room) if room else []
                for index, custom_id, body in taken:
                    running.add(asyncio.ensure_future(self._line(
                        batch_id, owner, doc["endpoint"], index, custom_id, body, expires_at)))
                if not running:
                    break
                timeout = min(max(expires_at - self.clock.wall(), 0.05), TURN_S)
                done, running = await asyncio.wait(running, timeout=timeout,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        log.error("batch %s: a line failed unexpectedly", batch_id,
                                  exc_info=task.exception())
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)
        await store.finalize(batch_id, outcome, int(self.clock.wall()), lambda: new_id("file-"),
                             _unanswered_line)

    async def _line(self, batch_id: str, owner: str, endpoint: str, index: int,
                    custom_id: str, body: bytes, until: float) -> None:
        line_id = new_id("batch_req_")
        answer = await self._answer_of(owner, endpoint, body, line_id, until)
        if answer is None:  # turned away until the window's end
            await self.store().finish_line(batch_id, index, "expired",
                                           _unanswered_line(custom_id, "expired"))
            return
        status, data = answer
        try:
            parsed: object = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = data.decode("utf-8", "replace")
        result = output_line(line_id, custom_id, status, line_id, parsed)
        outcome = "done" if status < 300 else "failed"
        if await self.store().finish_line(batch_id, index, outcome, result):
            self.metrics.batch_lines.get(outcome).inc()

    # --- background responses -----------------------------------------------------------

    def run_response(self, response_id: str) -> None:
        if response_id not in self._tasks:
            self._start(response_id, self._run_response)

    def cancel_response(self, response_id: str) -> None:
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()

    async def _run_response(self, response_id: str) -> None:
        store = self.store()
        found = await store.response_request(response_id)
        if found is None:
            return
        owner, created, request = found
        asked = orjson.loads(request)

        def doc(status: str, **extra: Any) -> bytes:
            return orjson.dumps(response_doc(response_id, created, status, asked, **extra))

        live = ("queued", "in_progress")
        if not await store.set_response(response_id, "in_progress", doc("in_progress"),
                                        only_if=live):
            return
        answer = await self._answer_of(owner, background_path(response_id), request, response_id,
                                    created + RESPONSE_WINDOW_S)
        if answer is None:
            await store.set_response(response_id, "failed", doc("failed", error={
                "code": "expired", "message": "No provider answered within 24 hours."}),
                only_if=live)
            return
        status, data = answer
        parsed: Any = None
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(data)
        if status < 300 and isinstance(parsed, dict):
            await store.set_response(response_id, "completed", doc(
                str(parsed.get("status") or "completed"), answer=parsed), only_if=live)
            return
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if not isinstance(error, dict):
            error = {"code": "upstream_error", "message": f"status {status}"}
        await store.set_response(response_id, "failed", doc("failed", error={
            "code": str(error.get("code") or "upstream_error"),
            "message": str(error.get("message") or "")}), only_if=live)


_ENDINGS = {
    "expired": ("batch_expired", "The line did not run before the batch's completion window "
                "ended."),
    "cancelled": ("batch_cancelled", "The batch was cancelled before the line ran."),
    "failed": ("not_run", "The line could not be run."),
}


def _unanswered_line(custom_id: str | None, status: str) -> bytes:
    """The error line of a line that ended unanswered."""
    code, message = _ENDINGS[status]
    return error_line(new_id("batch_req_"), custom_id, code, message)


WORK = web.AppKey("work", Work)  # batches and background responses
