"""The redis backend: provider slots, rpm/tpm buckets, breakers and 429 cuts shared by
every replica through one Redis (``redis.asyncio``), each change one Lua script
(``proxy.state.scripts``).

- A slot is a lease with a TTL, refreshed by this replica's heartbeat while its call runs
  and released (idempotently) when it ends; a replica that dies stops refreshing, and its
  slots come back within ``lease_ttl_s`` by themselves.
- A call that finds no free slot waits in the provider's waiter set, scored by tier,
  level and arrival; whoever frees a slot hands it to the best waiter and pushes its id on
  the waiter's replica's wake list, which that replica watches with a blocking pop. The
  heartbeat (every second, or a third of the TTL) is the safety sweep: it finds grants
  whose wake was lost, waiters Redis lost, slots of dead replicas, and open breakers.
- A slot given back but not sent yet may go to the next call here (``batcher.hand_over``).
- When Redis cannot be reached the proxy does what ``on_error`` says (a per-replica share
  of each limit, or 503), and is back in shared mode two heartbeats after Redis is.
- The keys' spend budgets are ``proxy.state.budgets``'s, on this link; each heartbeat Redis
  answers syncs them (``SharedBudgets.sync``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from ..config.state import StateSettings
from ..core.call.budgets import Budget, Budgets
from ..core.errors import StateUnavailable
from . import scripts
from .base import Hooks, Lease, replica_id
from .batcher import Batcher, Waiter
from .beat import heartbeat_args, read_answer
from .health import SharedHealth
from .link import REDIS_ERRORS, Link
from .rates import SharedRates
from .shared_answers import SharedAnswers

if TYPE_CHECKING:
    from .budgets import SharedBudgets


class RedisState:
    across_replicas = True

    def __init__(self, settings: StateSettings, replica: str | None = None) -> None:
        self.settings = settings
        self.replica = replica or replica_id()
        self._ttl_ms = int(settings.lease_ttl_s * 1000)
        self.beat_s = min(1.0, settings.lease_ttl_s / 3)
        self._link = link = Link(settings, self.beat_s)
        link.on_lost = self._lost_redis
        self._p = link.prefix
        self._redis = link.client
        self._heartbeat = self._redis.register_script(scripts.HEARTBEAT)
        self._health = SharedHealth(link)
        self._rates = SharedRates(link)
        self._budgets: SharedBudgets | None = None
        self._seq = itertools.count()
        self._turn = itertools.count(1)
        self._turns: dict[str, int] = {}  # a lease handed on → the holding call's turn
        self.handed = 0  # leases handed from a call to the next without Redis
        self._beats = -1  # the last heartbeat Redis answered: what the ``seen`` key holds
        self._held: dict[str, str] = {}  # member → provider
        self._unwritten: set[str] = set()  # held leases Redis has not seen (noted without it)
        self._waiting: dict[str, Waiter] = {}
        self._unreleased: dict[str, str] = {}  # releases Redis did not take: sent again
        self._batcher = Batcher(self._redis.register_script(scripts.BATCH), self._p,
                                self._ttl_ms, lambda: self._limits, self._batch_failed,
                                REDIS_ERRORS)
        self._ask = self._batcher.ask
        self._hand_over = self._batcher.hand_over
        self._give_back = self._batcher.give_back
        self._limits: dict[str, int] = {}
        self._deployments: tuple[str, ...] = ()
        self.rebuilt: dict[str, int] = {}  # what the last rebuild wrote back (status)
        self._rewrite = False  # the next heartbeat writes back every lease held
        self._loops: list[asyncio.Task[None]] = []
        self._closed = False
        self.answers = SharedAnswers(settings, lambda: self.mode == "shared")

    @property
    def mode(self) -> str:
        return self._link.mode

    @property
    def alive(self) -> int:
        return self._link.alive

    @property
    def errors(self) -> int:
        return self._link.errors

    @property
    def client(self) -> Redis:
        """The command connection, for the other parts shared through this Redis (keys
        under ``prefix``; a command that fails is reported to ``failed``)."""
        return self._redis

    @property
    def prefix(self) -> str:
        return self._p

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, hooks: Hooks) -> None:
        self._link.hooks = hooks
        await self._beat()
        self._loops = [asyncio.create_task(self._beat_forever()),
                       asyncio.create_task(self._wake_forever())]

    async def close(self) -> None:
        self._closed = True
        for task in self._loops:
            task.cancel()
        self._lost_redis()  # its waiters withdrawn too: no slot handed to a replica gone
        unreleased, self._unreleased = self._unreleased, {}
        for member, provider in unreleased.items():
            self._give_back(member, provider)
        sender = self._batcher.sender
        await self.answers.close()
        await self._link.close(self._redis.zrem(self._p + "replicas", self.replica),
                               *([sender] if sender is not None else []))

    def configure(self, limits: Mapping[str, int], deployments: Sequence[str]) -> None:
        self._limits = dict(limits)
        self._deployments = tuple(deployments)

    def budgets(self, budgets: Mapping[str, Budget], timezone: str,
                wall: Callable[[], float]) -> SharedBudgets:
        """The keys' budgets, held for every replica (``proxy.state.budgets``)."""
        from .budgets import SharedBudgets

        self._budgets = SharedBudgets(self._link, self.replica, Budgets(budgets, timezone),
                                      wall)
        return self._budgets

    # --- slots --------------------------------------------------------------------------

    async def lease(self, provider: str, limit: int, rank: int, waited_s: float,
                    timeout_s: float, key: str = "", weight: float = 1.0,
                    claim_s: float = 0.0) -> Lease | None:
        """A slot of ``provider`` held across replicas, once the best waiting call across
        them is this one. Without Redis (``on_error: local``) the local scheduler's share
        is the limit: the lease is only noted, and written to Redis once it is back, so
        calls started meanwhile count against the limit again. None: Redis went away
        while the call asked or waited: it queues again, under the share. Raises TimeoutError
        after ``timeout_s``, StateUnavailable without Redis if ``on_error`` is reject."""
        if self.mode != "shared":
            return self._local_lease(provider)
        if (member := self._hand_over(provider, limit)) is not None:
            self._held[member] = provider
            self._turns[member] = turn = next(self._turn)
            self.handed += 1
            return Lease(member, provider, turn)
        member = f"{self.replica}|{next(self._seq)}|{provider}"
        future = asyncio.get_running_loop().create_future()
        claim_ms = int(claim_s * 1000)
        self._waiting[member] = Waiter(provider, limit, rank, time.monotonic() - waited_s,
                                       future, key, weight, claim_ms)
        finished = False
        try:
            async with asyncio.timeout(timeout_s):
                got = await self._wait(member, provider, limit, rank, waited_s, key, weight,
                                       claim_ms)
            finished = True
        finally:
            if not finished:  # timed out or cancelled: leave the waiters, or give the slot back
                self._waiting.pop(member, None)
                self._held.pop(member, None)
                self._give_back(member, provider)
        if got:
            return Lease(member, provider)
        self._check_reject()
        return None

    async def _wait(self, member: str, provider: str, limit: int, rank: int,
                    waited_s: float, key: str, weight: float, claim_ms: int) -> bool:
        """``lease``'s ask and wait: True once granted, False to queue again here."""
        try:
            granted = await self._ask(provider, member, limit, rank, int(waited_s * 1000),
                                      key, weight, claim_ms)
        except REDIS_ERRORS as exc:
            # Not noted: the local scheduler let it through under the whole limit, so it
            # queues again, under the share.
            self._waiting.pop(member, None)
            self._unreleased[member] = provider  # withdrawn once Redis is back
            self._link.failed(exc)
            return False
        waiter = self._waiting.get(member)
        if waiter is None and member not in self._held:
            # Withdrawn (``withdraw_below``, or Redis failed) while its ask was out: the
            # release is on its way, and would free a slot granted meanwhile under a call
            # still running. It queues again here.
            return False
        if granted or waiter is None:
            self._waiting.pop(member, None)
            self._held[member] = provider
            return True
        waiter.asked = True
        return await waiter.future

    def release(self, lease: Lease) -> None:
        """Give the slot back (on every path; a second call does nothing). While Redis is
        away nothing is sent: a lease Redis still holds expires, unrefreshed. A lease
        handed on to another call since is that call's to give back."""
        if self._turns.get(lease.member, 0) != lease.turn:
            return
        self._turns.pop(lease.member, None)
        written = lease.member not in self._unwritten
        self._unwritten.discard(lease.member)
        if self._held.pop(lease.member, None) is not None and (
                self.mode == "shared" or self._link.returning):
            self._give_back(lease.member, lease.provider, self.mode == "shared" and written)

    def _local_lease(self, provider: str) -> Lease:
        self._check_reject()
        member = f"{self.replica}|{next(self._seq)}|{provider}"
        self._held[member] = provider
        self._unwritten.add(member)
        return Lease(member, provider)

    def _check_reject(self) -> None:
        """Without Redis: go on alone (local), or refuse the call (reject)."""
        if self.mode == "reject":
            raise StateUnavailable()
        return None

    def withdraw_below(self, provider: str, rank: int) -> bool:
        """Send this replica's least urgent call waiting for ``provider`` whose rank is
        above ``rank`` back to the local queue (its ``lease`` returns None), so a more
        urgent call queued here can take its local slot and wait in Redis instead."""
        worst = max(((w.rank, m) for m, w in self._waiting.items()
                     if w.provider == provider and w.rank > rank and not w.future.done()),
                    default=None)
        if worst is None:
            return False
        member = worst[1]
        waiter = self._waiting.pop(member)
        waiter.future.set_result(False)
        self._give_back(member, provider)
        return True

    def _woken(self, member: str) -> None:
        waiter = self._waiting.pop(member, None)
        if waiter is not None and not waiter.future.done():
            self._held[member] = waiter.provider
            waiter.future.set_result(True)
        elif member not in self._held:  # granted to a call that is gone: straight back
            self._give_back(member, member.split("|", 2)[2])  # replica|n|provider

    def _batch_failed(self, exc: BaseException, releases: Sequence[tuple[str, str]]) -> None:
        for provider, member in releases:
            self._unreleased[member] = provider
        self._link.failed(exc)

    # --- rpm / tpm ----------------------------------------------------------------------

    async def take_rate(self, name: str, rpm: int | None, tpm: int | None,
                        tokens: int) -> float:
        """Take one request and ``tokens`` from ``name``'s shared buckets: 0.0, or the
        seconds to wait (nothing taken)."""
        return await self._rates.take(name, rpm, tpm, tokens)

    def reconcile_rate(self, name: str, rpm: int | None, tpm: int | None, requests: int,
                       tokens: int) -> None:
        """Give back ``requests`` and ``tokens`` (negative: charge more) to the buckets."""
        self._rates.reconcile(name, rpm, tpm, requests, tokens)

    # --- health -------------------------------------------------------------------------

    def breaker_opened(self, deployment: str, open_for_s: float) -> None:
        """Tell every replica (unless the news came from them)."""
        self._health.breaker_opened(deployment, open_for_s)

    def limit_cut(self, provider: str, limit: int, for_s: float) -> None:
        self._health.limit_cut(provider, limit, for_s)

    # --- heartbeat, wake-ups, trouble ---------------------------------------------------

    async def _beat_forever(self) -> None:
        # A cancel can be lost inside redis-py on Python 3.11 (asyncio.wait_for): the flag
        # ends the loop whatever happens to the cancel.
        while not self._closed:
            await asyncio.sleep(self.beat_s)
            await self._beat()

    async def _beat(self) -> None:
        link = self._link
        self._batcher.distrust()
        recreate = link.rebuild or self._rewrite
        held = list(self._held.items())
        unwritten = self._unwritten & self._held.keys()
        # Only waiters whose ask Redis has answered: one still on its way is in neither
        # its leases nor its waiters, and asking again for it would ask twice.
        waiting = [(m, w.provider) for m, w in self._waiting.items() if w.asked]
        args = heartbeat_args(self._p, self.replica, self._ttl_ms, recreate, self._beats,
                              self._limits, held, unwritten, waiting, self._deployments)
        try:
            alive, granted, lost, open_for, forgot = read_answer(
                await self._heartbeat(args=args))
        except REDIS_ERRORS as exc:
            link.failed(exc)
            return
        self._beats += 1
        link.alive = alive
        # One that found Redis had forgotten this replica dropped the leases it did not
        # list, a grant that reached Redis meanwhile among them: the next writes back every
        # lease held. One that wrote leases back may have written a released one: again.
        self._rewrite = forgot
        if recreate or forgot:
            for member, provider in held:
                if member not in self._held:
                    self._give_back(member, provider)
        self._unwritten -= unwritten
        unreleased, self._unreleased = self._unreleased, {}
        for member, provider in unreleased.items():
            self._give_back(member, provider)
        if forgot:
            self._rebuild(len(held), len(lost))
        link.answered()
        for member in granted:
            self._woken(member)
        for member in lost:
            waiter = self._waiting.get(member)
            if waiter is not None:
                self._link.spawn(self._again(member, waiter))
        now = time.monotonic()
        self._health.remote_open = {d: now + s for d, s in open_for.items()}
        if open_for and link.hooks is not None:
            link.hooks.on_breakers(open_for)
        if self._budgets is not None:
            try:
                await self._budgets.sync(rebuild=forgot)
            except REDIS_ERRORS as exc:
                link.failed(exc)

    def _rebuild(self, leases: int, waiters: int) -> None:
        """Redis forgot this replica (an empty restart, a flush, a failover to an older
        copy): the heartbeat wrote its leases back and its lost waiters ask again; here its
        open breakers, 429 cuts and what it took from the rate buckets are told again."""
        breakers, cuts = self._health.resend()
        self.rebuilt = {"times": self.rebuilt.get("times", 0) + 1, "leases": leases,
                        "waiters": waiters, "breakers": breakers, "cuts": cuts,
                        "buckets": self._rates.recharge()}

    async def _again(self, member: str, waiter: Waiter) -> None:
        """A waiter Redis lost (it restarted): wait again, with the wait so far."""
        if self._waiting.get(member) is not waiter or waiter.future.done():
            return  # the call left since (withdrawn, timed out, cancelled, Redis failed)
        waited_ms = int((time.monotonic() - waiter.arrived) * 1000)
        waiter.asked = False  # until this ask is answered: no heartbeat asks a third time
        try:
            granted = await self._ask(waiter.provider, member, waiter.limit, waiter.rank,
                                      waited_ms, waiter.key, waiter.weight, waiter.claim_ms)
        except REDIS_ERRORS:
            return  # failed over already
        waiter.asked = True
        if granted:
            self._woken(member)

    async def _wake_forever(self) -> None:
        key = self._p + "wake:" + self.replica
        while not self._closed:
            try:
                item = await self._link.blocking.blpop([key], timeout=1)  # type: ignore[misc]
            except REDIS_ERRORS:
                await asyncio.sleep(self.beat_s)
                continue
            if item is not None:
                self._woken(item[1])

    def _lost_redis(self) -> None:
        """Out of shared mode: every waiter queues again here, under the share."""
        waiting, self._waiting = self._waiting, {}
        for member, waiter in waiting.items():
            if not waiter.future.done():
                waiter.future.set_result(False)
            self._unreleased[member] = waiter.provider  # withdrawn once Redis is back

    def status(self) -> dict[str, object]:
        return {
            "backend": "redis", "url": self.settings.shown_url, "prefix": self.settings.prefix,
            "replica": self.replica, **self._link.status(),
            "lease_ttl_s": self.settings.lease_ttl_s, "leases_held": len(self._held),
            "waiting": len(self._waiting), "leases_handed_over": self.handed,
            "rebuilt": self.rebuilt,
            "answers_errors": self.answers.errors,
        }
