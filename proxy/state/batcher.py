"""What one replica asks for and gives back, sent to Redis as one batch per round trip.

Slots asked for and released in the same moment travel together in one ``BATCH`` script
(``proxy.state.scripts``); while a batch is in flight, what comes next waits for the next
one. Under load that is a round trip for many calls instead of two per call; alone, a call
pays one round trip as before.

A slot given back and not sent yet can go straight to this replica's next call for the same
provider (``hand_over``): nothing changes in Redis, the lease stays under another call. Only
while the last answer about the provider, from a batch sent at most ``HANDOFF_S`` ago, said
nobody waited for it and its leases were within the limit: a call that starts waiting on
another replica after that batch is passed over for at most ``HANDOFF_S`` (a call this
replica cannot hand a slot to asks Redis, and its answer says so again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.commands.core import AsyncScript

Asked = list[str | int | float]  # provider, member, limit, rank, waited_ms, key, weight, claim_ms
Failed = Callable[[BaseException, Sequence[tuple[str, str]]], None]
HANDOFF_S = 0.02  # how long an answer saying nobody waits for a provider is trusted


@dataclass(slots=True)
class Waiter:
    """A call of this replica waiting for the slot it asked for (``RedisState.lease``)."""

    provider: str
    limit: int
    rank: int
    arrived: float  # on this replica's monotonic clock
    future: asyncio.Future[bool]  # True: granted; False: go on without Redis
    key: str = ""  # the call's key, whose virtual clock orders it among its rank's keys
    weight: float = 1.0
    claim_ms: int = 0
    asked: bool = False  # its ask's answer came back: Redis has it (or granted it)


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
        self._releases: dict[str, str] = {}  # member → provider
        self._spare: dict[str, list[str]] = {}  # provider → leases among the releases
        self._clear: dict[str, tuple[float, int]] = {}  # provider → (sent, lowest limit)
        self.sender: asyncio.Task[None] | None = None

    def ask(self, provider: str, member: str, limit: int, rank: int, waited_ms: int,
            key: str = "", weight: float = 1.0, claim_ms: int = 0) -> asyncio.Future[int]:
        """1 if ``member`` got a slot at once, 0 if it waits (sent with the next batch);
        ``key``'s virtual clock moves on by ``claim_ms`` / ``weight``. A member asked for
        again before its ask is sent shares that ask's answer."""
        unsent = self._acquires.get(member)
        if unsent is not None:
            return unsent[1]
        future = asyncio.get_running_loop().create_future()
        self._acquires[member] = ([provider, member, limit, rank, waited_ms, key, weight,
                                   claim_ms], future)
        self._send_soon()
        return future

    def give_back(self, member: str, provider: str, held: bool = False) -> None:
        """Release ``member``'s slot, or withdraw it from the waiters (idempotent);
        ``held``: a lease Redis granted, which ``hand_over`` may give to another call."""
        unsent = self._acquires.pop(member, None)
        if unsent is not None and not unsent[1].done():  # never sent: unasked, so it waits
            unsent[1].set_result(0)
        self._releases[member] = provider
        if held:
            self._spare.setdefault(provider, []).append(member)
        self._send_soon()

    def hand_over(self, provider: str, limit: int) -> str | None:
        """A lease of ``provider`` given back and not sent, taken out of the batch for a
        call under ``limit``, when Redis said recently that nobody waits (module doc)."""
        spare = self._spare.get(provider)
        clear = self._clear.get(provider)
        if (not spare or clear is None or limit < clear[1]
                or time.monotonic() - clear[0] > HANDOFF_S):
            return None
        member = spare.pop()
        del self._releases[member]
        return member

    def distrust(self) -> None:
        """A heartbeat is on its way: one that finds Redis forgot this replica removes its
        leases not held, given-back ones too, so what earlier batches said hands nothing
        over. (One given back while a batch is out goes in the next batch, sent as soon as
        that one answers: that answer cannot hand it over either.)"""
        self._clear.clear()

    def _send_soon(self) -> None:
        if self.sender is None or self.sender.done():
            self.sender = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        """One batch in flight at a time; what is asked meanwhile goes in the next one."""
        while self._acquires or self._releases:
            acquires, self._acquires = list(self._acquires.values()), {}
            releases = [(provider, member) for member, provider in self._releases.items()]
            self._releases, self._spare = {}, {}
            limits = self._limits()
            lowest = {provider: limits.get(provider, 0) for provider, _ in releases}
            for asked, _ in acquires:
                provider, limit = str(asked[0]), int(asked[2])
                lowest[provider] = min(limit, lowest.get(provider, limit))
            args: list[Any] = [
                self._prefix, self._ttl_ms,
                orjson.dumps([(provider, member, limits.get(provider, 0))
                              for provider, member in releases]),
                orjson.dumps([asked for asked, _ in acquires])]
            sent = time.monotonic()
            try:
                flags, clear = await self._script(args=args)
            except self._errors as exc:
                self._clear.clear()
                for _, future in acquires:
                    if not future.done():
                        future.set_exception(exc)
                self._on_error(exc, releases)
                continue
            for provider in lowest:
                self._clear.pop(provider, None)
            self._clear.update((provider, (sent, lowest[provider])) for provider in clear)
            for (_, future), flag in zip(acquires, flags, strict=True):
                if not future.done():
                    future.set_result(1 if flag == "1" else 0)
