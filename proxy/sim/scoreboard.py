"""The scoreboard: every scenario (``proxy.sim.scenarios``) replayed through the proxy's own
core and under each reference discipline (``proxy.sim.disciplines``) on the same calls,
and the policy's bounds checked against them.

The bounds (each applies where its condition holds; ``-`` in the table where none does):

- ``urgent``: where another tier has traffic too, the most urgent tier with traffic waits
  (p99) at most 1.1x what strict priority gives it (or 50 ms more), plus one completion
  interval (the mean service time over the slots: without preemption a wait ends at the
  next completion, and the same calls in another order shift a tail call by about one of
  them; across seeds strict priority's own p99 moves by more), and at most 0.15x
  FCFS's where its own load fits the capacity and FCFS makes it wait (p99 of a second or
  more) without timing any of its calls out. Required where the tier's load at its peak
  fits what the floors of the less urgent tiers with traffic leave it; beyond that the
  floors are served first, as the weights say, and the bound is shown but not required
  (``beyond``). A tier's load at its peak: the most work arriving in any window of 20 of
  its mean calls (at least 5 s, at most the span of all arrivals), in busy slots per slot.
- ``floors``: over every window in which a tier had a call waiting throughout (windows of
  ``WINDOW_CALLS`` longest calls / its share / the slots, the time its floor needs to be
  served that many calls), it was served at least its weight's share of the slot-seconds
  served there, less ``LAG_CALLS`` longest calls (the stated lag). A tier's share is its
  weight over the sum of all the tiers' weights.
- ``fits``: a tier whose load at its peak, with the more urgent tiers', fits in 90 % of
  the capacity waits (p99) no longer than under FCFS (or 50 ms more).
- ``deadlines``: no call of a tier times out where WFQ or strict priority time out none of
  that tier's calls; required where the tier's load fits what the floors leave it.
- ``makespan``: at most 1.02x FCFS's plus one longest call (a non-preemptive discipline
  that starts long calls last may end one call later), where FCFS served every call.
- ``idle``: slots left free while a call waited (headroom holds, limits being found) at
  most 2 % of the slot-seconds served.
- ``keys``: beside another key's burst, a light key (sending at most its share) waits (p90)
  at most one of the longest calls plus one completion interval (that call over the
  slots): without preemption it waits for a slot to free, not for the burst; keys of
  weight 3 and 1, both backlogged, served 2-4x as many calls; ``within``: at least half of
  a tier's calls served within the stated time.
- ``early``: of the calls refused at once (their certain wait passing their deadline,
  ``proxy.core.scheduling.forecast``), at most 1 % start in time when the same calls are replayed
  with none refused at once, or under FCFS.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import Config
from ..core.quantile import percentile
from .disciplines import DISCIPLINES, reference, slots_of
from .report import summary
from .results import Simulation
from .run import simulate
from .servers import service_s
from .workloads import Scenario

LAG_CALLS = 2.0  # the stated lag of a floor, in longest calls
WINDOW_CALLS = 8.0  # a tier's windows: long enough for its floor to be this many calls
EPSILON_S = 0.05


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # False: outside the bound's condition, shown but not failing


@dataclass
class Row:
    scenario: Scenario
    reports: dict[str, dict[str, object]]
    checks: list[Check] = field(default_factory=list)
    took_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok or not c.required for c in self.checks)


def _waits(sim: Simulation, tier: str) -> list[float]:
    return sorted(o.wait_s for o in sim.outcomes if o.tier == tier and not math.isnan(o.wait_s))


def _p(sim: Simulation, tier: str, q: float) -> float:
    return percentile(_waits(sim, tier), q)


def _timeouts(sim: Simulation, tier: str) -> int:
    return sum(1 for o in sim.outcomes if o.code == "queue_timeout" and o.tier == tier)


def peak_loads(scenario: Scenario) -> dict[str, float]:
    """Per tier, the offered load of that tier and the more urgent ones, in busy slots per
    slot of capacity, at its peak: the most work arriving in any window of 20 of the tier's
    mean calls (at least 5 s, at most the span of all arrivals; each call sized on its
    first candidate)."""
    config = scenario.config
    deployment = next(iter(config.models.values())).candidates[0]
    capacity = sum(slots_of(config).values())
    names = config.tier_names
    sized: list[tuple[float, int, float]] = []
    for c in scenario.calls:
        tier = names.index(c.tier) if c.tier in names else config.classify.default_tier
        output = min(c.output_tokens, c.max_tokens or c.output_tokens)
        sized.append((c.t, tier, service_s(config, deployment, c.prompt_tokens, output)[1]))
    span = max(c.t for c in scenario.calls) - min(c.t for c in scenario.calls)
    out = {}
    for t, name in enumerate(names):
        mine = [s for _, tier, s in sized if tier == t]
        if not mine:
            out[name] = 0.0
            continue
        window = min(max(5.0, 20 * sum(mine) / len(mine)), span) or 1.0
        work = [(at, s) for at, tier, s in sized if tier <= t]
        out[name] = _peak(work, window) / (capacity * window)
    return out


def _peak(work: list[tuple[float, float]], window: float) -> float:
    """The most work arriving within any ``window`` (a span shorter than it counts whole)."""
    best = total = 0.0
    start = 0
    for end, (at, seconds) in enumerate(work):
        total += seconds
        while work[start][0] < at - window:
            total -= work[start][1]
            start += 1
        del end
        best = max(best, total)
    return best


def run(scenario: Scenario, disciplines: Sequence[str] = DISCIPLINES) -> Row:
    started = time.perf_counter()
    row = judged(scenario, replay(scenario, disciplines))
    row.took_s = time.perf_counter() - started
    return row


def replay(scenario: Scenario, disciplines: Sequence[str] = DISCIPLINES) -> dict[
        str, Simulation]:
    """The scenario's calls through the proxy's core and under each discipline."""
    config, calls = scenario.config, scenario.calls
    proxy = simulate(config, calls)
    tiers, keys = [o.tier for o in proxy.outcomes], [o.key for o in proxy.outcomes]
    return {"proxy": proxy, **{d: reference(config, calls, tiers, d, keys) for d in disciplines}}


def judged(scenario: Scenario, sims: dict[str, Simulation],
           loads: dict[str, float] | None = None, draws: int = 1) -> Row:
    """The row of ``sims``; ``loads``: each tier's load at its peak, if not the calls';
    ``draws``: how many draws of the scenario ``sims`` lay end to end."""
    row = Row(scenario, {name: summary(scenario.config, sim) for name, sim in sims.items()})
    row.checks = checks(scenario, sims, loads, draws)
    return row


def checks(scenario: Scenario, sims: dict[str, Simulation],
           loads: dict[str, float] | None = None, draws: int = 1) -> list[Check]:
    proxy, fcfs, priority = sims["proxy"], sims["fcfs"], sims["priority"]
    config = scenario.config
    load = peak_loads(scenario) if loads is None else loads
    shares = _shares(config)
    names = config.tier_names
    busy = [t for t in names if _waits(proxy, t)]
    # What the floors of the less urgent tiers with traffic leave each tier and those above.
    left = {t: 1.0 - sum(shares[u] for u in busy if names.index(u) > names.index(t))
            for t in names}
    out: list[Check] = []
    if len(busy) > 1:
        top = busy[0]
        mine, strict = _p(proxy, top, 0.99), _p(priority, top, 0.99)
        sizes = [o.service_s for o in proxy.outcomes if o.code is None]
        gap = sum(sizes) / len(sizes) / sum(slots_of(config).values()) if sizes else 0.0
        bound = max(1.1 * strict, strict + EPSILON_S) + gap
        text = (f"{top} p99 {mine:.2f} s, strict priority {strict:.2f} s (bound "
                f"{bound:.2f} s)")
        first_come = _p(fcfs, top, 0.99)
        ok = mine <= bound
        if (load[top] <= 1.0 and first_come >= 1.0
                and not any(o.code for o in fcfs.outcomes if o.tier == top)):
            text += f", FCFS {first_come:.2f} s ({mine / first_come:.2f}x)"
            ok = ok and mine <= 0.15 * first_come
        fits = load[top] <= left[top]
        if not fits:
            text += f"; its load {load[top]:.2f} is beyond the {left[top]:.2f} the floors leave"
        out.append(Check("urgent", ok, text, required=fits))
    floors = floor_check(config, proxy)
    if floors is not None:
        out.append(floors)
    fitting = []
    for tier in names:
        if load[tier] <= 0.9 and _waits(proxy, tier):
            fitting.append((tier, _p(proxy, tier, 0.99), _p(fcfs, tier, 0.99)))
    if fitting:
        worst = max(fitting, key=lambda f: f[1] - f[2])
        out.append(Check("fits", all(m <= f + EPSILON_S for _, m, f in fitting),
                         f"{worst[0]} p99 {worst[1]:.2f} s, FCFS {worst[2]:.2f} s"))
    for tier in busy:
        others = [d for d in ("wfq", "priority") if d in sims]
        if any(not _timeouts(sims[d], tier) for d in others):
            missed = _timeouts(proxy, tier)
            fits = load[tier] <= left[tier]
            out.append(Check("deadlines", not missed, f"{tier}: {missed} timed out (" + ", ".join(
                f"{d} {_timeouts(sims[d], tier)}" for d in others) + ")"
                + ("" if fits else f"; its load {load[tier]:.2f} is beyond the "
                   f"{left[tier]:.2f} the floors leave"), required=fits))
    if not any(o.code for o in fcfs.outcomes):
        longest = max(o.service_s for o in proxy.outcomes)
        ratio = proxy.makespan_s / fcfs.makespan_s if fcfs.makespan_s else 1.0
        allowance = "one longest call" if draws == 1 else f"{draws} longest calls, one a draw"
        out.append(Check("makespan",
                         proxy.makespan_s <= 1.02 * fcfs.makespan_s + draws * longest,
                         f"{ratio:.3f}x FCFS (the bound: 1.02x + {allowance}, "
                         f"{longest:.1f} s)"))
    idle, served = idle_while_waiting(proxy, sum(slots_of(config).values()))
    out.append(Check("idle", idle <= 0.02 * served, f"{idle:.1f} slot-s idle while calls "
                     f"waited, {100 * idle / served if served else 0:.2f} % of the "
                     f"{served:.0f} served"))
    out += key_checks(scenario, proxy)
    refused = early_check(scenario, proxy, fcfs)
    if refused is not None:
        out.append(refused)
    return out


def early_check(scenario: Scenario, proxy: Simulation, fcfs: Simulation) -> Check | None:
    """The ``early`` bound, where calls were refused at once: the same calls replayed
    without refusing any at once, and under FCFS, start at most 1 % of them in time."""
    early = [i for i, o in enumerate(proxy.outcomes) if o.early]
    if not early:
        return None
    config = scenario.config
    late = simulate(dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, refuse_early=False)), scenario.calls)
    wrong = [i for i in early
             if late.outcomes[i].code is None or fcfs.outcomes[i].code is None]
    return Check("early", len(wrong) <= 0.01 * len(early),
                 f"{len(early)} refused at once; {len(wrong)} of them started in time when "
                 "none is refused at once or under FCFS")


def _shares(config: Config) -> dict[str, float]:
    total = sum(t.weight for t in config.tiers)
    return {t.name: t.weight / total if total else 0.0 for t in config.tiers}


def idle_while_waiting(sim: Simulation, capacity: int) -> tuple[float, float]:
    """(slot-seconds left free while a call waited, slot-seconds served)."""
    changes: list[tuple[float, int, int]] = []  # (time, d busy, d waiting)
    for o in sim.outcomes:
        if math.isnan(o.wait_s):
            continue
        if o.code is None:
            began = o.done_at - o.service_s
            changes += [(o.arrived, 0, 1), (began, 1, -1), (o.done_at, -1, 0)]
        else:
            changes += [(o.arrived, 0, 1), (o.arrived + o.wait_s, 0, -1)]
    changes.sort()
    idle = 0.0
    busy = waiting = 0
    last = changes[0][0] if changes else 0.0
    for at, d_busy, d_waiting in changes:
        if waiting > 0 and busy < capacity:
            idle += min(waiting, capacity - busy) * (at - last)
        busy += d_busy
        waiting += d_waiting
        last = at
    return idle, sum(o.service_s for o in sim.outcomes if o.code is None)


def key_checks(scenario: Scenario, proxy: Simulation) -> list[Check]:
    out = []
    if scenario.light_key is not None:
        waits = sorted(o.wait_s for o in proxy.outcomes if o.key == scenario.light_key)
        p90 = percentile(waits, 0.9)
        longest = max(o.service_s for o in proxy.outcomes if o.code is None)
        bound = longest * (1.0 + 1.0 / sum(slots_of(scenario.config).values()))
        out.append(Check("keys", p90 <= bound,
                         f"{scenario.light_key} p90 {p90:.2f} s (bound {bound:.2f} s)"))
    if scenario.weighted_keys is not None:
        heavy, light = scenario.weighted_keys
        starts = sorted((o.done_at - o.service_s, o.key) for o in proxy.outcomes
                        if o.code is None and o.key in (heavy, light))
        # While both wait: until the first key's last call starts.
        last = min(max(s for s, k in starts if k == heavy), max(s for s, k in starts if k == light))
        served = {k: sum(1 for s, key in starts if key == k and s <= last) for k in (heavy, light)}
        ratio = served[heavy] / max(served[light], 1)
        out.append(Check("keys", 2.0 <= ratio <= 4.0,
                         f"{heavy}:{light} served {served[heavy]}:{served[light]} "
                         f"({ratio:.2f}x) while both waited"))
    if scenario.low_within is not None:
        tier, within = scenario.low_within
        mine = [o for o in proxy.outcomes if o.tier == tier]
        done = sum(1 for o in mine if o.code is None and o.done_at - o.arrived <= within)
        out.append(Check("within", 2 * done >= len(mine),
                         f"{done} of {len(mine)} {tier} calls served within {within:g} s"))
    return out


def floor_check(config: Config, sim: Simulation) -> Check | None:
    """The ``floors`` bound over sliding windows (see the module's docstring)."""
    served = [o for o in sim.outcomes if o.code is None and o.service_s > 0]
    weights = sum(t.weight for t in config.tiers)
    if not served or not weights:
        return None
    longest = max(o.service_s for o in served)
    lag = LAG_CALLS * longest
    capacity = sum(slots_of(config).values())
    names = config.tier_names
    shares = [t.weight / weights for t in config.tiers]
    windows = [WINDOW_CALLS * longest / (share * capacity) if share else math.inf
               for share in shares]
    step = min(windows) / 16
    start = min(o.arrived for o in sim.outcomes)
    end = max(o.done_at for o in sim.outcomes if not math.isnan(o.done_at))
    bins = math.ceil((end - start) / step) + 1
    index = {n: i for i, n in enumerate(names)}
    got = [[0.0] * bins for _ in names]  # slot-seconds served in each bin
    waiting: list[list[tuple[float, float]]] = [[] for _ in names]
    for o in sim.outcomes:
        t = index.get(o.tier)
        if t is None or math.isnan(o.wait_s):
            continue
        began = o.done_at - o.service_s if o.code is None else o.arrived + o.wait_s
        waiting[t].append((o.arrived, began))
        if o.code is None:
            _spread(got[t], (began - start) / step, (o.done_at - start) / step, step)
    every = [sum(g[i] for g in got) for i in range(bins)]
    checked = 0
    worst: tuple[float, str, float, float] | None = None  # (shortfall, tier, at, window)
    for t, name in enumerate(names):
        if not shares[t]:
            continue
        backlogged = _covered(waiting[t], start, step, bins)
        size = round(windows[t] / step)
        for a in range(0, bins - size + 1):
            if not all(backlogged[a:a + size]):
                continue
            checked += 1
            short = shares[t] * sum(every[a:a + size]) - lag - sum(got[t][a:a + size])
            if worst is None or short > worst[0]:
                worst = (short, name, start + a * step, windows[t])
    if not checked or worst is None:
        return Check("floors", True, "no window in which a tier waited throughout")
    short, tier, at, window = worst
    return Check("floors", short <= 1e-9, f"{checked} windows, lag {lag:.1f} slot-s; closest: "
                 f"{tier} over {window:.0f} s from {at:.0f} s, "
                 + (f"{-short:.1f} slot-s above" if short <= 0 else f"{short:.1f} slot-s short"))


def _spread(bins: list[float], a: float, b: float, step: float) -> None:
    """Add the service from bin position ``a`` to ``b`` to the bins it overlaps."""
    i = int(a)
    while i < b and i < len(bins):
        bins[i] += (min(b, i + 1) - max(a, i)) * step
        i += 1


def _covered(spans: list[tuple[float, float]], start: float, step: float,
             bins: int) -> list[bool]:
    """Bins wholly inside the union of ``spans``."""
    out = [False] * bins
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for a, b in merged:
        first = math.ceil((a - start) / step)
        last = math.floor((b - start) / step)  # bins [first, last) lie inside
        for i in range(max(first, 0), min(last, bins)):
            out[i] = True
    return out
