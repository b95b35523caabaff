"""Headroom: free slots per provider that less urgent tiers must leave to more urgent ones.

Calls cannot be preempted, so a short urgent call that arrives when every slot holds a long
job waits for the next one to finish. Keeping a few slots free avoids that.

- Adaptive (the default): the urgent tiers' recent offered load ``a``, an EWMA of arrivals
  x service seconds (estimated, corrected by what calls really took), is the number of
  slots they keep busy on average. An EWMA that starts from nothing when a tier's calls
  begin (after it was quiet) underrates them by ``1 - exp(-age / horizon)`` for a while
  (8 s into a peak, by a horizon of 30 s, it sees a quarter of it): the estimate divides
  that out, as of the tier's last arrival (bias correction, as in Adam), for an age of at
  least two thirds of a horizon and by at most the number of calls it has seen, so a first
  call counts once and a first few at most twice. Poisson arrivals need more than the mean
  at any moment: they are given ``a + spread * sqrt(a)`` slots (square-root staffing),
  counting those they already run on, so only the rest is kept free. A tier that has been
  quiet for a few of its usual gaps between arrivals (at most a horizon) holds nothing:
  with no urgent work flowing, and as soon as a burst is over, the reservation costs
  nothing. Its next call picks up what came before the pause, decayed; only a horizon
  without a call starts its demand again from nothing.
- Fixed: a tier's ``reserve`` is a plain count of free slots, replacing its adaptive value.

What is held against a tier is the largest hold of any more urgent set of tiers, at most
those tiers' floors (their share of the slots, ``floors``, less what they run),
so a hold never keeps a less urgent tier below its own floor; and never every slot of a
provider: each tier can always use one.

Holds cost capacity, so they have an allowance: adaptive holds may leave at most
``allowance`` (``scheduler.headroom_budget``) of a provider's slot-time idle while a call
waits (an EWMA over ``ALLOWANCE_HORIZON_S``); past it they stop until the idle time decays
under it. Where urgent calls refill the held slots at once (short, frequent calls), holds
cost almost nothing and always apply; where urgent calls are rare beside long ones, they
apply only as far as the allowance goes. Holds shrink as they spend it: in full until half
of the allowance is spent, then in proportion to what is left (half-size at three
quarters), so they ease off before they must stop instead of stopping all at once in the
middle of a peak, which hands every slot the urgent tier gives back to long calls together.
(What is spent, for that, is the idle time booked when the provider's last scheduling pass
began, decayed since: it only falls between passes, so holds only grow between them, and a
wake-up computed now is never late. Between passes nothing eases: with no event while slots
are held, holds stop at once when the allowance is spent, as before.) A fixed ``reserve``
is what the table says, whatever it costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Loads this far under a whole slot round down, so a trickle of urgent calls reserves nothing.
_ROUND_DOWN = 0.05
# Wake-ups are placed this much past the computed lapse so rounding cannot wake us early.
_LAPSE_MARGIN_S = 1e-6
# A tier is quiet after this many of its mean gaps between arrivals without one: Poisson
# arrivals leave a gap of 4 by chance once in 55 (chat at 15/s: every 4 s, and holds
# lapsed mid-peak), of 6 once in 400.
_QUIET_GAPS = 6.0
# The youngest age the bias correction of a tier's demand counts, in horizons: at most
# 1 / (1 - e^(-2/3)) = 2.05x (20 s at a horizon of 30 s), whatever the horizon.
_WARM_MIN_AGE = 2.0 / 3.0
# What adaptive holds left idle is an EWMA over this long.
ALLOWANCE_HORIZON_S = 30.0


class Headroom:
    def __init__(self, tiers: int, spread: float | None, horizon_s: float,
                 shares: Sequence[float], allowance: float = 1.0) -> None:
        self._tiers = tiers
        self._spread = spread
        self._allowance = allowance
        self._horizon = horizon_s
        self.shares = list(shares)
        self._load: dict[str, list[float]] = {}
        self._rate: dict[str, list[float]] = {}
        self._stamp: dict[str, list[float]] = {}
        self._quiet: dict[str, list[float]] = {}
        self._since: dict[str, list[float]] = {}  # when each tier's calls began (after quiet)
        self._warm: dict[str, list[float]] = {}  # its bias correction, at its last arrival
        self._unheard = [-math.inf] * tiers  # a provider with no arrival yet: quiet
        self._idle: dict[str, list[float]] = {}  # [idle slot-seconds (EWMA), stamp, held]

    def note_idle(self, provider: str, now: float, held: int) -> None:
        """From ``now`` on, ``held`` free slots of ``provider`` are kept from waiting calls."""
        entry = self._idle.get(provider)
        if entry is None:
            if not held:
                return
            entry = self._idle[provider] = [0.0, now, 0.0]
        elif not held and not entry[2]:
            return  # idle stays as it was, decaying from its stamp
        entry[0] = _idle_at(entry, now)
        entry[1] = now
        entry[2] = float(held)

    def book_idle(self, provider: str, now: float) -> None:
        """A scheduling pass starts: book the idle time the slots held since the last one
        added, so the pass sizes its holds by the allowance left as the next pass will see it
        (else, once note_idle has booked it, held_against says less than the pass kept
        free, and no wake-up comes for the slot in between)."""
        entry = self._idle.get(provider)
        if entry is not None and entry[2]:
            self.note_idle(provider, now, int(entry[2]))

    def allowance_end(self, provider: str, now: float, capacity: int) -> float | None:
        """When the slots held now would spend the allowance (None: they never would)."""
        entry = self._idle.get(provider)
        if entry is None or not entry[2]:
            return None
        allowance = self._allowance * capacity * ALLOWANCE_HORIZON_S
        steady = entry[2] * ALLOWANCE_HORIZON_S  # what holding them for ever tends to
        idle = _idle_at(entry, now)
        if steady <= allowance:
            return None
        if idle >= allowance:
            return now
        return now + ALLOWANCE_HORIZON_S * math.log((idle - steady) / (allowance - steady)) + (
            _LAPSE_MARGIN_S)

    def record(self, provider: str, tier: int, service_s: float, now: float) -> None:
        """A call of ``tier`` that will most likely run on ``provider`` arrived."""
        if provider not in self._load:
            self._load[provider] = [0.0] * self._tiers
            self._rate[provider] = [0.0] * self._tiers
            self._stamp[provider] = [-math.inf] * self._tiers
            self._quiet[provider] = [-math.inf] * self._tiers
            self._since[provider] = [now] * self._tiers
            self._warm[provider] = [1.0] * self._tiers
        load, rate = self._load[provider], self._rate[provider]
        stamp, quiet = self._stamp[provider], self._quiet[provider]
        since = self._since[provider]
        # A pause that held nothing while it lasted (quiet) keeps what came before it,
        # decayed; only a horizon without a call starts the tier's load again from nothing.
        away = now - stamp[tier]
        if away >= self._horizon:
            since[tier] = now
            load[tier] = rate[tier] = 0.0
        else:
            decay = math.exp(-(away if away > 0.0 else 0.0) / self._horizon)
            load[tier] *= decay
            rate[tier] *= decay
        load[tier] += service_s / self._horizon
        rate[tier] += 1.0 / self._horizon
        stamp[tier] = now
        gap = _QUIET_GAPS / rate[tier]  # conditions, not min()/max(): hot path
        quiet[tier] = now + (gap if gap < self._horizon else self._horizon)
        # The bias correction, at most the calls it has seen (rate x horizon, 1 or more): a
        # first call is taken for what it claims, not for two such calls.
        age = now - since[tier]
        youngest = _WARM_MIN_AGE * self._horizon
        warm = -1.0 / math.expm1(-(age if age > youngest else youngest) / self._horizon)
        seen = rate[tier] * self._horizon
        self._warm[provider][tier] = warm if warm < seen else seen

    def correct(self, provider: str, tier: int, delta_s: float, since: float,
                now: float) -> None:
        """A call of ``tier`` recorded at ``since`` took ``delta_s`` more (or less) than its
        estimate: the offered load learns what the call really cost."""
        load = self._load.get(provider)
        if load is None:
            return
        stamp, quiet = self._stamp[provider][tier], self._quiet[provider][tier]
        current = self._decayed(load[tier], stamp, quiet, now)
        if current <= 0.0:
            return
        age = now - since
        weight = math.exp(-(0.0 if age < 0.0 else age) / self._horizon)
        corrected = current + delta_s * weight / self._horizon
        load[tier] = corrected if corrected > 0.0 else 0.0
        self._stamp[provider][tier] = now
        # The rate decays from the same stamp, so bring it along.
        rate = self._rate[provider]
        age = now - stamp
        rate[tier] = rate[tier] * math.exp(-(0.0 if age < 0.0 else age) / self._horizon)

    def offered(self, provider: str, tier: int, now: float) -> float:
        """Recent offered load of ``tier`` on ``provider``, in busy slots, as claimed
        (bias-corrected as of its last arrival)."""
        load = self._load.get(provider)
        if load is None:
            return 0.0
        return self._decayed(load[tier], self._stamp[provider][tier],
                             self._quiet[provider][tier], now) * self._warm[provider][tier]

    def held(self, provider: str, now: float, fixed: Sequence[int | None],
             running: Sequence[int], capacity: int) -> list[int]:
        """Per tier, how many free slots of ``provider`` that tier must leave alone;
        ``running`` counts the provider's calls in flight per tier."""
        return [self.held_against(provider, tier, now, fixed, running, capacity)
                for tier in range(self._tiers)]

    def held_against(self, provider: str, tier: int, now: float, fixed: Sequence[int | None],
                     running: Sequence[int], capacity: int, adaptive: bool = True) -> int:
        """The free slots of ``provider`` that ``tier`` must leave alone: the largest hold
        of any more urgent set of tiers, never every slot (``adaptive=False``: the fixed
        reserves' alone)."""
        ceiling = capacity - 1
        if not tier or ceiling <= 0:
            return 0
        quiets = self._quiet.get(provider, self._unheard)
        loads, stamps = self._load.get(provider, quiets), self._stamp.get(provider, quiets)
        warms = self._warm.get(provider, quiets)
        shares = self.shares
        scale = self._left(provider, now, capacity) if adaptive else 0.0
        load = share = 0.0
        busy = 0
        held = 0
        for urgent in range(tier):
            if now < quiets[urgent]:  # as _decayed: a quiet tier's load is 0
                load += loads[urgent] * warms[urgent] * math.exp(
                    -(now - stamps[urgent]) / self._horizon)
            busy += running[urgent]
            share += shares[urgent]
            fixed_hold = fixed[urgent]
            if fixed_hold is not None:
                hold = fixed_hold
            elif load and scale > 0.0:  # no recent load holds nothing (as _hold, sooner)
                hold = self._hold(None, load, busy, share * capacity, scale)
            else:
                continue
            if hold > held:
                held = hold
        return ceiling if ceiling < held else held

    def lapse_time(self, provider: str, tier: int, target: int, now: float,
                   fixed: Sequence[int | None], running: Sequence[int],
                   capacity: int) -> float | None:
        """A time no later than when the slots held against ``tier`` fall to ``target`` or
        fewer, if nothing else changes (None: never, a fixed reserve holds them). Earlier is
        fine: the caller asks again then."""
        if max(capacity - 1, 0) <= target:
            return now
        latest = now
        load = share = 0.0
        busy = 0
        cutoff = math.inf
        spread = self._spread or 0.0
        scale = self._left(provider, now, capacity)
        for j in range(tier):
            own = self.offered(provider, j, now)
            load += own
            busy += running[j]
            share += self.shares[j]
            if own > 0:
                cutoff = min(cutoff, self._quiet[provider][j])
            if self._hold(fixed[j], load, busy, share * capacity, scale) <= target:
                continue
            if fixed[j] is not None:
                return None
            # The load at which scale * (a + spread * sqrt(a)) rounds to target + busy slots.
            room = (target + busy + _ROUND_DOWN) / scale
            root = (-spread + math.sqrt(spread * spread + 4 * room)) / 2
            decay = self._horizon * math.log(load / (root * root))
            latest = max(latest, min(now + decay + _LAPSE_MARGIN_S, cutoff))
        return latest

    def _left(self, provider: str, now: float, capacity: int) -> float:
        """The fraction of their size adaptive holds keep: 1.0 until half of the allowance
        is spent, then in proportion to what is left of it; 0.0 with no adaptive holds
        (none configured, or the slots held now have spent the allowance)."""
        allowance = self._allowance * capacity * ALLOWANCE_HORIZON_S
        if self._spread is None or allowance <= 0.0:
            return 0.0
        entry = self._idle.get(provider)
        if entry is None:
            return 1.0
        decay = math.exp(-(now - entry[1]) / ALLOWANCE_HORIZON_S)
        past = entry[0] * decay
        if past + entry[2] * ALLOWANCE_HORIZON_S * (1.0 - decay) >= allowance:  # as _idle_at
            return 0.0
        left = 2.0 * (1.0 - past / allowance)
        return left if left < 1.0 else 1.0

    def _hold(self, fixed: int | None, load: float, busy: int, floor_slots: float,
              scale: float) -> int:
        if fixed is not None:
            return fixed
        spread = self._spread
        if spread is None:
            return 0
        need = math.ceil(scale * (load + spread * math.sqrt(load)) - _ROUND_DOWN)
        most = int(floor_slots + 1e-9)
        return max(0, (most if most < need else need) - busy)

    def _decayed(self, value: float, stamp: float, quiet: float, now: float) -> float:
        if now >= quiet:  # lapse_time wakes up at exactly this instant
            return 0.0
        return value * math.exp(-(now - stamp) / self._horizon)


def _idle_at(entry: list[float], now: float) -> float:
    """The EWMA of idle slot-seconds at ``now``: what it was at its stamp, decayed, plus
    what the slots held since then added."""
    decay = math.exp(-(now - entry[1]) / ALLOWANCE_HORIZON_S)
    return entry[0] * decay + entry[2] * ALLOWANCE_HORIZON_S * (1.0 - decay)
