"""The store in Redis, with ``state.backend: redis``: every replica serves every file,
batch and background response, and whichever replica holds the runner's lease runs them
(a dead one's lines are run again by the next). The same operations as the SQLite store,
each one command, a pipeline or a Lua script (a line is answered once: its result is
written only while it is running). A synchronous client, never called on the event loop:
every call runs in a worker thread of ``proxy.store.offloop.AsyncStore``.

Keys under ``{prefix}:work:`` — ``file:{id}`` (hash) and ``fdata:{id}``; ``files:{owner}``
and ``files`` (by time); ``batch:{id}`` (hash: owner, created_at, status, doc),
``batches:{owner}``, ``batches``, ``active`` (batches in progress or cancelling);
``lines:{batch}:{cid|body|status|result}`` (hashes by line index), ``:pending`` (sorted
set), ``:running`` (set), ``:counts``; ``resp:{id}`` (hash), ``responses``; ``runner``;
``bytes`` (of the files held).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import orjson
import redis

from ..config.state import StateSettings
from ..core.formats.batchdoc import FINISHED, request_counts
from .redis_scripts import CANCEL, END, FINISH, FORGET_FILE, HOLD, RECOVER, SET_RESPONSE, TAKE
from .sqlite import MAX_FILES_LISTED

CHUNK = 1000
LOADING_S = 86_400  # line keys of a batch still being loaded expire unless it completes
FINAL_CLAIM_S = 3600  # a finalization that died half-way is tried again after this
LOOP_TIMEOUT_S = 2.0
BULK_TIMEOUT_S = 60.0


class RedisStore:
    def __init__(self, settings: StateSettings) -> None:
        self.path = settings.shown_url
        self._p = settings.prefix + ":work:"
        # A Redis that hangs holds a thread running a small command for at most a few
        # seconds. Large ones (files, a batch's lines, a finalization) run on a client that
        # waits longer.
        self._r = redis.Redis.from_url(settings.url, socket_timeout=LOOP_TIMEOUT_S,
                                       socket_connect_timeout=LOOP_TIMEOUT_S)
        self._bulk = redis.Redis.from_url(settings.url, socket_timeout=BULK_TIMEOUT_S,
                                          socket_connect_timeout=LOOP_TIMEOUT_S)
        self._take = self._r.register_script(TAKE)
        self._finish = self._r.register_script(FINISH)
        self._recover = self._r.register_script(RECOVER)
        self._hold = self._r.register_script(HOLD)
        self._set_response = self._r.register_script(SET_RESPONSE)
        self._end = self._r.register_script(END)
        self._cancel = self._r.register_script(CANCEL)
        self._forget = self._r.register_script(FORGET_FILE)
        self.holder = ""  # the runner this process is, if it holds the lease

    def close(self) -> None:
        self._r.close()
        self._bulk.close()

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    def _lines(self, batch_id: str, part: str) -> str:
        return self._k("lines", batch_id, part)

    def size_bytes(self) -> int:
        return int(cast(bytes | None, self._r.get(self._k("bytes"))) or 0)

    def hold_runner(self, holder: str, now: float, ttl_s: float) -> bool:
        self.holder = holder
        return bool(self._hold(keys=[self._k("runner")], args=[holder, int(ttl_s * 1000)]))

    # --- files ---------------------------------------------------------------------------

    def add_file(self, row: dict[str, Any], content: bytes) -> None:
        """In a worker thread: up to ``max_file_bytes``."""
        file_id, owner = row["id"], row["owner"]
        pipe = self._bulk.pipeline()
        pipe.hset(self._k("file", file_id), mapping={
            "owner": owner, "purpose": row["purpose"], "filename": row["filename"],
            "bytes": len(content), "created_at": row["created_at"]})
        pipe.set(self._k("fdata", file_id), content)
        pipe.zadd(self._k("files", owner), {file_id: row["created_at"]})
        pipe.zadd(self._k("files"), {file_id: row["created_at"]})
        pipe.incrby(self._k("bytes"), len(content))
        pipe.execute()

    def file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        found = cast(dict[bytes, bytes], self._r.hgetall(self._k("file", file_id)))
        if not found or found[b"owner"].decode() != owner:
            return None
        return {"id": file_id, "purpose": found[b"purpose"].decode(),
                "filename": found[b"filename"].decode(), "bytes": int(found[b"bytes"]),
                "created_at": int(found[b"created_at"])}

    def files(self, owner: str) -> list[dict[str, Any]]:
        ids = cast(list[bytes], self._r.zrevrange(self._k("files", owner), 0,
                                                  MAX_FILES_LISTED - 1))
        return [f for f in (self.file(i.decode(), owner) for i in ids) if f is not None]

    def file_content(self, file_id: str, owner: str) -> bytes | None:
        """In a worker thread: up to ``max_file_bytes``."""
        if self.file(file_id, owner) is None:
            return None
        return cast(bytes | None, self._bulk.get(self._k("fdata", file_id)))

    def delete_file(self, file_id: str, owner: str) -> bool:
        found = self.file(file_id, owner)
        if found is None:
            return False
        self._forget_file(file_id, owner, found["bytes"])
        return True

    def _forget_file(self, file_id: str, owner: str, size: int) -> None:
        del size  # read again inside the script: counted once
        self._forget(keys=[self._k("file", file_id), self._k("fdata", file_id),
                           self._k("files", owner), self._k("files"), self._k("bytes")],
                     args=[file_id])

    # --- batches ------------------------------------------------------------------------

    def add_batch(self, batch_id: str, owner: str, created_at: int, status: str, doc: str,
                  lines: Iterable[tuple[int, str | None, bytes | None, str, bytes | None]]
                  ) -> None:
        """In a worker thread: the lines first, then the batch (which makes them live)."""
        counts: dict[str, int] = {}
        size = 0
        parts = [self._lines(batch_id, part) for part in ("cid", "status", "body", "result",
                                                          "pending", "counts")]
        pipe = self._bulk.pipeline(transaction=False)
        for n, (index, custom_id, body, line_status, result) in enumerate(lines, 1):
            size += len(body or b"") + len(result or b"")
            pipe.hset(self._lines(batch_id, "cid"), str(index), custom_id or "")
            pipe.hset(self._lines(batch_id, "status"), str(index), line_status)
            if body is not None:
                pipe.hset(self._lines(batch_id, "body"), mapping={str(index): body})
            if result is not None:
                pipe.hset(self._lines(batch_id, "result"), mapping={str(index): result})
            if line_status == "pending":
                pipe.zadd(self._lines(batch_id, "pending"), {str(index): index})
            counts[line_status] = counts.get(line_status, 0) + 1
            if n % CHUNK == 0:
                for key in parts:  # a load that dies half-way leaves nothing for good
                    pipe.expire(key, LOADING_S)
                pipe.execute()
        if counts:
            pipe.hset(self._lines(batch_id, "counts"), mapping=counts)
        pipe.execute()
        pipe = self._bulk.pipeline()
        for key in parts:
            pipe.persist(key)
        pipe.incrby(self._k("bytes"), size)
        pipe.hset(self._k("batch", batch_id), mapping={
            "owner": owner, "created_at": created_at, "status": status, "doc": doc,
            "bytes": size})
        pipe.zadd(self._k("batches", owner), {batch_id: created_at})
        pipe.zadd(self._k("batches"), {batch_id: created_at})
        pipe.zadd(self._k("active"), {batch_id: created_at})
        pipe.execute()

    def _fields(self, key: str, names: list[str], owner: str | None) -> list[bytes] | None:
        """``names`` of a hash whose last is its owner; None if one is missing or the
        owner is not ``owner`` (when given)."""
        found = cast(list[bytes | None], self._r.hmget(key, names))
        if any(value is None for value in found):
            return None
        if owner is not None and cast(bytes, found[-1]).decode() != owner:
            return None
        return cast(list[bytes], found)

    def batch(self, batch_id: str, owner: str | None = None) -> tuple[str, str, str] | None:
        found = self._fields(self._k("batch", batch_id), ["status", "doc", "owner"], owner)
        return None if found is None else (found[0].decode(), found[1].decode(),
                                           found[2].decode())

    def batches(self, owner: str, after: str | None, limit: int) -> list[str]:
        key = self._k("batches", owner)
        start = 0
        if after is not None:
            rank = self._r.zrevrank(key, after)
            if rank is None:
                return []
            start = int(cast(int, rank)) + 1
        ids = cast(list[bytes], self._r.zrevrange(key, start, start + limit - 1))
        docs = [self.batch(i.decode()) for i in ids]
        return [d[1] for d in docs if d is not None]

    def batches_with_status(self, statuses: Sequence[str]) -> list[str]:
        ids = [i.decode() for i in cast(list[bytes], self._r.zrange(self._k("active"), 0, -1))]
        found = [(i, self.batch(i)) for i in ids]
        return [i for i, b in found if b is not None and b[0] in statuses]

    def cancel_batch(self, batch_id: str, doc: str) -> bool:
        created = self._r.hget(self._k("batch", batch_id), "created_at") or b"0"
        return bool(self._cancel(keys=[self._k("batch", batch_id), self._k("active")],
                                 args=[doc, batch_id, int(cast(bytes, created))]))

    # --- lines --------------------------------------------------------------------------

    def take_lines(self, batch_id: str, limit: int) -> list[tuple[int, str, bytes]]:
        keys = [self._lines(batch_id, part)
                for part in ("pending", "status", "running", "counts", "cid", "body")]
        flat = cast(list[bytes], self._take(keys=[*keys, self._k("runner")],
                                            args=[limit, self.holder]))
        return [(int(flat[i]), flat[i + 1].decode(), flat[i + 2])
                for i in range(0, len(flat), 3)]

    def finish_line(self, batch_id: str, index: int, status: str, result: bytes) -> bool:
        keys = [self._lines(batch_id, part)
                for part in ("running", "status", "result", "body", "counts")]
        return bool(self._finish(keys=[*keys, self._k("runner")],
                                 args=[index, status, result, self.holder]))

    def counts(self, batch_id: str) -> dict[str, int]:
        raw = cast(dict[bytes, bytes], self._r.hgetall(self._lines(batch_id, "counts")))
        return {k.decode(): int(v) for k, v in raw.items() if int(v)}

    def recover(self, batch_id: str) -> int:
        keys = [self._lines(batch_id, part) for part in ("running", "pending", "status",
                                                         "counts")]
        return int(cast(int, self._recover(keys=keys)))

    def finalize(self, batch_id: str, outcome: str, now: int, new_file_id: Callable[[], str],
                 unanswered_line: Callable[[str | None, str], bytes]) -> bool:
        """In a worker thread. Once: the first to claim the batch's end does it (a claim
        that lapses lets another finish a finalization that died half-way)."""
        if self._r.get(self._k("runner")) != self.holder.encode():
            return False  # this runner lost its lease: the next one ends the batch
        if not self._r.set(self._k("final", batch_id), 1, nx=True, ex=FINAL_CLAIM_S):
            return False
        found = self.batch(batch_id)
        if found is None or found[0] in FINISHED:
            return False
        status = "failed" if outcome == "completed" else outcome
        left = [i.decode() for i in cast(list[bytes], self._bulk.zrange(
            self._lines(batch_id, "pending"), 0, -1))]
        left += [i.decode() for i in cast(set[bytes], self._bulk.smembers(
            self._lines(batch_id, "running")))]
        keys = [self._lines(batch_id, part) for part in ("pending", "running", "status",
                                                         "result", "body", "counts")]
        for at in range(0, len(left), CHUNK):
            chunk = left[at:at + CHUNK]
            cids = cast(list[bytes | None], self._bulk.hmget(self._lines(batch_id, "cid"),
                                                             chunk))
            args: list[Any] = [status]
            for index, cid in zip(chunk, cids, strict=True):
                args += [index, unanswered_line((cid or b"").decode() or None, status)]
            self._end(keys=keys, args=args)
        statuses = cast(dict[bytes, bytes], self._bulk.hgetall(self._lines(batch_id,
                                                                           "status")))
        results = cast(dict[bytes, bytes], self._bulk.hgetall(self._lines(batch_id,
                                                                          "result")))
        doc = orjson.loads(found[1])
        doc["finalizing_at"] = doc["finalizing_at"] or now
        for field, kinds, suffix in (("output_file_id", (b"done",), "output"),
                                     ("error_file_id", (b"failed", b"expired", b"cancelled"),
                                      "error")):
            rows = [results[i] for i in sorted(results, key=int)
                    if statuses.get(i) in kinds]
            if rows:
                doc[field] = new_file_id()
                self.add_file({"id": doc[field], "owner": found[2], "purpose": "batch_output",
                               "filename": f"{batch_id}_{suffix}.jsonl", "created_at": now},
                              b"\n".join(rows) + b"\n")
        doc["request_counts"] = request_counts(doc["request_counts"]["total"],
                                               self.counts(batch_id))
        doc["status"] = outcome
        doc[f"{outcome}_at"] = now
        pipe = self._r.pipeline()
        pipe.hset(self._k("batch", batch_id), mapping={"status": outcome,
                                                       "doc": orjson.dumps(doc).decode()})
        pipe.zrem(self._k("active"), batch_id)
        pipe.execute()
        return True

    # --- background responses -----------------------------------------------------------

    def add_response(self, response_id: str, owner: str, created_at: int,
                     request: bytes, doc: bytes) -> None:
        pipe = self._r.pipeline()
        pipe.hset(self._k("resp", response_id), mapping={
            "owner": owner, "created_at": created_at, "status": "queued", "request": request,
            "result": doc})
        pipe.zadd(self._k("responses"), {response_id: created_at})
        pipe.zadd(self._k("live"), {response_id: created_at})  # queued or in progress
        pipe.incrby(self._k("bytes"), len(request) + len(doc))
        pipe.execute()

    def response(self, response_id: str, owner: str | None = None) -> tuple[str, bytes] | None:
        found = self._fields(self._k("resp", response_id), ["status", "result", "owner"],
                             owner)
        return None if found is None else (found[0].decode(), found[1])

    def response_request(self, response_id: str) -> tuple[str, int, bytes] | None:
        found = self._fields(self._k("resp", response_id), ["created_at", "request", "owner"],
                             None)
        return None if found is None else (found[2].decode(), int(found[0]), found[1])

    def set_response(self, response_id: str, status: str, doc: bytes,
                     only_if: Sequence[str] = ()) -> bool:
        done = bool(self._set_response(keys=[self._k("resp", response_id)],
                                       args=[status, doc, *only_if]))
        if done and status in FINISHED:
            self._r.zrem(self._k("live"), response_id)
        return done

    def responses_with_status(self, statuses: Sequence[str]) -> list[str]:
        """Among the live ones (queued, in progress): those in ``statuses``."""
        ids = [i.decode() for i in cast(list[bytes], self._r.zrange(self._k("live"), 0, -1))]
        pipe = self._r.pipeline(transaction=False)
        for response_id in ids:
            pipe.hget(self._k("resp", response_id), "status")
        return [i for i, status in zip(ids, pipe.execute(), strict=True)
                if status is not None and status.decode() in statuses]

    def summary(self) -> dict[str, dict[str, int]]:
        """Batches and responses by status, lines of the batches in progress by status (one
        pipelined round trip each)."""
        shown: dict[str, dict[str, int]] = {"batches": {}, "responses": {}, "lines": {}}
        for name, index, key in (("batches", "batches", "batch"),
                                 ("responses", "responses", "resp")):
            pipe = self._r.pipeline(transaction=False)
            for raw in cast(list[bytes], self._r.zrange(self._k(index), 0, -1)):
                pipe.hget(self._k(key, raw.decode()), "status")
            for status in pipe.execute():
                if status is not None:
                    shown[name][status.decode()] = shown[name].get(status.decode(), 0) + 1
        for batch_id in cast(list[bytes], self._r.zrange(self._k("active"), 0, -1)):
            for status, n in self.counts(batch_id.decode()).items():
                shown["lines"][status] = shown["lines"].get(status, 0) + n
        return shown

    def forget_before(self, created_at: int) -> int:
        """Finished batches (and lines), files and finished responses created before
        ``created_at`` (UNLINK: freed off Redis' main thread); their bytes are uncounted."""
        gone = 0
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("batches"), "-inf",
                                                           f"({created_at}")):
            batch_id = raw.decode()
            meta = cast(list[bytes | None], self._r.hmget(self._k("batch", batch_id),
                                                          ["status", "owner", "bytes"]))
            if meta[0] is not None and meta[0].decode() not in FINISHED:
                continue
            if self._r.delete(self._k("batch", batch_id)):  # once, whoever else forgets it
                self._r.decrby(self._k("bytes"), int(meta[2] or 0))
            self._r.unlink(self._k("final", batch_id), *(self._lines(batch_id, part) for part in (
                "cid", "body", "status", "result", "pending", "running", "counts")))
            self._r.zrem(self._k("batches"), batch_id)
            if meta[1] is not None:
                self._r.zrem(self._k("batches", meta[1].decode()), batch_id)
            gone += 1
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("files"), "-inf",
                                                           f"({created_at}")):
            owner = cast(bytes | None, self._r.hget(self._k("file", raw.decode()), "owner"))
            self._forget_file(raw.decode(), (owner or b"").decode(), 0)
            gone += 1
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("responses"), "-inf",
                                                           f"({created_at}")):
            key = self._k("resp", raw.decode())
            meta = cast(list[bytes | None], self._r.hmget(key, ["status", "request",
                                                                "result"]))
            if meta[0] is not None and meta[0].decode() not in FINISHED:
                continue
            if self._r.delete(key):
                self._r.decrby(self._k("bytes"), len(meta[1] or b"") + len(meta[2] or b""))
            self._r.zrem(self._k("responses"), raw)
            self._r.zrem(self._k("live"), raw)
            gone += 1
        return gone
