"""Spend budgets held for the whole fleet (``state.backend: redis``): the rule of
``proxy.core.call.budgets`` run in Redis, one Lua script per change, so three replicas with a
key's $10 a day spend $10 between them, not $30.

Keys, under the prefix ``p`` (``proxy.state.scripts`` has the others):

- ``p:bspent:{key}:{start}`` hash, replica → what that replica's calls of ``key`` cost in
  the period that starts at ``start`` (epoch seconds). The period's spend is the sum.
  A field is only ever written whole, and never lower than what is there (a counter
  per replica that only grows, merged by keeping the greater): a write sent twice, late,
  or again after Redis lost it counts nothing twice, a replica cut off from Redis adds
  what it spent meanwhile with its next write, and after Redis lost its data any replica
  may write back another's total as it last read it (one that died cannot).
- ``p:bheld:{key}:{start}`` sorted set, a call's reservation: ``{replica}|{n}|{maximum}``
  → expiry on Redis' clock. Its replica's heartbeat refreshes the reservations of calls
  still running (with the leases, every ``lease_ttl_s``/3 at most), so a call of any
  length keeps its reservation and a dead replica's reservations are gone within
  ``lease_ttl_s``, like its leases, with no clock of its own compared to Redis'.

Both expire an hour after their period ends. Periods are computed on each replica's wall
clock in the configured timezone (``period_of``).

While Redis cannot be reached (the state's ``mode`` is ``local``) each replica decides
alone on its share: what was left when it last heard from Redis, over the replicas alive
then (``decide_share``), against its own spend and reservations since (``reject``: 503
``state_unavailable``). Every heartbeat Redis answers writes this replica's totals (an
outage's included) and the reservations of the calls it still runs. While Redis is rebuilt
after it lost the replicas' state (``p:rebuilding``) calls are held, not decided on a
spend whose other replicas' totals are not back yet.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.call.budgets import (
    GO,
    Budget,
    Budgets,
    Refusal,
    Reservation,
    decide_share,
    dollars,
)
from ..core.errors import StateUnavailable
from .link import REDIS_ERRORS, Link
from .scripts import _REBUILD

log = logging.getLogger(__name__)

GRACE_S = 3600.0  # a period's keys outlive it by this

_COMMON = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function others_of(sk, me)
  local fields = redis.call('HGETALL', sk)
  local others = 0
  for i = 1, #fields, 2 do
    if fields[i] ~= me then others = others + tonumber(fields[i + 1]) end
  end
  return others
end

local function held_of(hk)
  redis.call('ZREMRANGEBYSCORE', hk, '-inf', now)
  local total = 0
  for _, m in ipairs(redis.call('ZRANGE', hk, 0, -1)) do
    total = total + tonumber(string.match(m, '[^|]*$'))
  end
  return total
end

local function write(sk, me, total, expire_at)
  if tonumber(total) > tonumber(redis.call('HGET', sk, me) or '0') then
    redis.call('HSET', sk, me, total)
    redis.call('PEXPIREAT', sk, expire_at)
  end
end
"""

# ARGV: prefix, key, start, expire_at_ms, replica, its total, member, amount, estimate,
# maximum, ttl_ms. The replica's total is written first (max), then ``decide``: 'go'
# adds the member. Answers {verdict, the other replicas' spend, the reserved maximum
# costs}; {'held', '-1', '-1'} while Redis is rebuilt from the replicas after it lost their
# state (``proxy.state.scripts``): their totals are not all back yet.
RESERVE = _COMMON + _REBUILD + """
local p, key, start = ARGV[1], ARGV[2], ARGV[3]
local sk, hk = p .. 'bspent:' .. key .. ':' .. start, p .. 'bheld:' .. key .. ':' .. start
local expire_at, me = tonumber(ARGV[4]), ARGV[5]
if redis.call('EXISTS', p .. 'replicas') == 0 then rebuilding(p, tonumber(ARGV[11])) end
if redis.call('EXISTS', p .. 'rebuilding') == 1 then return {'held', '-1', '-1'} end
write(sk, me, ARGV[6], expire_at)
local others = others_of(sk, me)
local spent = others + tonumber(redis.call('HGET', sk, me) or '0')
local held = held_of(hk)
local amount, estimate, maximum = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local verdict = 'go'
if estimate > amount then
  verdict = 'too_big'
elseif spent >= amount or spent + estimate > amount then
  verdict = 'spent'
elseif spent + held + estimate > amount then
  verdict = 'held'
else
  redis.call('ZADD', hk, now + tonumber(ARGV[11]), ARGV[7])
  redis.call('PEXPIREAT', hk, expire_at)
  held = held + maximum
end
return {verdict, tostring(others), tostring(held)}
"""

# ARGV: prefix, key, start, expire_at_ms, replica, its total, member ('' for none): the
# reservation goes and the replica's total (which holds the call's cost) is written, in
# one step, so no other replica sees the one without the other.
SETTLE = _COMMON + """
local p, key, start = ARGV[1], ARGV[2], ARGV[3]
local sk, hk = p .. 'bspent:' .. key .. ':' .. start, p .. 'bheld:' .. key .. ':' .. start
if ARGV[7] ~= '' then redis.call('ZREM', hk, ARGV[7]) end
write(sk, ARGV[5], ARGV[6], tonumber(ARGV[4]))
return 0
"""

# A replica's beat. ARGV: prefix, replica, ttl_ms, then counted lists: totals (key, start,
# replica, total, expire_at_ms: this replica's own, or after Redis lost them another's as
# last read, each never below what is there), reservations settled since the last beat
# (key, start, member), reservations of calls running (key, start, member, expire_at_ms:
# written again if missing, so a Redis restarted, or one that was away when the call
# started, has them), periods to read (key, start). Answers, per period read, {reserved,
# n, then n (replica, total) pairs}.
SYNC = _COMMON + """
local p, me, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function keys(i)
  local tail = ARGV[i] .. ':' .. ARGV[i + 1]
  return p .. 'bspent:' .. tail, p .. 'bheld:' .. tail
end
local i = 4
for _ = 1, tonumber(ARGV[i]) do
  local sk = keys(i + 1)
  write(sk, ARGV[i + 3], ARGV[i + 4], tonumber(ARGV[i + 5]))
  i = i + 5
end
i = i + 1
for _ = 1, tonumber(ARGV[i]) do
  local _, hk = keys(i + 1)
  redis.call('ZREM', hk, ARGV[i + 3])
  i = i + 3
end
i = i + 1
for _ = 1, tonumber(ARGV[i]) do
  local _, hk = keys(i + 1)
  redis.call('ZADD', hk, now + ttl, ARGV[i + 3])
  redis.call('PEXPIREAT', hk, tonumber(ARGV[i + 4]))
  i = i + 4
end
i = i + 1
local seen = {}
for _ = 1, tonumber(ARGV[i]) do
  local sk, hk = keys(i + 1)
  seen[#seen + 1] = tostring(held_of(hk))
  local fields = redis.call('HGETALL', sk)
  seen[#seen + 1] = #fields / 2
  for j = 1, #fields do seen[#seen + 1] = fields[j] end
  i = i + 2
end
return seen
"""


@dataclass(slots=True)
class _View:
    """A key's period as Redis last told it."""

    start: float
    others: float  # the other replicas' spend
    reserved: float  # every replica's reservations
    mine: float  # this replica's own spend then
    fields: dict[str, float] = field(default_factory=dict)  # the others', one by one


def _expiry_ms(end: float) -> int:
    return int((end + GRACE_S) * 1000)


class SharedBudgets:
    """A ``BudgetBook`` (``proxy.state.base``) whose rule runs in Redis while it can be
    reached, and on this replica's share of what is left while it cannot. ``ledger``
    keeps this replica's own spend and reservations."""

    def __init__(self, link: Link, replica: str, ledger: Budgets,
                 wall: Callable[[], float]) -> None:
        self._link = link
        self._replica = replica
        self.ledger = ledger
        self._wall = wall
        client = link.client
        self._reserve = client.register_script(RESERVE)
        self._settle = client.register_script(SETTLE)
        self._sync = client.register_script(SYNC)
        self._ttl_ms = int(link.settings.lease_ttl_s * 1000)
        self._seq = itertools.count()
        self._members: dict[int, str] = {}  # reservation id → its member in Redis
        self._views: dict[str, _View] = {}
        self._unsynced: dict[tuple[str, float], tuple[float, float]] = {}  # → (total, end)
        self._gone: set[tuple[str, float, str]] = set()  # settled since the last beat

    @property
    def budgets(self) -> dict[str, Budget]:
        return self.ledger.budgets

    def configure(self, budgets: Mapping[str, Budget], timezone: str) -> None:
        self.ledger.configure(budgets, timezone)

    def _view(self, key: str, start: float) -> _View:
        view = self._views.get(key)
        return view if view is not None and view.start == start else _View(start, 0, 0, 0)

    def spent(self, key: str, wall: float) -> float:
        """The fleet's spend as last heard from Redis (this replica's own exactly)."""
        period = self.ledger.period(key, wall)
        if period is None:
            return 0.0
        return self._view(key, period[0]).others + self.ledger.spent_in(key, period[0])

    def reserved(self, key: str, wall: float) -> float:
        period = self.ledger.period(key, wall)
        if period is None:
            return 0.0
        view = self._views.get(key)
        if view is None or view.start != period[0]:
            return self.ledger.reserved(key, wall)
        return view.reserved

    def check(self, key: str, estimate: float, wall: float) -> Refusal | None:
        return self.ledger.check(key, estimate, wall, spent=self.spent(key, wall))

    async def reserve(self, key: str, estimate: float, maximum: float,
                      wall: float) -> Reservation | Refusal | None:
        """``decide`` in Redis, or on this replica's share while Redis is away."""
        ledger, link = self.ledger, self._link
        budget = ledger.budgets.get(key)
        period = ledger.period(key, wall)
        if budget is None or period is None:
            return None
        start, end = period
        maximum = dollars(maximum)
        member = f"{self._replica}|{next(self._seq)}|{maximum!r}"
        mine = ledger.spent_in(key, start)
        if link.mode == "shared":
            try:
                verdict, others, reserved = await self._reserve(args=[
                    link.prefix, key, int(start), _expiry_ms(end), self._replica, repr(mine),
                    member, repr(budget.amount_usd), repr(dollars(estimate)), repr(maximum),
                    self._ttl_ms])
            except REDIS_ERRORS as exc:
                link.failed(exc)
            else:
                if float(others) >= 0:  # -1: Redis is being rebuilt, nothing read
                    self._views[key] = _View(start, float(others), float(reserved), mine,
                                             self._view(key, start).fields)
                    self._confirmed(key, start, mine)
                if verdict != GO:
                    return ledger.refusal(verdict, key, estimate, wall)
                return self._track(ledger.open(key, estimate, maximum, wall), member)
        if link.mode == "reject":
            raise StateUnavailable()
        view = self._view(key, start)
        verdict = decide_share(budget.amount_usd, view.others, view.mine, mine,
                               ledger.reserved(key, wall), dollars(estimate), link.alive)
        if verdict != GO:
            return ledger.refusal(verdict, key, estimate, wall)
        return self._track(ledger.open(key, estimate, maximum, wall), member)

    def _track(self, reservation: Reservation, member: str) -> Reservation:
        self._members[reservation.id] = member
        return reservation

    def settle(self, reservation: Reservation, cost: float) -> None:
        """The reservation goes and the cost is added, in Redis at once (or with the
        first beat Redis answers)."""
        member = self._members.pop(reservation.id, None)
        if member is None:
            return  # settled already
        self.ledger.settle(reservation, cost)
        key, start = reservation.key, reservation.start
        self._gone.add((key, start, member))
        self._write(key, start, reservation.end, member)

    def spend(self, key: str, usd: float, wall: float) -> None:
        self.ledger.spend(key, usd, wall)
        period = self.ledger.period(key, wall)
        if period is not None and dollars(usd):
            self._write(key, period[0], period[1], "")

    def _write(self, key: str, start: float, end: float, member: str) -> None:
        total = self.ledger.spent_in(key, start)
        self._unsynced[(key, start)] = (total, end)
        if self._link.mode == "shared":
            self._link.spawn(self._send(self._settle(args=[
                self._link.prefix, key, int(start), _expiry_ms(end), self._replica,
                repr(total), member]), key, start, total))

    async def _send(self, pending: Coroutine[Any, Any, object], key: str, start: float,
                    total: float) -> None:
        try:
            await pending
        except REDIS_ERRORS as exc:
            self._link.failed(exc)
        else:
            self._confirmed(key, start, total)

    def _confirmed(self, key: str, start: float, total: float) -> None:
        """Redis holds ``total`` for this replica's spend of ``key`` in ``start``'s period."""
        unsynced = self._unsynced.get((key, start))
        if unsynced is not None and unsynced[0] <= total:
            del self._unsynced[(key, start)]

    async def sync(self, rebuild: bool = False) -> None:
        """With every heartbeat Redis answers: this replica's totals written (again: a
        Redis that lost them, or missed them while it was away, gets them back), the
        reservations of its running calls refreshed, and every budget's fleet spend read.
        ``rebuild``: Redis lost the replicas' state; the other replicas' totals as last
        read are written back too (a replica that died since cannot write its own), never
        above what any replica spent, so nothing is counted twice. Raises what Redis
        raises."""
        ledger, link, wall = self.ledger, self._link, self._wall()
        if not (ledger.budgets or self._unsynced or self._gone or self._members):
            return  # no budgets: no round trip
        totals = {(key, start, self._replica): spent
                  for (key, start), spent in self._unsynced.items()}
        reads: list[tuple[str, float, float]] = []
        for key in ledger.budgets:
            period = ledger.period(key, wall)
            assert period is not None
            mine = ledger.spent_in(key, period[0])
            reads.append((key, period[0], mine))
            if mine > 0:
                totals.setdefault((key, period[0], self._replica), (mine, period[1]))
            if rebuild:
                for replica, spent in self._view(key, period[0]).fields.items():
                    totals[(key, period[0], replica)] = (spent, period[1])
        gone = set(self._gone)
        args: list[str | int] = [link.prefix, self._replica, self._ttl_ms, len(totals)]
        for (key, start, replica), (total, end) in totals.items():
            args += [key, int(start), replica, repr(total), _expiry_ms(end)]
        args.append(len(gone))
        for key, start, member in gone:
            args += [key, int(start), member]
        live = [(r, self._members[r.id]) for r in ledger.reservations() if r.id in self._members]
        args.append(len(live))
        for reservation, member in live:
            args += [reservation.key, int(reservation.start), member,
                     _expiry_ms(reservation.end)]
        args.append(len(reads))
        for key, start, _ in reads:
            args += [key, int(start)]
        seen = await self._sync(args=args)
        self._gone -= gone
        for (key, start, replica), (total, _) in totals.items():
            if replica == self._replica:
                self._confirmed(key, start, total)
        at = 0
        for key, start, mine in reads:
            reserved, count = float(seen[at]), int(seen[at + 1])
            pairs = seen[at + 2: at + 2 + 2 * count]
            at += 2 + 2 * count
            fields = {pairs[j]: float(pairs[j + 1]) for j in range(0, len(pairs), 2)
                      if pairs[j] != self._replica}
            self._views[key] = _View(start, sum(fields.values()), reserved, mine, fields)

    def snapshot(self, wall: float) -> dict[str, dict[str, object]]:
        return {key: self.ledger.describe(key, self.spent(key, wall), self.reserved(key, wall),
                                          wall)
                for key in self.ledger.budgets}
