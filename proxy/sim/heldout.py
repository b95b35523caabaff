"""Held-out workloads: the scoreboard's bounds on calls the policy was never tuned on.

The scoreboard's own workloads (``proxy.sim.scenarios``) were the ones the policy's
settings were chosen against. These were not: the seed's evening peak at other rates,
drawn with seeds 1000 and up (the tuning used seeds 0-49), and a real code trace (the
Azure LLM inference trace 2023, "code" service: ``traces/``) where the scoreboard has only
a synthetic code shape. ``python -m proxy scoreboard --held-out`` judges them with the same
bounds; ``--seeds N`` draws each N times.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config.trace import TraceCall, read_calls
from .scenarios import MIX_A, MIX_B, _mix
from .workloads import TRACE_PRIORS, TRACE_TIMING, Scenario, draws, fixed, flows, table

CODE_TRACE = Path(__file__).resolve().parents[2] / "traces" / "azure_llm_code_2023_first20min.csv"
SEED_BASE = 1000  # seeds the tuning never drew


def peak(rate: float, seed: int = 0) -> Scenario:
    """The seed's evening peak (chat 0.2 s, analysis 2.8 s, brief 10 s in the proportions
    of 15 : 2.5 : 0.3 calls/s on 10 slots) at ``rate`` x capacity for 30 s."""
    rng = draws(1, SEED_BASE + seed)
    k = rate / 1.3  # the scoreboard's peak is 1.3x
    calls = flows(rng, [("high", 15.0 * k, fixed(0.2)), ("normal", 2.5 * k, fixed(2.8)),
                        ("low", 0.3 * k, fixed(10.0))], 0.0, 30.0)
    return Scenario(f"peak-{rate:g}x", f"10 slots, the seed's peak at {rate:g}x for 30 s "
                    "(held-out seeds)", table(10), tuple(calls))


def code_trace(slots: int, mix: str, load: float, seed: int = 0) -> Scenario:
    """The shipped code trace's 20 minutes, sped up so its work is ``load`` x the capacity
    of ``slots`` on the benchmark's provider model; a seed draws the tiers."""
    rows = list(read_calls(CODE_TRACE))
    work = sum(0.2 + c.prompt_tokens / 10_000 + min(c.output_tokens, 2000) / 40 for c in rows)
    speed = load * slots * (rows[-1].t - rows[0].t) / work
    start = rows[0].t
    timed = [TraceCall((c.t - start) / speed, c.prompt_tokens, min(c.output_tokens, 2000))
             for c in rows]
    tiered = _mix(timed, MIX_A if mix == "a" else MIX_B, draws(SEED_BASE + slots, seed))
    shares = "20/50/30 % critical/normal/low" if mix == "a" else "10/20/40/30 % of the four"
    return Scenario(f"code-trace-{slots}-{mix}", f"{slots} slots, the Azure code trace at "
                    f"{load:g}x, tiers {shares}",
                    table(slots, timing=TRACE_TIMING, priors=TRACE_PRIORS), tuple(tiered))


HELD_OUT: dict[str, Callable[[int], Scenario]] = {
    "peak-1.15x": lambda seed: peak(1.15, seed),
    "peak-1.5x": lambda seed: peak(1.5, seed),
    "peak-2x": lambda seed: peak(2.0, seed),
    "code-trace-10-b": lambda seed: code_trace(10, "b", 1.1, seed),
    "code-trace-28-a": lambda seed: code_trace(28, "a", 1.1, seed),
}
