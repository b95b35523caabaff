"""Value types of the scheduler: its settings, the ticket a call waits with, and outcomes.

``scheduler`` re-exports them: outside the core, import from there.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from ..value import value


@dataclass(frozen=True)
class TierSpec:
    """One priority tier. ``weight`` is its floor: while it has calls waiting it is served
    at least ``weight / (sum of all weights)`` of each provider's slot-seconds (0: a
    background tier, served only what the others leave). ``reserve`` is the fixed number of
    free slots per provider that less urgent tiers must leave to this tier and the more
    urgent ones; None = adaptive."""

    name: str
    weight: float = 1.0
    max_wait_s: float = 120.0
    max_queue: int | None = None
    reserve: int | None = None


@dataclass(frozen=True)
class SchedulerSettings:
    """Tiers (most urgent first) and the knobs of the queueing discipline.

    - ``level_bounds_s[i]``: the longest estimated service time that joins level ``i``;
      longer calls join the last level.
    - ``promote_after_s[i]``: how long a call waits at level ``i`` before it moves up one
      level (entry 0 is never used: level 0 is the top). The defaults let a call wait
      behind shorter ones for about ten times its level's bound: long enough that under
      sustained overload the levels do not all drain into level 0 and turn into FCFS.
    - ``tier_promote_after_s``: total wait after which a call moves up one tier, once; only
      tiers whose ``max_wait_s`` is longer ever reach it. None: never.
    - ``headroom_spread``: the adaptive headroom keeps free, for the tiers more urgent than
      a call, the slots their recent demand needs: its mean busy slots ``a`` plus
      ``headroom_spread`` times ``sqrt(a)`` (square-root staffing), less those they run
      (``headroom``); an EWMA over ``headroom_horizon_s``. None: no adaptive
      headroom (fixed ``reserve`` only).
    - ``headroom_budget``: the headroom's allowance, the share of a provider's slot-time
      that adaptive holds may leave idle while calls wait (an EWMA over
      ``ALLOWANCE_HORIZON_S``); past it they stop until the idle time decays under it.
    - ``rescue_fraction``: a call with less than this fraction of its tier's ``max_wait_s``
      left is *at risk*: it goes before the other calls of its tier, whatever their level
      or key, in deadline order (never before another tier's floor).
    - ``refuse_early``: a call whose certain wait (``forecast``) passes its
      deadline is refused when it arrives instead of at its deadline.
    """

    tiers: tuple[TierSpec, ...]
    max_queue: int = 10_000
    level_bounds_s: tuple[float, ...] = (1.0, 5.0, 30.0)
    promote_after_s: tuple[float, ...] = (math.inf, 50.0, 300.0, 600.0)
    tier_promote_after_s: float | None = None
    headroom_spread: float | None = 1.0
    headroom_horizon_s: float = 30.0
    headroom_budget: float = 0.015
    rescue_fraction: float = 0.25
    refuse_early: bool = True

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("tiers: at least one tier is needed")
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ValueError("tiers: names must be unique")
        for i, tier in enumerate(self.tiers):
            if not tier.weight >= 0 or not math.isfinite(tier.weight):
                raise ValueError(f"tiers[{i}].weight: must be a number >= 0")
            if not tier.max_wait_s > 0:
                raise ValueError(f"tiers[{i}].max_wait_s: must be positive")
            if tier.max_queue is not None and tier.max_queue < 1:
                raise ValueError(f"tiers[{i}].max_queue: must be at least 1")
            if tier.reserve is not None and tier.reserve < 0:
                raise ValueError(f"tiers[{i}].reserve: must not be negative")
        if self.max_queue < 1:
            raise ValueError("max_queue: must be at least 1")
        bounds = self.level_bounds_s
        if any(b <= 0 for b in bounds) or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError("level_bounds_s: must be positive and increasing")
        if len(self.promote_after_s) != len(bounds) + 1:
            raise ValueError(f"promote_after_s: needs one value per level ({len(bounds) + 1})")
        if any(not p > 0 for p in self.promote_after_s):
            raise ValueError("promote_after_s: must be positive")
        if self.tier_promote_after_s is not None and not self.tier_promote_after_s > 0:
            raise ValueError("tier_promote_after_s: must be positive")
        spread = self.headroom_spread
        if spread is not None and not (spread >= 0 and math.isfinite(spread)):
            raise ValueError("headroom_spread: must be a number >= 0")
        if not self.headroom_horizon_s > 0:
            raise ValueError("headroom_horizon_s: must be positive")
        if not 0 <= self.headroom_budget <= 1:
            raise ValueError("headroom_budget: must be between 0 and 1")
        if not 0 <= self.rescue_fraction <= 1:
            raise ValueError("rescue_fraction: must be between 0 and 1")

    @property
    def levels(self) -> int:
        return len(self.level_bounds_s) + 1


class TicketState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RELEASED = "released"  # its slot came back; it may be queued again (a re-try)
    REJECTED = "rejected"
    CANCELLED = "cancelled"


# Python 3.11 reads every attribute of an Enum class through EnumType.__getattr__'s
# slow hook, far slower than a plain name: the hot paths use these names.
NEW: Final = TicketState.NEW
QUEUED: Final = TicketState.QUEUED
DISPATCHED: Final = TicketState.DISPATCHED
RELEASED: Final = TicketState.RELEASED
REJECTED: Final = TicketState.REJECTED
CANCELLED: Final = TicketState.CANCELLED


@dataclass(eq=False, slots=True)
class Ticket:
    """One call asking for a slot. The fields after ``max_wait_s`` belong to the scheduler.

    ``candidates`` are deployment ids (``provider/model``; a bare pool name stands for the
    pool itself), preferred first. ``est_service_s`` is the learned estimate, charged to the
    tier's fair share and the headroom and corrected by the real service time at release;
    ``size_s`` is a stable measure of the call's size that picks its level (default: the
    estimate), so identical calls always join the same level. ``ceiling`` is the most
    urgent tier aging may move the call into. ``key`` is the call's key, which shares its
    tier with the tier's other keys by ``key_weight`` (``shares``).
    """

    tier: int
    candidates: tuple[str, ...]
    est_service_s: float
    size_s: float | None = None
    ceiling: int = 0
    payload: object = None
    max_wait_s: float | None = None  # shorter than the tier's, e.g. what a caller allows
    key: str = ""
    key_weight: float = 1.0
    state: TicketState = field(init=False, default=NEW)
    current_tier: int = field(init=False, default=0)
    level: int = field(init=False, default=0)  # by its size; its level's standing ages
    standing: int = field(init=False, default=0)  # its level's standing when last chosen
    arrived: float = field(init=False, default=math.nan)
    deadline: float = field(init=False, default=math.nan)
    dispatched_at: float = field(init=False, default=math.nan)
    beside: int = field(init=False, default=0)  # other calls on its provider when it got a slot
    deployment: str | None = field(init=False, default=None)  # the gate it went through
    pool: str | None = field(init=False, default=None)
    order: int = field(init=False, default=-1)  # arrival order, kept on re-queue
    tag: float = field(init=False, default=0.0)  # its key's virtual start: the queue's order
    key_claim_s: float = field(init=False, default=0.0)  # what its key was charged on arrival
    epoch: int = field(init=False, default=0)  # bumped on every move; older entries are stale
    visit: int = field(init=False, default=0)  # bumped on every pass through the queue
    promoted: bool = field(init=False, default=False)  # moved up a tier (once)
    queued_at: float = field(init=False, default=math.nan)  # start of this pass
    charged_s: float = field(init=False, default=0.0)  # to its floor, until released
    floor_paid_s: float = field(init=False, default=0.0)  # of it, what its tier's credit paid
    # While it runs, what of its claim beyond its charge counts against its tier's credit.
    over_s: float = field(init=False, default=0.0)
    # The floors' pace its grant counted in (Policy.choose), and where: 1 floor, 2 urgent.
    paced_in: list[float] | None = field(init=False, default=None)
    paced_as: int = field(init=False, default=0)
    waited_s: float = field(init=False, default=0.0)  # queued time over every pass
    # Foreseen when it first queued (forecast): calls ahead, the expected wait.
    position: int = field(init=False, default=0)
    predicted_s: float = field(init=False, default=0.0)
    chain: int = field(init=False, default=0)  # the arrivals it blocks (Backlog), if any
    chain_s: float = field(init=False, default=0.0)  # and what it counts for there
    generation: int = field(init=False, default=0)  # the configuration its tiers index

    def arrive(self, now: float, order: int, level_bounds_s: Sequence[float],
               tier_max_wait_s: float) -> None:
        """The first pass through the queue: the ticket's level, deadline and order."""
        self.current_tier = self.tier
        self.level = bisect.bisect_left(
            level_bounds_s, self.est_service_s if self.size_s is None else self.size_s)
        self.standing = self.level
        self.arrived = now
        self.order = order
        wait_s = self.max_wait_s  # the caller's, where it allows less than the tier
        if wait_s is None or not wait_s <= tier_max_wait_s:  # conditions, not min()/max():
            wait_s = tier_max_wait_s  # a builtin call costs more on this hot path
        self.deadline = now + (0.0 if wait_s < 0.0 else wait_s)

    def validate(self, tiers: int) -> None:
        """Refuse a submission that makes no sense (ValueError)."""
        state = self.state
        if state is not NEW and state is not RELEASED:
            raise ValueError("only a new ticket, or one whose slot came back, can be queued")
        if not 0 <= self.tier < tiers:
            raise ValueError(f"tier {self.tier} out of range")
        if not 0 <= self.ceiling <= self.tier:
            raise ValueError("ceiling must be a tier at least as urgent as the ticket's own")
        if not self.candidates:
            raise ValueError("a ticket needs at least one candidate")
        for number in (self.est_service_s, self.size_s):
            if number is not None and (not number >= 0 or not math.isfinite(number)):
                raise ValueError("est_service_s and size_s must be finite and non-negative")
        if not self.key_weight > 0 or not math.isfinite(self.key_weight):
            raise ValueError("key_weight must be a positive number")

    @property
    def wait_s(self) -> float:
        """Seconds from arrival to the last dispatch (NaN until dispatched)."""
        return self.dispatched_at - self.arrived


@value
class Dispatch:
    ticket: Ticket
    deployment: str
    pool: str


@value
class Rejection:
    ticket: Ticket
    code: str  # queue_full | evicted | queue_timeout | key_backlog | upstream_unavailable
    retry_after_s: float
    message: str | None = None  # why: set for a call refused at once by its forecast


@dataclass(slots=True)
class Decisions:
    """What the scheduler decided since it was last asked, in order."""

    dispatches: list[Dispatch] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dispatches or self.rejections)
