"""The soak's Batch API work (scripts/soak.py): one batch at a time, the next created when
the last one ends, each followed until it ends; then its output and error files must
answer every line once. A batch whose store went with a Redis restarted empty is
``lost``, counted apart (the store of work is in Redis with ``state.backend: redis``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from soak_load import KEYS

HEADERS = {"Authorization": f"Bearer {KEYS['k-batch']}"}
TERMINAL = ("completed", "expired", "cancelled", "failed")
MALFORMED = 1  # one line of each batch is not JSON: answered in the error file, no custom_id


@dataclass
class Batch:
    n: int
    lines: int
    created: float
    id: str = ""
    ended: float | None = None
    status: str = ""
    result: str = ""  # whole | lost | unfinished | wrong | refused
    counts: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    detail: str = ""


class TryAgain(Exception):
    pass


class Batches:
    def __init__(self, pick: Callable[[], tuple[int, int, str] | None], lines: int,
                 redis_restarts: list[float]) -> None:
        self.pick = pick
        self.lines = lines
        self.redis_restarts = redis_restarts
        self.batches: list[Batch] = []
        self.numbers = itertools.count()
        self.stop = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None

    async def _http(self, method: str, path: str, **kw: Any) -> tuple[int, bytes]:
        chosen = self.pick()
        if chosen is None:
            raise TryAgain("no replica up")
        assert self.session is not None
        try:
            async with self.session.request(method, chosen[2] + path, headers=HEADERS,
                                            **kw) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise TryAgain(f"{type(exc).__name__}: {exc}") from exc

    async def _retrying(self, method: str, path: str, deadline: float,
                        **kw: Any) -> tuple[int, bytes]:
        while True:
            try:
                status, body = await self._http(method, path, **kw)
                if status not in (502, 503, 504):
                    return status, body
            except TryAgain:
                pass
            if time.monotonic() > deadline:
                raise TryAgain(f"{method} {path}: no answer before the deadline")
            await asyncio.sleep(1.0)

    def _input(self, n: int) -> bytes:
        rows = [orjson.dumps({
            "custom_id": f"b{n}-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "chat", "max_tokens": 6, "messages": [
                {"role": "user", "content": f"[k-batch] b{n}-{i} a batch line"}]}})
            for i in range(self.lines)]
        rows.insert(self.lines // 2, b"{not json")
        return b"\n".join(rows) + b"\n"

    async def run(self, tail_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as self.session:
            while not self.stop.is_set():
                batch = Batch(next(self.numbers), self.lines, time.monotonic())
                self.batches.append(batch)
                await self._one(batch, tail_s)

    async def _one(self, batch: Batch, tail_s: float) -> None:
        deadline = time.monotonic() + 60
        try:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", self._input(batch.n), filename=f"soak{batch.n}.jsonl",
                           content_type="application/jsonl")
            status, body = await self._retrying("POST", "/v1/files", deadline, data=form)
            if status != 200:
                batch.result, batch.detail = "refused", f"upload {status}: {body[:200]!r}"
                return
            file_id = orjson.loads(body)["id"]
            status, body = await self._retrying(
                "POST", "/v1/batches", deadline, json={
                    "input_file_id": file_id, "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})
            if status != 200:
                batch.result = "lost" if self._restarted_since(batch) else "refused"
                batch.detail = f"create {status}: {body[:200]!r}"
                return
            batch.id = orjson.loads(body)["id"]
            await self._follow(batch, tail_s)
        except TryAgain as exc:
            batch.result, batch.detail = "unfinished", str(exc)

    def _restarted_since(self, batch: Batch) -> bool:
        return any(t >= batch.created for t in self.redis_restarts)

    async def _follow(self, batch: Batch, tail_s: float) -> None:
        stopped_at: float | None = None
        while True:
            now = time.monotonic()
            if self.stop.is_set():
                stopped_at = stopped_at or now
                if now - stopped_at > tail_s:
                    batch.result, batch.detail = "unfinished", f"not done {tail_s:.0f} s " \
                        "after the load stopped"
                    return
            status, body = await self._retrying("GET", f"/v1/batches/{batch.id}",
                                                now + 60)
            if status == 404 and self._restarted_since(batch):
                batch.result, batch.detail = "lost", "gone with Redis' data (restart empty)"
                return
            if status != 200:
                batch.result, batch.detail = "wrong", f"GET {status}: {body[:200]!r}"
                return
            found = orjson.loads(body)
            batch.status, batch.counts = found["status"], found.get("request_counts") or {}
            if batch.status in TERMINAL:
                batch.ended = time.monotonic()
                await self._check(batch, found)
                return
            await asyncio.sleep(1.0)

    async def _check(self, batch: Batch, found: dict[str, Any]) -> None:
        rows: list[dict[str, Any]] = []
        for file_id in (found.get("output_file_id"), found.get("error_file_id")):
            if not file_id:
                continue
            status, body = await self._retrying("GET", f"/v1/files/{file_id}/content",
                                                time.monotonic() + 60)
            if status == 404 and self._restarted_since(batch):
                batch.result, batch.detail = "lost", "files gone with Redis' data"
                return
            if status != 200:
                batch.result, batch.detail = "wrong", f"file {status}: {body[:200]!r}"
                return
            rows += [orjson.loads(line) for line in body.splitlines() if line.strip()]
        seen = Counter(str(row.get("custom_id")) for row in rows
                       if row.get("custom_id") is not None)
        nameless = sum(1 for row in rows if row.get("custom_id") is None)
        expected = {f"b{batch.n}-{i}" for i in range(batch.lines)}
        batch.missing = sorted(expected - set(seen))
        batch.twice = sorted(i for i, c in seen.items() if c > 1)
        batch.unknown = sorted(set(seen) - expected)
        whole = (batch.status == "completed" and not batch.missing and not batch.twice
                 and not batch.unknown and nameless == MALFORMED)
        batch.result = "whole" if whole else "wrong"
        if not whole:
            batch.detail = (f"status {batch.status}, {len(batch.missing)} missing, "
                            f"{len(batch.twice)} twice, {len(batch.unknown)} unknown, "
                            f"{nameless} rows without custom_id (expected {MALFORMED})")
