"""The semantic cache's entries shared through Redis (the redis state backend).

Each model with a ``semantic_cache`` has one Redis stream, ``<prefix>:semantic:<model>``: a
replica that keeps an answer adds it there (one script: ``XADD`` bounded by ``MAXLEN
max_entries``, ``XTRIM MINID`` dropping what is older than ``ttl_s`` by Redis' clock, and the
key expiring ``ttl_s`` after the last add), and every replica tails every stream with a
blocking ``XREAD``, adding what the others kept to its own in-process index: an answer kept
on one replica is found on the others one Redis round trip later (plus the time to index
it). A replica that starts, or a model a reload adds, first reads the stream's live entries
(oldest first). Redis holds at most ``max_entries`` entries per model, each its answer (up to
1 MiB) and its vector (half precision, base64: about 4 KiB at 1536 dimensions).

Redis that fails only makes the cache this replica's for a while: a failed add is dropped,
the tail tries again every ``RETRY_S`` from where it was. Neither is reported to the shared
state's ``failed``: the cache never changes how calls are admitted.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .link import COMMAND_TIMEOUT_S, REDIS_ERRORS
from .shared import RedisState

log = logging.getLogger("proxy.state.semantic")  # the name log filters know it by

BLOCK_MS = 1000
RETRY_S = 1.0
PAGE = 500
MAX_PENDING_ADDS = 256  # adds on their way to Redis; past this an add is dropped

# KEYS[1] the stream; ARGV: max entries, ttl ms, then the fields. One script: the add and
# both bounds at once.
ADD = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
local id = redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], '*', unpack(ARGV, 3))
redis.call('XTRIM', KEYS[1], 'MINID', now_ms - ttl_ms)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return id
"""


@dataclass(frozen=True, slots=True)
class Shared:
    """An answer another replica kept."""

    scope: bytes
    vector: list[float]
    answer: bytes
    deployment: str
    prompt_tokens: int | None
    completion_tokens: int | None
    age_s: float  # since it was kept


@dataclass(frozen=True, slots=True)
class Bounds:
    max_entries: int
    ttl_s: float


Received = Callable[[str, Shared], None]


class SharedSemantic:
    def __init__(self, state: RedisState, received: Received) -> None:
        self._client = state.client
        self._prefix = state.prefix + "semantic:"
        self._replica = state.replica
        self._received = received
        # Its own connection: a blocking read must not hold up (nor time out as) a command.
        self._blocking = Redis.from_url(
            state.settings.url, socket_timeout=BLOCK_MS / 1000 + COMMAND_TIMEOUT_S + 1.0,
            socket_connect_timeout=COMMAND_TIMEOUT_S, decode_responses=True)
        self._add = self._client.register_script(ADD)
        self._models: dict[str, Bounds] = {}
        self._last: dict[str, str] = {}  # stream → the last id read
        self._pending: set[asyncio.Task[None]] = set()
        self._tail: asyncio.Task[None] | None = None
        self._failing = False
        # Each failed command, by operation (store, read): the service counts them.
        self.on_error: Callable[[str], None] = lambda operation: None

    def configure(self, models: Mapping[str, Bounds]) -> None:
        """The models shared now (a reload): a new one's live entries are read first."""
        self._models = dict(models)
        if (self._tail is None or self._tail.done()) and self._models:
            self._tail = asyncio.get_running_loop().create_task(self._tail_forever())

    def add(self, model: str, scope: bytes, vector: list[float], answer: bytes,
            deployment: str, prompt_tokens: int | None,
            completion_tokens: int | None) -> None:
        """Share an answer this replica kept (sent in the background; dropped on failure)."""
        bounds = self._models.get(model)
        encoded = _encode(vector)
        if bounds is None or encoded is None or len(self._pending) >= MAX_PENDING_ADDS:
            return
        fields = ["r", self._replica, "s", scope.hex(), "v", encoded,
                  "a", answer.decode("utf-8", "replace"), "d", deployment,
                  "p", "" if prompt_tokens is None else str(prompt_tokens),
                  "c", "" if completion_tokens is None else str(completion_tokens)]
        task = asyncio.get_running_loop().create_task(self._send(
            self._prefix + model, bounds, fields))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, key: str, bounds: Bounds, fields: list[str]) -> None:
        try:
            await self._add(keys=[key], args=[bounds.max_entries,
                                              int(bounds.ttl_s * 1000), *fields])
        except REDIS_ERRORS as exc:
            self._failed(exc, "store")

    async def _tail_forever(self) -> None:
        while True:
            try:
                await self._read_new_models()
                streams: dict[Any, Any] = {self._prefix + m: self._last[self._prefix + m]
                                           for m in self._models}
                if not streams:
                    return
                found = await self._blocking.xread(streams, count=PAGE, block=BLOCK_MS)
                self._failing = False
            except REDIS_ERRORS as exc:
                self._failed(exc, "read")
                await asyncio.sleep(RETRY_S)
                continue
            for stream, items in found or ():
                for item_id, fields in items:
                    self._last[stream] = item_id
                    self._take(stream, item_id, fields)

    async def _read_new_models(self) -> None:
        """The live entries of streams not read yet, oldest first."""
        for model, bounds in self._models.items():
            stream = self._prefix + model
            if stream in self._last:
                continue
            start = f"{max(int((time.time() - bounds.ttl_s) * 1000), 0)}-0"
            last = "0-0"
            while True:
                items = await self._client.xrange(stream, min=start, count=PAGE)
                for item_id, fields in items:
                    last = item_id
                    self._take(stream, item_id, fields)
                if len(items) < PAGE:
                    break
                start = "(" + last
            self._last[stream] = last

    def _take(self, stream: str, item_id: str, fields: Mapping[str, Any]) -> None:
        if fields.get("r") == self._replica:
            return  # this replica's own: indexed when it was kept
        model = stream[len(self._prefix):]
        if model not in self._models:
            return
        try:
            shared = Shared(
                scope=bytes.fromhex(fields["s"]), vector=_decode(fields["v"]),
                answer=fields["a"].encode(), deployment=fields["d"],
                prompt_tokens=int(fields["p"]) if fields.get("p") else None,
                completion_tokens=int(fields["c"]) if fields.get("c") else None,
                age_s=max(time.time() - int(item_id.split("-")[0]) / 1000, 0.0))
        except (KeyError, ValueError, struct.error):
            return  # not an entry this version wrote
        self._received(model, shared)

    def _failed(self, exc: BaseException, operation: str) -> None:
        self.on_error(operation)
        if not self._failing:
            log.warning("semantic cache: Redis unreachable (%s: %s); entries stay on this "
                        "replica until it is back", type(exc).__name__, exc)
        self._failing = True

    async def close(self) -> None:
        if self._tail is not None:
            self._tail.cancel()
            await asyncio.gather(self._tail, return_exceptions=True)
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._blocking.aclose()


def _encode(vector: list[float]) -> str | None:
    """The vector of length one, in half precision, base64 (None: a zero vector)."""
    norm = math.sqrt(sum(x * x for x in vector))
    if not norm > 0 or math.isinf(norm):
        return None
    return base64.b64encode(struct.pack(f"<{len(vector)}e", *(x / norm for x in vector))
                            ).decode()


def _decode(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 2}e", raw))
