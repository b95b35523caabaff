"""Forecasts of a new call's wait (``proxy.core.scheduling.forecast``) and the calls refused at once
because of them: scenario tables on a fake clock, and replays on the virtual clock with
and without refusing at once."""

from __future__ import annotations

import dataclasses
import random

import pytest

from proxy.config import Config, parse_config
from proxy.core.scheduling.scheduler import Rejection, Ticket, TierSpec
from proxy.sim.run import simulate
from proxy.sim.workloads import call, table
from tests.scheduler_kit import Kit, ticket

HIGH = (TierSpec("high", 1, max_wait_s=10),)


def warm(caps: dict[str, int], tiers: tuple[TierSpec, ...] = HIGH, seconds: float = 1.0,
         **settings: object) -> Kit:
    """A scheduler that has seen one call of ``seconds`` served: a mean service time is
    known, which what is certain needs."""
    k = Kit(caps, tiers, headroom_spread=None, **settings)
    k.occupy(-seconds)
    k.release(next(iter(caps)), 0.0, seconds)
    k.log.clear()
    return k


def rejections(k: Kit) -> list[Rejection]:
    """Each refusal once (a Decisions object with nothing in it is kept and logged again)."""
    return list({id(r): r for d in k.log for r in d.rejections}.values())


def refused(k: Kit) -> set[Ticket]:
    return {r.ticket for r in rejections(k)}


def burst(k: Kit, count: int, now: float = 0.0, est: float = 1.0, key: str = "",
          spacing: float = 0.0) -> list[Ticket]:
    tickets = [ticket(0, est, key=key) for _ in range(count)]
    for i, t in enumerate(tickets):
        k.submit(t, now + i * spacing)
    return tickets


def test_a_burst_past_what_its_wait_lets_start_is_refused_at_once() -> None:
    """4 slots, 1 s calls, 10 s: of a burst of 100 at once, the calls whose own key's calls
    ahead take more than their wait to start are refused as they arrive (503
    queue_timeout), with a retry-after of how long the calls that block them take to
    start: sent again then, a call waits little."""
    k = warm({"p": 4})
    calls = burst(k, 100)
    refused = {r.ticket: r for r in rejections(k)}
    # 4 start at once; a call with n queued ahead waits at least n / 4 - 1 s
    assert len(refused) == 100 - 4 - 45
    first = min(refused, key=calls.index)
    assert calls.index(first) == 4 + 45
    assert refused[first].code == "queue_timeout" and refused[first].message
    assert "at least 10 s" in refused[first].message
    assert {r.retry_after_s for r in refused.values()} == {45 / 4 - 1}  # the 45 queued
    assert all(t.state.name != "REJECTED" for t in calls[:49])


def test_a_key_past_its_share_hears_429_while_another_key_waits() -> None:
    k = warm({"p": 4})
    k.submit(ticket(0, 1.0, key="light"), 0.0)
    for _ in range(4):
        k.submit(ticket(0, 1.0, key="light"), 0.0)  # one waits: another key is queued
    burst(k, 100, key="heavy")
    codes = {r.code for r in rejections(k)}
    assert codes == {"key_backlog"}


def test_calls_that_arrive_apart_are_not_refused_at_once() -> None:
    """A call ahead that arrived a while before times out that much before: the calls
    behind it may still start in time, so none is refused at once."""
    k = warm({"p": 4})
    burst(k, 100, spacing=0.05)  # a slot turns over every 0.25 s
    assert not rejections(k)


def test_nothing_is_certain_before_a_call_was_served_or_past_the_mean() -> None:
    """Before its provider served a call, no wait is certain; after, a call counts for its
    estimate only up to the provider's mean service time: a burst of calls claiming 20 s
    each (a generous max_tokens) that take 1 s is refused as one of 1 s calls."""
    cold = Kit({"p": 4}, HIGH, headroom_spread=None)
    burst(cold, 100)
    assert not refused(cold)
    k = warm({"p": 4})
    burst(k, 100, est=20.0)
    assert len(refused(k)) == 100 - 4 - 45


def test_refuse_early_off_lets_every_call_wait_for_its_deadline() -> None:
    k = warm({"p": 4}, refuse_early=False)
    burst(k, 100)
    assert not rejections(k)


def test_a_provider_paused_past_the_deadline_refuses_at_once() -> None:
    k = Kit({"p": 1}, HIGH, headroom_spread=None)
    k.s.pause("p", 30.0, 0.0)
    t = ticket(0, 1.0)
    decisions = k.submit(t, 0.0)
    assert [(r.code, round(r.retry_after_s)) for r in decisions.rejections] == [
        ("queue_timeout", 30)]


def test_a_forecast_counts_the_calls_ahead_and_their_work() -> None:
    """Two slots busy, three 2 s calls queued: a fourth call has three ahead and expects
    to wait their work over the two slots; an urgent call expects no wait behind them."""
    k = Kit({"p": 2}, (TierSpec("urgent", 4, max_wait_s=60), TierSpec("normal", 1,
                                                                      max_wait_s=60)),
            headroom_spread=None)
    k.occupy(tier=1)
    k.occupy(tier=1)
    for _ in range(3):
        k.submit(ticket(1, 2.0), 0.0)
    fourth, urgent = ticket(1, 2.0), ticket(0, 2.0)
    k.submit(fourth, 0.0)
    k.submit(urgent, 0.0)
    assert (fourth.position, fourth.predicted_s) == (3, pytest.approx(3.0))
    assert (urgent.position, urgent.predicted_s) == (0, pytest.approx(0.5))  # half a call


def _without(config: Config) -> Config:
    return dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, refuse_early=False))


def test_a_call_refused_at_once_would_rarely_have_started_in_time() -> None:
    """100 random workloads (after one call served, bursts of 1-300 calls, at once or spread
    over up to 3 s, with 2 ms of jitter, one or two keys, 1-6 slots, calls of 0.2-3 s, in
    tiers of 10 and 30 s) replayed with and without refusing at once: of the calls refused
    at once, at most 1 % started in time without it (75 of 11,513 when this was written),
    and at least a quarter of the calls that timed out without it were told at once (11,513
    of 19,643: bursts spread over seconds leave gaps in which a slot may free)."""
    rng = random.Random(5)
    refused = wrong = late = 0
    for _ in range(100):
        slots, tier = rng.randint(1, 6), rng.choice(["critical", "high"])
        sizes = [rng.choice([0.2, 0.5, 1.0, 3.0]) for _ in range(rng.randint(1, 3))]
        keys = rng.random() < 0.5
        calls = [call(0.0, sizes[0], tier)]  # served first: the provider's mean is known
        for b in range(rng.randint(1, 4)):
            start, count = rng.uniform(5, 25), rng.randint(1, 300)
            spread = rng.choice([0, 0.1, 1, 3])
            calls += [call(start + spread * i / count + rng.uniform(0, 0.002),
                           sizes[(b + i) % len(sizes)], tier, f"k{b % 2}" if keys else None)
                      for i in range(count)]
        calls.sort(key=lambda c: c.t)
        names = [{"name": "k0", "tier": tier}, {"name": "k1", "tier": tier}] if keys else []
        config = parse_config(table(slots, keys=names), {})
        early, without = simulate(config, calls), simulate(_without(config), calls)
        mine = [i for i, o in enumerate(early.outcomes) if o.early]
        refused += len(mine)
        wrong += sum(1 for i in mine if without.outcomes[i].code is None)
        late += sum(1 for o in without.outcomes if o.code == "queue_timeout")
    assert wrong <= 0.01 * refused, (wrong, refused)
    assert refused >= 0.25 * late, (refused, late)
