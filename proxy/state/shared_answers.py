"""Answers the replicas share through the redis backend's Redis: the response cache's
entries and, for the Responses API, the deployment that holds each stored response.

Keys, under the configured prefix ``p``:

- ``p:answer:{fingerprint}``  a cached answer (``proxy.http.call.cache.pack``), with the
  model's ``ttl_s`` as its Redis expiry; the fingerprint (in hex) names the proxy key, the
  model and the request, so one key never reads another's answers
- ``p:answers:{model}``  sorted set, the model's entries by the time they were stored
  (Redis ms): the script that stores one also drops the oldest past ``max_entries``, so
  the bound holds for the whole fleet
- ``p:home:{response id}``  the deployment id that answered it, for ``HOME_TTL_S``

Nothing here may hold up or fail a call. A lookup is one round trip, bounded by
``LOOKUP_TIMEOUT_S``; writes go in the background (at most ``WRITES_IN_FLIGHT`` at once,
the rest dropped). A command that fails is counted (``on_error``) and this replica then
asks nothing for ``PAUSE_S``, nor while the state is out of shared mode (Redis known
away): a lookup is a miss, a write is dropped. It never switches the state's mode
(``RedisState.failed``): a miss costs an upstream call, not a slot. The client is its own
(raw bytes, no retries but one, a tight timeout), not the state's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ..config.state import StateSettings

log = logging.getLogger("proxy.state.answers")  # the name log filters know it by

ERRORS = (RedisError, OSError, asyncio.TimeoutError)
LOOKUP_TIMEOUT_S = 0.2  # a lookup slower than this is a miss
WRITE_TIMEOUT_S = 1.0  # a write, its one retry included
PAUSE_S = 1.0  # after a failure, lookups are misses (and writes dropped) for this long
WRITES_IN_FLIGHT = 64
MAX_SHARED_BYTES = 128 << 10  # a larger answer stays in its replica's own cache only
HOME_TTL_S = 7 * 86_400  # a response id's home is known to the fleet for a week
TRIM_AT_ONCE = 64  # entries one store drops at most (a lowered max_entries takes a few)
LOG_EVERY_S = 60.0

# ARGV: prefix, model, fingerprint, value, ttl_ms, max_entries, trim. Stores the entry with its
# expiry, notes it in the model's set, forgets the set's expired entries, then drops the
# oldest past max_entries (at most trim of each). Answers how many it dropped.
KEEP = """
local p, model, fingerprint = ARGV[1], ARGV[2], ARGV[3]
local ttl, most, trim = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local set = p .. 'answers:' .. model
redis.call('SET', p .. 'answer:' .. fingerprint, ARGV[4], 'PX', ttl)
redis.call('ZADD', set, now, fingerprint)
local gone = redis.call('ZRANGEBYSCORE', set, '-inf', now - ttl, 'LIMIT', 0, trim)
for _, old in ipairs(gone) do
  redis.call('ZREM', set, old)
  redis.call('DEL', p .. 'answer:' .. old)
end
local over = math.min(redis.call('ZCARD', set) - most, trim)
if over > 0 then
  for _, old in ipairs(redis.call('ZRANGE', set, 0, over - 1)) do
    redis.call('DEL', p .. 'answer:' .. old)
  end
  redis.call('ZREMRANGEBYRANK', set, 0, over - 1)
end
redis.call('PEXPIRE', set, ttl)
return math.max(over, 0)
"""


class SharedAnswers:
    def __init__(self, settings: StateSettings, shared: Callable[[], bool]) -> None:
        """``shared``: whether the state is in shared mode (else Redis is known away)."""
        self._p = settings.prefix + ":"
        self._shared = shared
        self._redis = Redis.from_url(
            settings.url, socket_timeout=LOOKUP_TIMEOUT_S,
            socket_connect_timeout=LOOKUP_TIMEOUT_S, retry=Retry(NoBackoff(), 1))
        self._keep = self._redis.register_script(KEEP)
        self._paused_until = 0.0
        self._logged_at = -LOG_EVERY_S
        self._writes: set[asyncio.Task[None]] = set()
        self.errors = 0
        self.last_error: str | None = None
        self.on_error: Callable[[str], None] = lambda operation: None

    def usable(self) -> bool:
        return self._shared() and time.monotonic() >= self._paused_until

    # --- the response cache -------------------------------------------------------------

    async def recall(self, fingerprint: bytes) -> tuple[bytes, float] | None:
        """The entry stored under ``fingerprint`` and the seconds it has left, if Redis has it
        and answers within ``LOOKUP_TIMEOUT_S``."""
        if not self.usable():
            return None
        key = self._p + "answer:" + fingerprint.hex()
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.get(key)
                    pipe.pttl(key)
                    found, left_ms = await pipe.execute()
        except ERRORS as exc:
            self._failed("lookup", exc)
            return None
        if not isinstance(found, bytes) or not isinstance(left_ms, int) or left_ms <= 0:
            return None
        return found, left_ms / 1000

    def keep(self, model: str, fingerprint: bytes, packed: bytes, ttl_s: float,
             max_entries: int) -> None:
        """Store an entry for the fleet, in the background (not if larger than
        ``MAX_SHARED_BYTES``)."""
        if len(packed) <= MAX_SHARED_BYTES:
            ttl_ms = max(int(ttl_s * 1000), 1)
            args: list[bytes | str | int] = [self._p, model, fingerprint.hex(), packed, ttl_ms,
                                             max_entries, TRIM_AT_ONCE]
            self._write("store", lambda: self._keep(args=args))

    # --- Responses API homes ------------------------------------------------------------

    async def home(self, response_id: str) -> str | None:
        """The id of the deployment that answered ``response_id``, if the fleet knows it."""
        if not self.usable():
            return None
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                found = await self._redis.get(self._p + "home:" + response_id)
        except ERRORS as exc:
            self._failed("home_lookup", exc)
            return None
        return found.decode() if isinstance(found, bytes) else None

    def remember(self, response_id: str, deployment: str) -> None:
        """``deployment`` answered with the stored response ``response_id`` (background)."""
        key = self._p + "home:" + response_id
        self._write("home_store",
                    lambda: self._redis.set(key, deployment, px=HOME_TTL_S * 1000))

    # --- plumbing -----------------------------------------------------------------------

    def _write(self, operation: str, command: Callable[[], Awaitable[object]]) -> None:
        if not self.usable() or len(self._writes) >= WRITES_IN_FLIGHT:
            return
        task = asyncio.ensure_future(self._send(operation, command))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _send(self, operation: str, command: Callable[[], Awaitable[object]]) -> None:
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await command()
        except ERRORS as exc:
            self._failed(operation, exc)

    def _failed(self, operation: str, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        now = time.monotonic()
        self._paused_until = now + PAUSE_S
        self.on_error(operation)
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("shared answers: Redis failed (%s, %s); cache lookups are misses "
                        "for %g s", operation, self.last_error, PAUSE_S)

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=WRITE_TIMEOUT_S)
        with contextlib.suppress(*ERRORS):
            await self._redis.aclose()
