"""What the settings make of the scheduler: its queues and the policy's state (floors,
headroom, keys' shares, charges), built when it starts and anew on a reload, which carries
every call over into them (``reload``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from .backlog import Backlog
from .capacity import Capacity
from .charges import Charges
from .floors import Floors
from .generations import TierMaps
from .headroom import Headroom
from .policy import Policy
from .queues import TicketQueues
from .shares import KeyStats, KeyTags
from .tickets import SchedulerSettings, Ticket

# A level's oldest call waits at most this fraction of its tier's max_wait_s before the
# level stands one up (or promote_after_s, if that is sooner): shorter calls go first, but a
# long call of an urgent tier is not kept waiting long behind them.
LEVEL_AGING = 0.02


class Parts(NamedTuple):
    settings: SchedulerSettings
    queues: TicketQueues
    floors: Floors
    headroom: Headroom
    policy: Policy
    charges: Charges


def build(settings: SchedulerSettings, capacity: Capacity) -> Parts:
    """The queues and the policy's state for ``settings`` (empty: nothing queued)."""
    count = len(settings.tiers)
    promote = settings.tier_promote_after_s
    stats = KeyStats(count)
    queues = TicketQueues(
        count, settings.levels,
        [[min(after, LEVEL_AGING * t.max_wait_s) for after in settings.promote_after_s]
         for t in settings.tiers],
        [promote if promote is not None and promote < t.max_wait_s else math.inf
         for t in settings.tiers],
        capacity.gates_by_pool,
        Backlog(count, settings.levels),
        stats.queued,
    )
    weights = [t.weight for t in settings.tiers]
    floors = Floors(weights)
    headroom = Headroom(count, settings.headroom_spread, settings.headroom_horizon_s,
                        floors.shares, settings.headroom_budget)
    policy = Policy(settings, queues, floors, headroom)
    queues.on_emptied = policy.emptied
    charges = Charges(policy, queues, floors, headroom, KeyTags(count), stats)
    return Parts(settings, queues, floors, headroom, policy, charges)


def reload(parts: Parts, settings: SchedulerSettings, tier_map: Sequence[int],
           tier_maps: TierMaps, running: Collection[Ticket], capacity: Capacity,
           pools: Mapping[str, int], deployments: Mapping[str, str], now: float) -> Parts:
    """A new configuration losing no call: ``tier_map[i]`` is the new index
    of old tier ``i``. Queued calls keep their arrival order, deadline, level and
    candidates; running calls keep their slots. Providers and deployments are only
    added (what a call still names keeps its limit, pauses and gates); ``pools`` sets
    each one's maximum. Floors, keys' shares (from the calls queued, in arrival order) and
    headroom history start over."""
    if len(tier_map) != len(parts.settings.tiers) or not all(
            0 <= t < len(settings.tiers) for t in tier_map):
        raise ValueError("tier_map must give every old tier a new one")
    queued = list(parts.queues)
    means = parts.policy.means
    parts = build(settings, capacity)
    parts.policy.means.update(means)
    tier_maps.add(tier_map)
    for ticket in [*queued, *running]:
        tier_maps.bring_up(ticket, settings.levels)
    parts.charges.retag(queued, running, {
        t: capacity.gates_and_pools(t.candidates)[1][0].name for t in queued})
    capacity.recount(len(settings.tiers), running)
    for name, limit in pools.items():
        capacity.set_max(name, limit, now)
    for deployment, pool in deployments.items():
        capacity.add_gate(deployment, pool)
    for ticket in queued:
        parts.queues.add(ticket)
    return parts
