"""What one replica asks for and gives back, sent to Redis as one batch per round trip.

Slots asked for and released in the same moment travel together in one ``BATCH`` script
(``proxy.state.scripts``); while a batch is in flight, what comes next waits for the next
one. Under load that is a round trip for many calls instead of two per call; alone, a call
pays one round trip as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from redis.commands.core import AsyncScript

Asked = list[str | int | float]  # provider, member, limit, rank, waited_ms, key, weight, claim_ms
Failed = Callable[[BaseException, Sequence[tuple[str, str]]], None]


class Batcher:
    def __init__(self, script: AsyncScript, prefix: str, ttl_ms: int,
                 limits: Callable[[], Mapping[str, int]], on_error: Failed,
                 errors: tuple[type[BaseException], ...]) -> None:
        """``on_error(exc, releases)``: a batch failed; its releases were not applied."""
        self._script = script
        self._prefix = prefix
        self._ttl_ms = ttl_ms
        self._limits = limits
        self._on_error = on_error
        self._errors = errors
        self._acquires: dict[str, tuple[Asked, asyncio.Future[int]]] = {}  # by member
        self._releases: list[tuple[str, str]] = []  # (provider, member)
        self.sender: asyncio.Task[None] | None = None

    def ask(self, provider: str, member: str, limit: int, rank: int, waited_ms: int,
            key: str = "", weight: float = 1.0, claim_ms: int = 0) -> asyncio.Future[int]:
        """1 if ``member`` got a slot at once, 0 if it waits (sent with the next batch);
        ``key``'s virtual clock moves on by ``claim_ms`` / ``weight``."""
        future = asyncio.get_running_loop().create_future()
        self._acquires[member] = ([provider, member, limit, rank, waited_ms, key, weight,
                                   claim_ms], future)
        self._send_soon()
        return future

    def give_back(self, member: str, provider: str) -> None:
        """Release ``member``'s slot, or withdraw it from the waiters (idempotent)."""
        unsent = self._acquires.pop(member, None)
        if unsent is not None and not unsent[1].done():  # never sent: unasked, so it waits
            unsent[1].set_result(0)
        self._releases.append((provider, member))
        self._send_soon()

    def _send_soon(self) -> None:
        if self.sender is None or self.sender.done():
            self.sender = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        """One batch in flight at a time; what is asked meanwhile goes in the next one."""
        while self._acquires or self._releases:
            acquires, self._acquires = list(self._acquires.values()), {}
            releases, self._releases = self._releases, []
            limits = self._limits()
            args: list[Any] = [
                self._prefix, self._ttl_ms,
                orjson.dumps([(provider, member, limits.get(provider, 0))
                              for provider, member in releases]),
                orjson.dumps([asked for asked, _ in acquires])]
            try:
                flags = await self._script(args=args)
            except self._errors as exc:
                for _, future in acquires:
                    if not future.done():
                        future.set_exception(exc)
                self._on_error(exc, releases)
                continue
            for (_, future), flag in zip(acquires, flags or "", strict=True):
                if not future.done():
                    future.set_result(1 if flag == "1" else 0)
