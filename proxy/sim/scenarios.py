"""The scoreboard's workloads: each a routing table and the calls it is given, seeded, so
every run replays the same calls.

Unless a scenario says otherwise, one simulated provider ``p`` serves a call in
``output_tokens / 100`` seconds (no time to first token, prompt length free), and the
estimator's priors say the same, so sizes are known; the scenarios about estimates lie on
purpose. Tiers are the shipped four (critical 8 / 10 s, high 4 / 30 s, normal 2 / 120 s,
low 1 / 900 s) unless a scenario writes its own table.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from ..config.trace import SHIPPED_TRACE, TraceCall, read_calls
from .workloads import (
    SHIPPED_TIERS,
    TOKENS_PER_S,
    TRACE_PRIORS,
    TRACE_TIMING,
    Scenario,
    call,
    draws,
    fixed,
    flows,
    lognormal,
    poisson,
    self_hosted,
    table,
)


def seed_peak(seed: int = 0, chat_tier: str = "high") -> Scenario:
    """The seed's evening peak: chat 15/s x 0.2 s, analysis 2.5/s x 2.8 s, brief 0.3/s x
    10 s on 10 slots: 1.3x capacity for 30 s, then 20 s quiet."""
    rng = draws(1, seed)
    calls = flows(rng, [(chat_tier, 15.0, fixed(0.2)), ("normal", 2.5, fixed(2.8)),
                        ("low", 0.3, fixed(10.0))], 0.0, 30.0)
    name = "seed-peak" if chat_tier == "high" else f"seed-peak-{chat_tier}"
    return Scenario(name, f"10 slots, chat ({chat_tier}) / analysis / brief at 1.3x for 30 s",
                    table(10), tuple(calls))


def critical_overload(factor: float, seed: int = 0) -> Scenario:
    """4 slots, 0.5 s calls, every max_wait_s 60: critical at ``factor`` x capacity for
    15 s, and 10 low calls at 0.3 s (evenly spaced: every seed gives the same calls)."""
    del seed
    tiers = [{**t, "max_wait_s": 60} for t in SHIPPED_TIERS]
    rate = factor * 4 / 0.5
    calls = [call(i / rate, 0.5, "critical") for i in range(int(15 * rate))]
    calls += [call(0.3, 0.5, "low") for _ in range(10)]
    return Scenario(f"critical-{factor:g}x", f"4 slots, critical at {factor:g}x for 15 s beside "
                    "10 low calls", table(4, tiers), tuple(sorted(calls, key=lambda c: c.t)),
                    low_within=("low", 20.0))


def urgent_overload(factor: float, seed: int = 0) -> Scenario:
    """8 slots, lognormal sizes around 1 s: critical and high at ``factor`` x capacity
    (3:1) for 30 s over a steady normal (0.15) and low (0.1) load."""
    rng = draws(int(factor * 10), seed)
    size = lognormal(rng, 1.0, 0.8, 10.0)
    urgent = factor * 8 / 1.0
    calls = flows(rng, [("critical", 0.75 * urgent, size), ("high", 0.25 * urgent, size),
                        ("normal", 0.15 * 8, size), ("low", 0.1 * 8, size)], 0.0, 30.0)
    return Scenario(f"urgent-{factor:g}x", f"8 slots, critical+high at {factor:g}x for 30 s "
                    "over normal and low", table(8), tuple(calls))


def noisy_neighbour(seed: int = 0, heavy_s: float = 0.5, light_s: float = 0.5,
                    claims: float = 1.0, start: float = 0.01, name: str = "") -> Scenario:
    """Two keys of tier normal, 4 slots: ``heavy`` sends 200 calls of ``heavy_s`` at once,
    ``light`` calls of ``light_s`` from ``start`` at a quarter of the capacity while the
    burst lasts (at most 40 s); every call claims ``claims`` times what it takes (the same
    calls for every seed)."""
    del seed
    keys = [{"name": "heavy", "tier": "normal"}, {"name": "light", "tier": "normal"}]
    every = light_s  # one slot of four
    calls = [call(0.0, heavy_s, "normal", "heavy", heavy_s * claims) for _ in range(200)]
    calls += [call(start + i * every, light_s, "normal", "light", light_s * claims)
              for i in range(int(min(40.0, 50 * heavy_s) / every))]
    about = (f"4 slots: one key's 200-call burst of {heavy_s:g} s beside another key's "
             f"{light_s:g} s calls at a quarter from {start:g} s"
             + (f", each claiming {claims:g}x" if claims != 1.0 else ""))
    return Scenario(name or "noisy-neighbour", about, table(4, keys=keys),
                    tuple(sorted(calls, key=lambda c: c.t)), light_key="light")


def weighted_keys(seed: int = 0) -> Scenario:
    """Keys of weight 3 and 1 in tier normal, both backlogged: 300 calls each at once (the
    same calls for every seed)."""
    del seed
    keys: list[dict[str, object]] = [{"name": "gold", "tier": "normal", "weight": 3},
                                     {"name": "bronze", "tier": "normal"}]
    calls = [call(0.0, 0.5, "normal", k) for _ in range(300) for k in ("gold", "bronze")]
    return Scenario("weighted-keys", "4 slots: keys of weight 3 and 1, both backlogged",
                    table(4, keys=keys), tuple(calls), weighted_keys=("gold", "bronze"))


def _mix(calls: Sequence[TraceCall], shares: Sequence[tuple[str, float]],
         rng: random.Random) -> list[TraceCall]:
    names, weights = [n for n, _ in shares], [w for _, w in shares]
    return [TraceCall(c.t, c.prompt_tokens, c.output_tokens, tier=rng.choices(names, weights)[0],
                      max_tokens=c.output_tokens) for c in calls]


def _by_size(calls: Sequence[TraceCall]) -> list[TraceCall]:
    """Short calls urgent: under 100 output tokens high, under 400 normal, the rest low."""
    return [TraceCall(c.t, c.prompt_tokens, c.output_tokens, max_tokens=c.output_tokens,
                      tier="high" if c.output_tokens < 100 else
                      "normal" if c.output_tokens < 400 else "low") for c in calls]


MIX_A = (("critical", 0.2), ("normal", 0.5), ("low", 0.3))
MIX_B = (("critical", 0.1), ("high", 0.2), ("normal", 0.4), ("low", 0.3))


def conversation(slots: int, mix: str, seed: int = 0) -> Scenario:
    """The shipped Azure conversation trace's first 10 minutes (about 32 busy slots on the
    benchmark's provider model), thinned to one call in ``k`` and sped up to about 1.15x
    of ``slots`` (a seed draws the tiers, not the calls)."""
    every = {4: 8, 10: 3, 28: 1}[slots]
    rows = [c for i, c in enumerate(read_calls(SHIPPED_TRACE)) if c.t < 600 and i % every == 0]
    speed = 1.15 * slots * every / 32.0
    rows = [TraceCall(c.t / speed, c.prompt_tokens, min(c.output_tokens, 2000)) for c in rows]
    tiered = _by_size(rows) if mix == "size" else _mix(rows, MIX_A if mix == "a" else MIX_B,
                                                        draws(slots, seed))
    return Scenario(f"conversation-{slots}-{mix}", f"{slots} slots, the Azure conversation "
                    f"trace at 1.15x, tiers {_mix_name(mix)}",
                    table(slots, timing=TRACE_TIMING, priors=TRACE_PRIORS), tuple(tiered))


def code(slots: int, mix: str, seed: int = 0) -> Scenario:
    """A code-completion shape (long prompts, short answers, bursts of a few seconds):
    prompts lognormal around 2,000 tokens, answers around 30, at about 1.2x of ``slots``,
    for about 2,500 calls."""
    rng = draws(slots, seed)
    rows: list[TraceCall] = []
    mean_s = 0.2 + 2000 / 10_000 + 40 / 40
    t, duration = 0.0, min(750.0, 3000.0 / slots)
    while t < duration:
        burst = rng.randint(1, 6)
        for _ in range(burst):
            prompt = int(min(rng.lognormvariate(math.log(2000) - 0.5, 1.0), 16_000))
            output = int(min(rng.lognormvariate(math.log(30) - 0.5, 1.0) + 1, 1000))
            rows.append(TraceCall(t + rng.random() * 0.5, prompt, output))
        t += rng.expovariate(1.2 * slots / mean_s / 3.5)
    rows.sort(key=lambda c: c.t)
    tiered = _mix(rows, MIX_A if mix == "a" else MIX_B, draws(slots + 1, seed))
    return Scenario(f"code-{slots}-{mix}", f"{slots} slots, a code-trace shape at about 1.2x, "
                    f"tiers {_mix_name(mix)}",
                    table(slots, timing=TRACE_TIMING, priors=TRACE_PRIORS), tuple(tiered))


def _mix_name(mix: str) -> str:
    return {"a": "20/50/30 % critical/normal/low", "b": "10/20/40/30 % of the four",
            "size": "by size (short calls high)"}[mix]


def bursts(seed: int = 0) -> Scenario:
    """8 slots: a burst of 30 high calls (1 s) every 10 s over a steady normal and low load
    (0.5 and 0.4 of the capacity, sizes around 2 s)."""
    rng = draws(7, seed)
    calls = flows(rng, [("normal", 0.5 * 8 / 2.0, lognormal(rng, 2.0, 0.6, 12.0)),
                        ("low", 0.4 * 8 / 2.0, lognormal(rng, 2.0, 0.6, 12.0))], 0.0, 120.0)
    calls += [call(b * 10.0 + i * 0.02, 1.0, "high") for b in range(12) for i in range(30)]
    return Scenario("bursts", "8 slots: 30-call bursts of high every 10 s over normal and low",
                    table(8), tuple(sorted(calls, key=lambda c: c.t)))


def beyond_the_wait(seed: int = 0) -> Scenario:
    """4 slots, 1 s calls: a key of tier high (30 s) sends 600 at once, spread over 0.2 s,
    four times what its wait lets start; another key of the tier sends one a second from
    2 s before (the same calls for every seed)."""
    del seed
    keys = [{"name": "heavy", "tier": "high"}, {"name": "light", "tier": "high"}]
    calls = [call(2.0 + i * 0.2 / 600, 1.0, "high", "heavy") for i in range(600)]
    calls += [call(0.5 + i, 1.0, "high", "light") for i in range(42)]
    return Scenario("beyond-the-wait", "4 slots: a key's burst four times what its 30 s wait "
                    "lets start, beside another key's steady calls", table(4, keys=keys),
                    tuple(sorted(calls, key=lambda c: c.t)), light_key="light")


def heavy_tail(seed: int = 0) -> Scenario:
    """8 slots at 1.2x for 300 s, sizes Pareto (alpha 1.3, 0.3 s up to 120 s), 10/20/40/30 %."""
    rng = draws(11, seed)

    def pareto() -> float:
        return min(0.3 * rng.paretovariate(1.3), 120.0)

    mean = sum(pareto() for _ in range(20_000)) / 20_000
    rate = 1.2 * 8 / mean
    calls = flows(rng, [(tier, share * rate, pareto) for tier, share in MIX_B], 0.0, 300.0)
    return Scenario("heavy-tail", "8 slots at 1.2x, Pareto sizes (0.3 s to 120 s)", table(8),
                    tuple(calls))


def lying_estimates(seed: int = 0) -> Scenario:
    """6 slots at 1.2x for 150 s: the low tier's calls ask for 40x the tokens they produce
    (a generous max_tokens), normal's claim nothing (no max_tokens: the learned average)."""
    rng = draws(13, seed)
    size = lognormal(rng, 1.0, 0.7, 8.0)
    out: list[TraceCall] = []
    for tier, rate in (("critical", 1.2), ("high", 1.2), ("normal", 2.4), ("low", 2.4)):
        for t in poisson(rng, rate, 0.0, 150.0):
            c = call(t, size(), tier)
            if tier == "low":
                c = TraceCall(c.t, 0, c.output_tokens, tier=tier, max_tokens=40 * c.output_tokens)
            elif tier == "normal":
                c = TraceCall(c.t, 0, c.output_tokens, tier=tier)
            out.append(c)
    return Scenario("lying-estimates", "6 slots at 1.2x: low over-claims 40x, normal claims "
                    "nothing", table(6), tuple(sorted(out, key=lambda c: c.t)))


def throttled(seed: int = 0) -> Scenario:
    """A provider configured for 16 slots that answers 429 past 6 (1.2x of 6 for 150 s)."""
    rng = draws(17, seed)
    size = lognormal(rng, 1.0, 0.6, 6.0)
    calls = flows(rng, [(tier, share * 1.2 * 6, size) for tier, share in MIX_B], 0.0, 150.0)
    timing: dict[str, object] = {"ttft_s": 0.0, "tokens_per_s": TOKENS_PER_S, "capacity": 6}
    return Scenario("throttled", "16 slots configured, 429 past 6, at 1.2x of 6",
                    table(16, timing=timing), tuple(calls))


def empty_above(seed: int = 0) -> Scenario:
    """A busy tier below an empty one: only normal and low, 1.3x of 8 slots for 60 s."""
    rng = draws(19, seed)
    size = lognormal(rng, 2.0, 0.7, 15.0)
    calls = flows(rng, [("normal", 0.8 * 8 / 2.0, size), ("low", 0.5 * 8 / 2.0, size)], 0.0, 60.0)
    return Scenario("empty-above", "8 slots: normal 0.8 and low 0.5 of the capacity, no "
                    "critical or high", table(8), tuple(calls))


def mixed(base: int, seed: int, load: float, slots: int, span_s: float) -> tuple[TraceCall, ...]:
    """All four tiers in ``MIX_B``'s shares, calls of about 1.5 s (lognormal, at most 10 s),
    at ``load`` times what ``slots`` slots serve, for ``span_s``."""
    rng = draws(base, seed)
    size = lognormal(rng, 1.5, 0.7, 10.0)
    return tuple(flows(rng, [(tier, share * load * slots / 1.5, size) for tier, share in MIX_B],
                       0.0, span_s))


def two_providers(seed: int = 0) -> Scenario:
    """A model served by two providers (6 + 4 slots) at 1.2x of both for 180 s."""
    return Scenario("two-providers", "one model on two providers (6 + 4 slots) at 1.2x",
                    table({"p": 6, "q": 4}), mixed(23, seed, 1.2, 10, 180.0))


def engine_slots(seed: int = 0) -> Scenario:
    """A llama.cpp server with 6 slots the routing table does not name (``engine``, no
    ``max_concurrency``: it reads them), past which calls wait inside it: all four tiers at
    1.3x for 60 s."""
    return Scenario("engine-slots", "a llama.cpp server's 6 slots, read, not configured; "
                    "1.3x for 60 s", self_hosted({"p": {"engine": "llama.cpp", "slots": 6}}),
                    mixed(31, seed, 1.3, 6, 60.0))


def engine_unequal(seed: int = 0) -> Scenario:
    """One model on two vLLM servers of 8 and 3 slots (their capacity learned from what
    waits inside and their KV-cache use): 1.2x of both for 120 s."""
    return Scenario("engine-unequal", "one model on two vLLM servers (8 + 3 slots, learned) "
                    "at 1.2x", self_hosted({"p": {"engine": "vllm", "slots": 8},
                                            "q": {"engine": "vllm", "slots": 3}}),
                    mixed(37, seed, 1.2, 11, 120.0))


def engine_slows(seed: int = 0) -> Scenario:
    """A server that takes every call but slows past 4 running (each call slower in
    proportion), no engine read: ``max_concurrency: auto`` learns a limit from latency;
    1.2x of its 4 for 120 s."""
    return Scenario("engine-slows", "a server that slows past 4 running, limit from latency, "
                    "at 1.2x", self_hosted({"p": {"max_concurrency": "auto",
                                                  "slows_past": 4}}),
                    mixed(41, seed, 1.2, 4, 120.0))


BUILDERS: dict[str, Callable[[int], Scenario]] = {
    "seed-peak": seed_peak,
    "seed-peak-critical": lambda seed: seed_peak(seed, "critical"),
    "critical-1.2x": lambda seed: critical_overload(1.2, seed=seed),
    "critical-2x": lambda seed: critical_overload(2.0, seed=seed),
    "critical-4x": lambda seed: critical_overload(4.0, seed=seed),
    "urgent-1.2x": lambda seed: urgent_overload(1.2, seed=seed),
    "urgent-2x": lambda seed: urgent_overload(2.0, seed=seed),
    "noisy-neighbour": noisy_neighbour,
    # The light key mid-burst, every call claiming 4x (a client that sends no max_tokens):
    # both keys' calls join the second level, which ages while the burst waits.
    "keys-mid-burst": lambda seed: noisy_neighbour(seed, claims=4.0, start=1.0,
                                                   name="keys-mid-burst"),
    # Unequal sizes: the light key's calls longer than the burst's, then shorter.
    "keys-long-light": lambda seed: noisy_neighbour(seed, light_s=2.0, start=7.3,
                                                    name="keys-long-light"),
    "keys-short-light": lambda seed: noisy_neighbour(seed, heavy_s=2.0, light_s=0.2, start=1.0,
                                                     name="keys-short-light"),
    "weighted-keys": weighted_keys,
    "conversation-4-a": lambda seed: conversation(4, "a", seed=seed),
    "conversation-10-b": lambda seed: conversation(10, "b", seed=seed),
    "conversation-28-size": lambda seed: conversation(28, "size", seed=seed),
    "code-4-a": lambda seed: code(4, "a", seed=seed),
    "code-10-b": lambda seed: code(10, "b", seed=seed),
    "code-28-a": lambda seed: code(28, "a", seed=seed),
    "bursts": bursts,
    "beyond-the-wait": beyond_the_wait,
    "heavy-tail": heavy_tail,
    "lying-estimates": lying_estimates,
    "throttled": throttled,
    "empty-above": empty_above,
    "two-providers": two_providers,
    "engine-slots": engine_slots,
    "engine-unequal": engine_unequal,
    "engine-slows": engine_slows,
}


def scenario(name: str, seed: int = 0) -> Scenario:
    if name not in BUILDERS:
        raise KeyError(f"unknown scenario {name!r} (one of {', '.join(BUILDERS)})")
    return BUILDERS[name](seed)
