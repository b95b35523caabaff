"""A new call's wait, foreseen when it arrives, from what waits ahead of it
(``backlog``).

- *expected*: the work queued ahead of it for its likely provider — the more urgent tiers',
  and in its own tier what goes first: its own key's calls at its level or above while
  other keys wait (their backlogs queue behind it by fairness), else the tier's — served
  by the provider's slots less the floors of the less urgent tiers waiting, and no slower
  than its own tier's floor serves its tier's part; at least any pause in force, and half
  a call when no slot is free. An estimate: its error is in the metrics.
- *certain*: a wait it cannot escape. Its own key's calls of its tier that arrived one
  after another just before it (``Backlog``'s chain: each within ``GAP_SHARE`` of a slot's
  turnover of the next, counting calls refused at once) and wait at its level or above are
  ahead of it, with deadlines just before its own: they block it until each has started or
  is gone, and all of them starting takes their work (each counted at most at its
  provider's mean service time) but the last slotful, on every slot its candidates have at
  most. At least until a candidate reopens. A call whose certain wait passes its deadline
  is refused at once (``Scheduler``) instead of at its deadline; it could still have
  started only if a slot had freed in the gaps its chain leaves it (the scoreboard's
  ``early`` bound, and ``tests/test_forecast.py``, count how often: under 1 %).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..value import value
from .backlog import Backlog
from .capacity import Gate, Pool, first_open
from .tickets import Ticket

# A chain's gap, as a share of the time a slot takes to turn over (a call's estimate over
# the slots): a call arriving that much after the one before it has a deadline that much
# after, and could start in that gap only if a slot freed there.
GAP_SHARE = 0.1


def chain_s(ticket: Ticket, typical_s: float) -> float:
    """What ``ticket`` counts for in its chain: its estimate, but never more than its
    provider's mean service time (a call that claims far more than it takes, as one with a
    generous max_tokens does, must not make a wait look certain)."""
    return ticket.est_service_s if ticket.est_service_s < typical_s else typical_s


def gap_s(seconds: float, slots: int) -> float:
    """How soon after the latest call of its chain a call counted for ``seconds`` must
    arrive to extend it."""
    return GAP_SHARE * seconds / (slots if slots > 0 else 1)


@value
class Refusal:
    code: str  # queue_timeout, or key_backlog when other keys wait in its tier
    retry_after_s: float
    message: str


@value
class Forecast:
    position: int  # calls ahead of it
    expected_s: float
    certain_s: float
    own_key: bool  # other keys wait in its tier: what is certain is its key's own backlog
    typical_s: float | None  # its provider's mean service time, if it joins a chain

    def refusal(self, left_s: float, max_wait_s: float) -> Refusal | None:
        """Why the call is refused at once, if its certain wait passes the ``left_s`` to its
        deadline; with a retry-after of when the calls that block it will have started
        (a call sent again then waits little)."""
        if self.certain_s <= left_s:
            return None
        whose = "this key's" if self.own_key else "the"
        return Refusal("key_backlog" if self.own_key else "queue_timeout", self.certain_s,
                       f"{whose} calls queued ahead keep this call waiting at least "
                       f"{self.certain_s:.0f} s, past its tier's max_wait_s ({max_wait_s:g} s); "
                       "refused at once")

    def join(self, ticket: Ticket, backlog: Backlog, pools: Sequence[Pool],
             now: float) -> None:
        """``ticket``, queued now, blocks the later arrivals of its key (if it may)."""
        if self.typical_s is not None:
            seconds = chain_s(ticket, self.typical_s)
            slots = sum(p.slots for p in pools)
            backlog.arrived(ticket, now, gap_s(seconds, slots), seconds)


def starts(tickets: Iterable[Ticket], now: float) -> dict[tuple[int, str], list[float]]:
    """Per (tier, key) of the queued ``tickets``: the soonest and the latest start foreseen
    for them when they arrived, in seconds from ``now`` (negative: overdue)."""
    out: dict[tuple[int, str], list[float]] = {}
    for ticket in tickets:
        at = ticket.arrived + ticket.predicted_s - now
        found = out.get((ticket.current_tier, ticket.key))
        if found is None:
            out[(ticket.current_tier, ticket.key)] = [at, at]
        elif at < found[0]:
            found[0] = at
        elif at > found[1]:
            found[1] = at
    return out


def forecast(ticket: Ticket, backlog: Backlog, gates: tuple[Gate, ...], pools: Sequence[Pool],
             shares: Sequence[float], now: float, max_wait_s: float, promotes: bool,
             mean_s: float | None) -> Forecast:
    """``ticket``'s forecast before it joins the queue. ``mean_s``: its provider's mean
    service time, to work out the certain wait with (None: none known yet). Nothing is
    certain for a call with less than its tier's whole ``max_wait_s`` (its plan came just
    before its ticket) or one that may move up a tier (``promotes``)."""
    tier = ticket.current_tier
    typical_s = None
    if (ticket.deadline - ticket.arrived >= 0.99 * max_wait_s
            and not (ticket.ceiling < tier and promotes)):
        typical_s = mean_s
    reopen = min(max(g.paused_until, g.down_until, g.pool.paused_until) for g in gates)
    paused = reopen - now if reopen > now else 0.0
    pool = first_open(gates, now).pool
    urgent_n, urgent_s, tier_n, tier_s = backlog.ahead(pool.name, tier, ticket.level)
    waiting = backlog.keys_waiting[tier]
    others = len(waiting) - (ticket.key in waiting) > 0
    own_n, own_s = backlog.of_group(ticket) if others else (tier_n, tier_s)
    limit = pool.limit if pool.limit > 0 else 1
    share = shares[tier]
    left = 1.0 - sum(shares[t] for t in backlog.below(pool.name, tier))
    expected = (urgent_s + own_s) / (limit * (left if left > share else share or 1.0))
    if urgent_s and share and own_s / (share * limit) < expected:
        expected = own_s / (share * limit)
    if not urgent_s + own_s and pool.free(now) <= 0:
        expected = ticket.est_service_s / (2 * limit)
    certain_s = paused
    if typical_s is not None:
        slots = sum(p.slots for p in pools)
        mine = chain_s(ticket, typical_s)
        chained = backlog.chained(ticket, now, gap_s(mine, slots))
        ahead = chained / (slots if slots > 0 else 1) - mine
        certain_s = ahead if ahead > paused else paused
    return Forecast(urgent_n + own_n, expected if expected > paused else paused, certain_s,
                    others, typical_s)
