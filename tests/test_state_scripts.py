"""The Lua scripts of the redis backend, run on a real Redis: leases, expiry, idempotent
release, waiter order, dead waiters, heartbeats, rpm/tpm buckets, 429 cuts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.state import scripts

from .redis_server import prefixed

TTL = 10_000


class Lua:
    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.p = prefix + ":"
        self._batch = client.register_script(scripts.BATCH)
        self._beat = client.register_script(scripts.HEARTBEAT)
        self._rate = client.register_script(scripts.RATE)
        self._cut = client.register_script(scripts.CUT)
        self.beats: dict[str, int] = {}
        self.clear: list[str] = []  # the last batch's providers nobody waits for

    def batch(self, releases: list[tuple[str, int]],
              acquires: list[tuple[str, int, int, int, str, float, int]],
              ttl: int = TTL, provider: str = "p") -> list[int]:
        args: list[Any] = [
            self.p, ttl, orjson.dumps([(provider, member, limit) for member, limit in releases]),
            orjson.dumps([(provider, *acquire) for acquire in acquires])]
        flags, self.clear = self._batch(args=args)
        return [int(flag) for flag in flags]

    def acquire(self, member: str, limit: int = 2, rank: int = 0, waited_ms: int = 0,
                ttl: int = TTL, key: str = "", weight: float = 1.0, claim_ms: int = 0) -> int:
        return self.batch([], [(member, limit, rank, waited_ms, key, weight, claim_ms)],
                          ttl=ttl)[0]

    def release(self, member: str, limit: int = 2) -> None:
        self.batch([(member, limit)], [])

    def beat(self, replica: str, *, held: tuple[str, ...] = (), waiting: tuple[str, ...] = (),
             deployments: tuple[str, ...] = (), limit: int = 2, recreate: bool = False,
             ttl: int = TTL, unwritten: tuple[str, ...] = ()) -> list[Any]:
        """A heartbeat, numbered as ``RedisState`` numbers them (from 0; the last one
        answered is sent with it)."""
        last = self.beats.get(replica, -1)
        self.beats[replica] = last + 1
        args: list[Any] = [self.p, replica, ttl, int(recreate), last + 1, last, 1, "p", limit,
                           len(held)]
        for member in held:
            args += ["p", member, int(member in unwritten)]
        args.append(len(waiting))
        for member in waiting:
            args += ["p", member]
        args += [len(deployments), *deployments]
        return list(self._beat(args=args))

    def leases(self) -> list[str]:
        return list(self.client.zrange(self.p + "leases:p", 0, -1))

    def wakes(self, replica: str) -> list[str]:
        return list(self.client.lrange(self.p + "wake:" + replica, 0, -1))

    def rate(self, rpm: int, tpm: int, requests: int, tokens: int, take: bool = True) -> int:
        return int(self._rate(args=[self.p, "k", rpm, tpm, requests, tokens, int(take)]))


@pytest.fixture
def lua() -> Iterator[Lua]:
    with prefixed() as (client, prefix):
        lua = Lua(client, prefix)
        lua.beat("a")  # a replica beats before it serves: else Redis would seem to have lost it
        yield lua


def test_slots_are_granted_up_to_the_limit_then_callers_wait(lua: Lua) -> None:
    assert lua.acquire("a|1|p") == 1
    assert lua.acquire("a|2|p") == 1
    assert lua.acquire("b|1|p") == 0
    assert sorted(lua.leases()) == ["a|1|p", "a|2|p"]


def test_a_keys_burst_queues_behind_itself_and_another_keys_call_goes_first(lua: Lua) -> None:
    """VirtualClock: each of a key's calls moves its clock on by its claim over its weight,
    so a later call of another key starts before the burst's later calls; with no claim
    the order is arrival order."""
    lua.acquire("a|1|p", limit=1)
    for n in range(2, 6):
        lua.acquire(f"a|{n}|p", limit=1, key="heavy", claim_ms=10_000)
    lua.acquire("b|1|p", limit=1, key="light", claim_ms=10_000)
    lua.release("a|1|p", limit=1)
    assert lua.leases() == ["a|2|p"]  # the burst's first call came first
    lua.release("a|2|p", limit=1)
    assert lua.leases() == ["b|1|p"]  # then the light key's, before the burst's second
    assert lua.client.pttl(lua.p + "vclock:p") > 0


def test_a_key_that_had_the_provider_to_itself_does_not_pay_for_it_later(lua: Lua) -> None:
    """Calls granted at once move no clock: after 100 of a key's calls were served without
    waiting, its next waiting call still goes before a later one of another key."""
    for n in range(100):
        assert lua.acquire(f"a|{n}|p", limit=1, key="busy", claim_ms=10_000) == 1
        lua.release(f"a|{n}|p", limit=1)
    lua.acquire("x|1|p", limit=1)
    lua.acquire("a|100|p", limit=1, key="busy", claim_ms=10_000)
    lua.acquire("b|1|p", limit=1, key="other", claim_ms=10_000)
    lua.release("x|1|p", limit=1)
    assert lua.leases() == ["a|100|p"]


def test_acquire_again_for_a_granted_member_is_granted_once(lua: Lua) -> None:
    assert lua.acquire("a|1|p", limit=1) == 1
    assert lua.acquire("a|1|p", limit=1) == 1
    assert lua.leases() == ["a|1|p"]


def test_release_hands_the_slot_to_the_best_waiter_and_wakes_its_replica(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    assert lua.acquire("b|1|p", limit=1, rank=32, waited_ms=60_000) == 0  # low tier, old
    assert lua.acquire("c|1|p", limit=1, rank=0, waited_ms=0) == 0  # top tier, new
    assert lua.acquire("c|2|p", limit=1, rank=0, waited_ms=5_000) == 0  # top tier, older
    lua.release("a|1|p", limit=1)
    assert lua.leases() == ["c|2|p"]
    assert lua.wakes("c") == ["c|2|p"]
    assert lua.client.pttl(lua.p + "wake:c") > 0  # a dead replica's wake list goes away
    lua.release("c|2|p", limit=1)
    lua.release("c|1|p", limit=1)
    assert lua.leases() == ["b|1|p"]


def test_release_is_idempotent_and_never_frees_someone_elses_slot(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.release("a|1|p", limit=1)
    lua.release("a|1|p", limit=1)
    lua.release("never|1|p", limit=1)
    assert lua.leases() == []
    lua.acquire("b|1|p", limit=1)
    lua.release("a|1|p", limit=1)
    assert lua.leases() == ["b|1|p"]
    assert lua.acquire("c|1|p", limit=1) == 0


def test_release_withdraws_a_waiter(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.acquire("b|1|p", limit=1)
    lua.release("b|1|p", limit=1)
    assert lua.client.zcard(lua.p + "waiters:p") == 0
    lua.release("a|1|p", limit=1)
    assert lua.leases() == []
    assert lua.wakes("b") == []


def test_a_lease_not_refreshed_expires_and_its_slot_comes_back(lua: Lua) -> None:
    assert lua.acquire("dead|1|p", limit=1, ttl=150) == 1
    assert lua.acquire("b|1|p", limit=1) == 0
    time.sleep(0.3)
    lua.beat("b", waiting=("b|1|p",), limit=1)  # the safety sweep of a live replica
    assert lua.leases() == ["b|1|p"]
    assert lua.wakes("b") == ["b|1|p"]


def test_a_heartbeat_keeps_leases_alive(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1, ttl=300)
    for _ in range(4):
        time.sleep(0.15)
        lua.beat("a", held=("a|1|p",), limit=1, ttl=300)
    assert lua.leases() == ["a|1|p"]


def test_a_dead_replicas_waiter_is_skipped(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.acquire("dead|1|p", limit=1, rank=0, ttl=150)
    lua.acquire("b|1|p", limit=1, rank=16)
    time.sleep(0.3)
    lua.release("a|1|p", limit=1)
    assert lua.leases() == ["b|1|p"]
    assert lua.wakes("dead") == []


def test_the_heartbeat_counts_replicas_and_reports_grants_losses_and_breakers(
        lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.acquire("b|1|p", limit=1)
    lua.client.set(lua.p + "breaker:p/m", 1, px=5000)
    lua.beat("a", held=("a|1|p",), limit=1)
    alive, granted, lost, opened, forgot = lua.beat("b", waiting=("b|1|p", "b|9|p"),
                                                    deployments=("p/m", "p/other"), limit=1)
    assert alive == 2 and forgot == 0
    assert granted == [] and lost == ["b|9|p"]
    assert opened[0] == "p/m" and 0 < int(opened[1]) <= 5000 and len(opened) == 2
    lua.client.zrem(lua.p + "leases:p", "a|1|p")  # a grant whose wake was lost
    lua.client.zadd(lua.p + "leases:p", {"b|1|p": 1e15})
    lua.client.zrem(lua.p + "waiters:p", "b|1|p")
    assert lua.beat("b", waiting=("b|1|p",), limit=1)[1] == ["b|1|p"]


def test_after_redis_lost_its_leases_a_recreating_heartbeat_writes_them_back(
        lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.beat("a", held=("a|1|p",), limit=1)
    lua.client.delete(lua.p + "leases:p")  # as if released meanwhile
    lua.beat("a", held=("a|1|p",), limit=1)
    assert lua.leases() == []  # a plain heartbeat never resurrects a released lease
    lua.beat("a", held=("a|1|p",), limit=1, recreate=True)
    assert lua.leases() == ["a|1|p"]
    assert lua.acquire("b|1|p", limit=1) == 0


def test_a_redis_that_lost_its_state_is_noticed_and_every_held_lease_written_back(
        lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.beat("a", held=("a|1|p",), limit=1)
    for key in lua.client.scan_iter(lua.p + "*"):  # a restart between two heartbeats
        lua.client.delete(key)
    assert lua.beat("a", held=("a|1|p",), limit=1)[4] == 1
    assert lua.leases() == ["a|1|p"]
    assert lua.acquire("b|1|p", limit=1) == 0
    assert lua.beat("a", held=("a|1|p",), limit=1)[4] == 0


def test_a_failover_to_an_older_copy_is_noticed_and_its_ended_leases_dropped(
        lua: Lua) -> None:
    """The copy still has this replica's ``seen`` key, from an earlier heartbeat, and a
    lease of a call that ended since; the call running now is missing."""
    lua.acquire("a|1|p", limit=2)
    lua.beat("a", held=("a|1|p",), limit=2)
    older = {key: lua.client.dump(key) for key in lua.client.scan_iter(lua.p + "*")}
    lua.release("a|1|p", limit=2)
    lua.acquire("a|2|p", limit=2)
    lua.beat("a", held=("a|2|p",), limit=2)
    lua.beat("a", held=("a|2|p",), limit=2)
    for key in lua.client.scan_iter(lua.p + "*"):
        lua.client.delete(key)
    for key, dumped in older.items():
        lua.client.restore(key, 0, dumped)
    assert lua.leases() == ["a|1|p"]
    assert lua.beat("a", held=("a|2|p",), limit=2)[4] == 1
    assert lua.leases() == ["a|2|p"]
    lua.beat("b", held=("b|1|p",), limit=2)  # another replica's leases are its own
    assert lua.beat("a", held=("a|2|p",), limit=2)[4] == 0


def test_a_lease_noted_without_redis_is_written_by_the_next_heartbeat(lua: Lua) -> None:
    lua.beat("a", limit=1)
    lua.beat("a", held=("a|9|p",), unwritten=("a|9|p",), limit=1)
    assert lua.leases() == ["a|9|p"]
    assert lua.acquire("b|1|p", limit=1) == 0


def test_a_cut_lowers_the_shared_limit_for_a_while_and_never_raises_it(lua: Lua) -> None:
    cut = lua._cut
    cut(args=[lua.p, "p", 1, 200])
    cut(args=[lua.p, "p", 3, 10_000])
    assert lua.acquire("a|1|p", limit=4) == 1
    assert lua.acquire("a|2|p", limit=4) == 0
    time.sleep(0.3)
    lua.beat("a", held=("a|1|p",), waiting=("a|2|p",), limit=4)
    assert sorted(lua.leases()) == ["a|1|p", "a|2|p"]


def test_rate_buckets_take_refuse_with_the_wait_and_refund(lua: Lua) -> None:
    assert lua.rate(rpm=2, tpm=0, requests=1, tokens=0) == 0
    assert lua.rate(rpm=2, tpm=0, requests=1, tokens=0) == 0
    wait = lua.rate(rpm=2, tpm=0, requests=1, tokens=0)
    assert 25_000 < wait <= 30_000  # one request back takes half a minute at 2 rpm
    lua.rate(rpm=2, tpm=0, requests=1, tokens=0, take=False)  # refunded
    assert lua.rate(rpm=2, tpm=0, requests=1, tokens=0) == 0


def test_token_buckets_let_an_oversized_call_go_once_full_and_charge_actual_use(
        lua: Lua) -> None:
    assert lua.rate(rpm=0, tpm=1000, requests=1, tokens=5000) == 0  # alone: it goes
    assert lua.rate(rpm=0, tpm=1000, requests=1, tokens=10) > 0  # the bucket is in debt
    assert lua.client.pttl(lua.p + "rate:k") > 0  # no bucket outlives two minutes idle


def test_a_smaller_actual_use_gives_tokens_back(lua: Lua) -> None:
    assert lua.rate(rpm=0, tpm=1000, requests=1, tokens=900) == 0
    assert lua.rate(rpm=0, tpm=1000, requests=1, tokens=900) > 0
    lua.rate(rpm=0, tpm=1000, requests=0, tokens=800, take=False)  # used 100 of 900
    assert lua.rate(rpm=0, tpm=1000, requests=1, tokens=900) == 0


def test_a_batch_gives_back_first_and_hands_the_slot_to_the_best_waiter(lua: Lua) -> None:
    lua.acquire("a|1|p", limit=1)
    lua.acquire("b|1|p", limit=1, rank=0, waited_ms=5_000)  # waiting, the best
    flags = lua.batch([("a|1|p", 1)], [("c|1|p", 1, 0, 0, "", 1.0, 0),
                                       ("d|1|p", 1, 0, 0, "", 1.0, 0)])
    assert flags == [0, 0]
    assert lua.leases() == ["b|1|p"] and lua.wakes("b") == ["b|1|p"]
    flags = lua.batch([("b|1|p", 1)], [("e|1|p", 1, 0, 60_000, "", 1.0, 0)])
    assert flags == [0]  # the slot went to a waiter before this batch's own asked
    assert lua.leases() == ["c|1|p"] and lua.wakes("c") == ["c|1|p"]


def test_after_redis_lost_everything_no_slot_is_granted_until_the_replicas_wrote_theirs_back(
        lua: Lua) -> None:
    """A flush between two heartbeats: the first ask afterwards must not take a slot that a
    running call of another replica still holds (its heartbeat writes it back soon)."""
    lua.acquire("a|1|p", limit=1)
    lua.beat("a", held=("a|1|p",), limit=1)
    for key in lua.client.scan_iter(lua.p + "*"):
        lua.client.delete(key)
    assert lua.acquire("b|1|p", limit=1, ttl=3000) == 0  # waits: a's lease is not back yet
    assert 0 < int(lua.client.pttl(lua.p + "rebuilding")) <= 1500
    lua.beat("a", held=("a|1|p",), limit=1, ttl=3000)
    assert lua.leases() == ["a|1|p"]
    lua.release("a|1|p", limit=1)
    assert lua.leases() == []  # still rebuilding: nothing handed out
    time.sleep(1.6)
    lua.beat("b", waiting=("b|1|p",), limit=1, ttl=3000)
    assert lua.leases() == ["b|1|p"]


OP = st.one_of(
    st.tuples(st.just("ask"), st.integers(0, 3)),  # a call of that rank asks
    st.tuples(st.just("end"), st.integers(0, 20)),  # the n-th holder (mod) gives its slot back
    st.tuples(st.just("leave"), st.integers(0, 20)),  # the n-th waiter (mod) withdraws
    st.tuples(st.just("again"), st.integers(0, 20)),  # the n-th holder (mod) asks again
    st.tuples(st.just("cut"), st.integers(1, 3)))
BATCHES = st.lists(st.lists(OP, min_size=1, max_size=4), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(batches=BATCHES, limit=st.integers(1, 3))
def test_slots_never_pass_the_limit_none_idle_while_a_call_waits_and_none_out_of_order(
        batches: list[list[tuple[str, int]]], limit: int) -> None:
    """Whatever the asks (a holder's again, too), releases, withdrawals and 429 cuts, several
    in one batch (the fast path for a free slot included): leases never above the limit, no
    free slot while a call waits, a call granted while a more urgent one keeps waiting
    never, and a call given back or withdrawn is neither a lease nor a waiter afterwards.
    A provider the batch answers as clear (a replica may hand a lease it gives back to its
    next call) has no waiter and no more leases than the batch's limit and the cut."""
    with prefixed() as (client, prefix):
        lua = Lua(client, prefix)
        lua.beat("a")
        held: list[str] = []
        waiting: list[str] = []
        rank_of: dict[str, int] = {}
        n = 0
        for ops in batches:
            releases: list[tuple[str, int]] = []
            asks: list[tuple[str, int, int, int, str, float, int]] = []
            for op, value in ops:
                n += 1
                if op == "ask":
                    member = f"a|{n}|p"
                    rank_of[member] = value
                    asks.append((member, limit, value, 0, "", 1.0, 0))
                elif op in ("end", "leave") and (chosen := held if op == "end" else waiting):
                    member = chosen[value % len(chosen)]
                    releases.append((member, limit))
                    # as the batcher does: a call given back is not asked for after all
                    asks = [ask for ask in asks if ask[0] != member]
                elif op == "again" and held:  # as a waiter Redis lost asks again
                    member = held[value % len(held)]
                    if (member, limit) not in releases:
                        asks.append((member, limit, rank_of[member], 0, "", 1.0, 0))
                elif op == "cut":
                    lua._cut(args=[lua.p, "p", value, 60_000])  # lowers, never raises
            lua.batch(releases, asks)
            cut = client.get(lua.p + "limit:p")
            cap = min(limit, int(cut)) if cut else limit
            leases = lua.leases()
            waiters = list(client.zrange(lua.p + "waiters:p", 0, -1))
            if releases or asks:
                assert (lua.clear == ["p"]) == (not waiters and len(leases) <= cap)
            newly = [m for m in leases if m not in held]
            assert len(leases) <= limit and (not newly or len(leases) <= cap)
            if waiters:
                assert len(leases) >= cap  # never a slot left free while a call waits
            for member in newly:  # a batch's asks come in order: a later one may be more urgent
                before = [w for w in waiters if w in waiting or order(w) < order(member)]
                assert all(rank_of[w] >= rank_of[member] for w in before), (member, waiters)
            gone = {member for member, _ in releases} - {ask[0] for ask in asks}
            assert not gone & {*leases, *waiters}
            assert not gone & set(client.zrange(lua.p + "wexp:p", 0, -1))
            held, waiting = leases, waiters


def order(member: str) -> int:
    return int(member.split("|")[1])
