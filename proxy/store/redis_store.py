"""The store in Redis, with ``state.backend: redis``: every replica serves every file,
batch and background response, and whichever replica holds the runner's lease runs them
(a dead one's lines are run again by the next). The same operations as the SQLite store,
each one command, a pipeline or a Lua script (a line is answered once: its result is
written only while it is running). A synchronous client: like SQLite's statements, each
call is one loopback round trip on the event loop; large ones run in worker threads.

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
from ..core.batchdoc import request_counts
from .sqlite import FINISHED, MAX_FILES_LISTED

TAKE = """
local popped = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
local out = {}
for i = 1, #popped, 2 do
  local idx = popped[i]
  redis.call('HSET', KEYS[2], idx, 'running')
  redis.call('SADD', KEYS[3], idx)
  redis.call('HINCRBY', KEYS[4], 'pending', -1)
  redis.call('HINCRBY', KEYS[4], 'running', 1)
  out[#out + 1] = idx
  out[#out + 1] = redis.call('HGET', KEYS[5], idx) or ''
  out[#out + 1] = redis.call('HGET', KEYS[6], idx) or ''
end
return out
"""
# KEYS: running, status, result, body, counts. ARGV: index, status, result.
FINISH = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], 'running', -1)
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
return 1
"""
# KEYS: running, pending, status, counts: every running line back to pending.
RECOVER = """
local running = redis.call('SMEMBERS', KEYS[1])
for _, idx in ipairs(running) do
  redis.call('ZADD', KEYS[2], tonumber(idx), idx)
  redis.call('HSET', KEYS[3], idx, 'pending')
end
if #running > 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HINCRBY', KEYS[4], 'running', 0 - #running)
  redis.call('HINCRBY', KEYS[4], 'pending', #running)
end
return #running
"""
HOLD = """
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# KEYS: resp hash. ARGV: status, doc, then the statuses it may move from (none: any).
SET_RESPONSE = """
if #ARGV > 2 then
  local now = redis.call('HGET', KEYS[1], 'status')
  local ok = false
  for i = 3, #ARGV do if now == ARGV[i] then ok = true end end
  if not ok then return 0 end
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'result', ARGV[2])
return 1
"""
CHUNK = 1000
LOOP_TIMEOUT_S = 2.0
BULK_TIMEOUT_S = 60.0


class RedisStore:
    def __init__(self, settings: StateSettings) -> None:
        self.path = settings.shown_url
        self._p = settings.prefix + ":work:"
        # Small commands on the event loop: a Redis that hangs costs the loop at most a few
        # seconds. Large ones (files, a batch's lines, a finalization) run in worker threads
        # on a client that waits longer.
        self._r = redis.Redis.from_url(settings.url, socket_timeout=LOOP_TIMEOUT_S,
                                       socket_connect_timeout=LOOP_TIMEOUT_S)
        self._bulk = redis.Redis.from_url(settings.url, socket_timeout=BULK_TIMEOUT_S,
                                          socket_connect_timeout=LOOP_TIMEOUT_S)
        self._take = self._r.register_script(TAKE)
        self._finish = self._r.register_script(FINISH)
        self._recover = self._r.register_script(RECOVER)
        self._hold = self._r.register_script(HOLD)
        self._set_response = self._r.register_script(SET_RESPONSE)

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
        pipe = self._r.pipeline()
        pipe.delete(self._k("file", file_id), self._k("fdata", file_id))
        pipe.zrem(self._k("files", owner), file_id)
        pipe.zrem(self._k("files"), file_id)
        pipe.decrby(self._k("bytes"), size)
        pipe.execute()

    # --- batches ------------------------------------------------------------------------

    def add_batch(self, batch_id: str, owner: str, created_at: int, status: str, doc: str,
                  lines: Iterable[tuple[int, str | None, bytes | None, str, bytes | None]]
                  ) -> None:
        """In a worker thread: the lines first, then the batch (which makes them live)."""
        counts: dict[str, int] = {}
        pipe = self._bulk.pipeline(transaction=False)
        for n, (index, custom_id, body, line_status, result) in enumerate(lines, 1):
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
                pipe.execute()
        if counts:
            pipe.hset(self._lines(batch_id, "counts"), mapping=counts)
        pipe.execute()
        pipe = self._r.pipeline()
        pipe.hset(self._k("batch", batch_id), mapping={
            "owner": owner, "created_at": created_at, "status": status, "doc": doc})
        pipe.zadd(self._k("batches", owner), {batch_id: created_at})
        pipe.zadd(self._k("batches"), {batch_id: created_at})
        pipe.zadd(self._k("active"), {batch_id: created_at})
        pipe.execute()

    def batch(self, batch_id: str, owner: str | None = None) -> tuple[str, str, str] | None:
        found = cast(list[bytes | None], self._r.hmget(self._k("batch", batch_id),
                                                       ["status", "doc", "owner"]))
        if found[0] is None or found[1] is None or found[2] is None:
            return None
        if owner is not None and found[2].decode() != owner:
            return None
        return found[0].decode(), found[1].decode(), found[2].decode()

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

    def save_batch(self, batch_id: str, status: str, doc: str) -> None:
        self._r.hset(self._k("batch", batch_id), mapping={"status": status, "doc": doc})

    # --- lines --------------------------------------------------------------------------

    def take_lines(self, batch_id: str, limit: int) -> list[tuple[int, str, bytes]]:
        keys = [self._lines(batch_id, part)
                for part in ("pending", "status", "running", "counts", "cid", "body")]
        flat = cast(list[bytes], self._take(keys=keys, args=[limit]))
        return [(int(flat[i]), flat[i + 1].decode(), flat[i + 2])
                for i in range(0, len(flat), 3)]

    def finish_line(self, batch_id: str, index: int, status: str, result: bytes) -> bool:
        keys = [self._lines(batch_id, part)
                for part in ("running", "status", "result", "body", "counts")]
        return bool(self._finish(keys=keys, args=[index, status, result]))

    def counts(self, batch_id: str) -> dict[str, int]:
        raw = cast(dict[bytes, bytes], self._r.hgetall(self._lines(batch_id, "counts")))
        return {k.decode(): int(v) for k, v in raw.items() if int(v)}

    def recover(self, batch_id: str) -> int:
        keys = [self._lines(batch_id, part) for part in ("running", "pending", "status",
                                                         "counts")]
        return int(cast(int, self._recover(keys=keys)))

    def finalize(self, batch_id: str, outcome: str, now: int, new_file_id: Callable[[], str],
                 ended: Callable[[str | None, str], bytes]) -> bool:
        """In a worker thread. Once: the first to claim the batch's end does it (a claim
        that lapses lets another finish a finalization that died half-way)."""
        if not self._r.set(self._k("final", batch_id), 1, nx=True, ex=300):
            return False
        found = self.batch(batch_id)
        if found is None or found[0] in FINISHED:
            return False
        status = "failed" if outcome == "completed" else outcome
        statuses = cast(dict[bytes, bytes], self._r.hgetall(self._lines(batch_id, "status")))
        cids = cast(dict[bytes, bytes], self._r.hgetall(self._lines(batch_id, "cid")))
        for index, line_status in statuses.items():
            if line_status in (b"pending", b"running"):
                self._r.zrem(self._lines(batch_id, "pending"), index)
                self._r.sadd(self._lines(batch_id, "running"), index)
                self._finish(keys=[self._lines(batch_id, part) for part in (
                    "running", "status", "result", "body", "counts")],
                    args=[index, status, ended(cids[index].decode() or None, status)])
                statuses[index] = status.encode()
        results = cast(dict[bytes, bytes], self._r.hgetall(self._lines(batch_id, "result")))
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
        pipe.execute()

    def response(self, response_id: str, owner: str | None = None) -> tuple[str, bytes] | None:
        found = cast(list[bytes | None], self._r.hmget(self._k("resp", response_id),
                                                       ["status", "result", "owner"]))
        if found[0] is None or found[1] is None or found[2] is None:
            return None
        if owner is not None and found[2].decode() != owner:
            return None
        return found[0].decode(), found[1]

    def response_request(self, response_id: str) -> tuple[str, int, bytes] | None:
        found = cast(list[bytes | None], self._r.hmget(self._k("resp", response_id),
                                                       ["owner", "created_at", "request"]))
        if found[0] is None or found[1] is None or found[2] is None:
            return None
        return found[0].decode(), int(found[1]), found[2]

    def set_response(self, response_id: str, status: str, doc: bytes,
                     only_if: Sequence[str] = ()) -> bool:
        return bool(self._set_response(keys=[self._k("resp", response_id)],
                                       args=[status, doc, *only_if]))

    def responses_with_status(self, statuses: Sequence[str]) -> list[str]:
        ids = [i.decode() for i in cast(list[bytes], self._r.zrange(self._k("responses"),
                                                                     0, -1))]
        return [i for i in ids if (found := self.response(i)) and found[0] in statuses]

    def summary(self) -> dict[str, dict[str, int]]:
        batches: dict[str, int] = {}
        lines: dict[str, int] = {}
        for batch_id in cast(list[bytes], self._r.zrange(self._k("batches"), 0, -1)):
            found = self.batch(batch_id.decode())
            if found is not None:
                batches[found[0]] = batches.get(found[0], 0) + 1
                for status, n in self.counts(batch_id.decode()).items():
                    lines[status] = lines.get(status, 0) + n
        responses: dict[str, int] = {}
        for response_id in cast(list[bytes], self._r.zrange(self._k("responses"), 0, -1)):
            found_response = self.response(response_id.decode())
            if found_response is not None:
                responses[found_response[0]] = responses.get(found_response[0], 0) + 1
        return {"batches": batches, "responses": responses, "lines": lines}

    def forget_before(self, created_at: int) -> int:
        gone = 0
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("batches"), "-inf",
                                                           f"({created_at}")):
            batch_id = raw.decode()
            found = self.batch(batch_id)
            if found is not None and found[0] not in FINISHED:
                continue
            self._r.delete(self._k("batch", batch_id), self._k("final", batch_id),
                           *(self._lines(batch_id, part) for part in (
                               "cid", "body", "status", "result", "pending", "running",
                               "counts")))
            self._r.zrem(self._k("batches"), batch_id)
            if found is not None:
                self._r.zrem(self._k("batches", found[2]), batch_id)
            gone += 1
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("files"), "-inf",
                                                           f"({created_at}")):
            file_id = raw.decode()
            meta = cast(dict[bytes, bytes], self._r.hgetall(self._k("file", file_id)))
            self._forget_file(file_id, meta.get(b"owner", b"").decode(),
                              int(meta.get(b"bytes", b"0")))
            gone += 1
        for raw in cast(list[bytes], self._r.zrangebyscore(self._k("responses"), "-inf",
                                                           f"({created_at}")):
            found_response = self.response(raw.decode())
            if found_response is None or found_response[0] in FINISHED:
                self._r.delete(self._k("resp", raw.decode()))
                self._r.zrem(self._k("responses"), raw)
                gone += 1
        return gone
