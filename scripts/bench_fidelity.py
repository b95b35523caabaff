"""Does the simulator predict the live proxy? A slice of a trace (the shipped one, or
``--trace``) is replayed on the same routing table live (the real ``serve``, its built-in
simulated provider as the upstream, calls sent at the trace's arrival times, the first at
once; ``--live-runs`` times, to show live's own spread) and simulated (``python -m proxy
simulate``'s core on a virtual clock). Per tier mean and p99 queue wait (the live ones
from ``x-proxy-queue-ms``) and the makespan are compared, within ``BAND`` (or the
floors where waits are short); the exit status is 1 when a figure is not.

The provider's timing is the same on both sides: ``ttft_s`` + prompt /
``prefill_tokens_per_s`` (``--prefill``) + output / ``tokens_per_s``, the output being the
trace's ``GeneratedTokens`` (sent as ``max_tokens``; the simulated upstream produces exactly
that many, up to 4096) and the prompt as many tokens as the trace says, both to the
proxy's tokenizer and to the simulated upstream (which counts four characters a token).
Calls are sent whole, not streamed, and the simulator is told so (``TraceCall.stream``).

``--scenario NAME`` replays one of the scoreboard's scenarios (``proxy.sim.scenarios``)
instead, on its own routing table, each call with its tier (``X-Priority``) and key; the
waits are compared per tier and per key.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import time
from pathlib import Path

import aiohttp
import yaml
from bench_common import children, loop_factory, percentile

from proxy.config import load_config
from proxy.config.trace import SHIPPED_TRACE, TraceCall, read_calls
from proxy.sim.results import Simulation
from proxy.sim.run import simulate
from proxy.sim.scenarios import BUILDERS

# The calls' keys (so tiers), by the most urgent tier of each mix: its shares of the calls.
MIXES = {
    "high": (("chat", "high", 0.3), ("analytics", "normal", 0.3), ("batch", "low", 0.4)),
    "critical": (("ops", "critical", 0.2), ("analytics", "normal", 0.5), ("batch", "low", 0.3)),
}
# Simulated against live: within this fraction of live's figure, or these seconds where
# waits are short. Live repeats itself within 3.5 % on a tier's mean, but a p99 of a few
# dozen calls is one call's wait, and a few milliseconds of arrival order move it by a
# quarter of a second between live runs (as tests/test_fidelity.py judges).
BAND = 0.05
FLOOR_MEAN_S = 0.1
FLOOR_P99_S = 0.5
# What the simulated provider counts as one token of a prompt (four characters, one
# token to cl100k too), so both see the trace's prompt.
WORD = "the "
CONFIG = """\
listen: {{host: 127.0.0.1, port: 0}}
tiers:
  - {{name: critical, weight: 8, max_wait_s: 10}}
  - {{name: high, weight: 4, max_wait_s: 30}}
  - {{name: normal, weight: 2, max_wait_s: 120}}
  - {{name: low, weight: 1, max_wait_s: 900}}
scheduler: {{max_queue: 10000}}
classify:
  default_tier: normal
  keys:
    - {{name: ops, key: ops-key, tier: critical}}
    - {{name: chat, key: chat-key, tier: high}}
    - {{name: analytics, key: analytics-key, tier: normal}}
    - {{name: batch, key: batch-key, tier: low}}
providers:
  - name: sim
    kind: simulated
    max_concurrency: {slots}
    simulate: {{ttft_s: {ttft}, tokens_per_s: {rate}, {prefill}max_output_tokens: 4096}}
models:
  m: [{{provider: sim, model: s, max_output_tokens: 4096}}]
"""


def the_calls(path: Path, start_s: float, length_s: float, mix: str) -> list[TraceCall]:
    """The slice, from its first call on, each call given a key (so a tier) by a fixed
    pattern of shares, and sent whole."""
    rows = [c for c in read_calls(path) if start_s <= c.t < start_s + length_s]
    calls = []
    for i, call in enumerate(rows):
        share = (i * 0.618034) % 1.0  # golden-ratio spread: deterministic, well mixed
        key = next(name for name, bound in _bounds(mix) if share < bound)
        output = max(1, min(call.output_tokens, 4096))
        calls.append(TraceCall(call.t - rows[0].t, call.prompt_tokens, output, key=key,
                               max_tokens=output, stream=False))
    return calls


def _bounds(mix: str) -> list[tuple[str, float]]:
    total, out = 0.0, []
    for name, _, share in MIXES[mix]:
        total += share
        out.append((name, total))
    return out


async def live(url: str, calls: list[TraceCall],
               secret: str = "{}-key") -> tuple[list[tuple[str, str, float]], float]:
    """(tier, key, queue seconds) per answered call, and the makespan."""
    results: list[tuple[str, str, float]] = []
    ends: list[float] = []
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        started = time.monotonic()

        async def one(call: TraceCall) -> None:
            await asyncio.sleep(max(0.0, started + call.t - time.monotonic()))
            # A chat prompt costs 8 tokens besides its text (tokens.TOKENS_PER_MESSAGE...).
            body = {"model": "m", "max_tokens": call.max_tokens, "stream": call.stream,
                    "messages": [{"role": "user",
                                  "content": WORD * max(call.prompt_tokens - 8, 1)}]}
            headers = {"Authorization": f"Bearer {secret.format(call.key or 'none')}"}
            if call.tier:
                headers["X-Priority"] = call.tier
            async with session.post(f"{url}/v1/chat/completions", json=body,
                                    headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    results.append((resp.headers["x-proxy-tier"], call.key or "",
                                    int(resp.headers["x-proxy-queue-ms"]) / 1000))
                ends.append(time.monotonic())

        await asyncio.gather(*(one(c) for c in calls))
    return results, max(ends) - started


def stats(waits: list[float]) -> tuple[float, float]:
    ordered = sorted(waits)
    return (sum(ordered) / len(ordered), percentile(ordered, 0.99)) if ordered else (
        math.nan, math.nan)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", type=Path, default=SHIPPED_TRACE,
                        help="the trace (default: the shipped one)")
    parser.add_argument("--start", type=float, default=0.0, help="slice start (s)")
    parser.add_argument("--seconds", type=float, default=60.0, help="slice length (s)")
    parser.add_argument("--mix", choices=sorted(MIXES), default="high",
                        help="the tiers, by the most urgent (high: 30/30/40 %% high/normal/"
                             "low; critical: 20/50/30 %% critical/normal/low)")
    parser.add_argument("--slots", type=int, default=6, help="the provider's slots")
    parser.add_argument("--ttft", type=float, default=0.2)
    parser.add_argument("--rate", type=float, default=250.0, help="output tokens per s")
    parser.add_argument("--prefill", type=float, default=0.0,
                        help="prompt tokens per s (default: prompts cost nothing)")
    parser.add_argument("--live-runs", type=int, default=1,
                        help="replay it live this many times (live's own spread)")
    parser.add_argument("--scenario", choices=sorted(BUILDERS),
                        help="a scoreboard scenario instead of a trace slice")
    args = parser.parse_args()
    if args.scenario is not None:
        return scenario(args.scenario, args.live_runs)
    calls = the_calls(args.trace, args.start, args.seconds, args.mix)
    prefill = f"prefill_tokens_per_s: {args.prefill:g}, " if args.prefill else ""
    table = CONFIG.format(slots=args.slots, ttft=args.ttft, rate=args.rate, prefill=prefill)
    predicted, sim_took, lives = replay(table, calls, args.live_runs, "{}-key")
    print(f"{len(calls)} calls over {args.seconds:g} s of {args.trace.name} from "
          f"{args.start:g} s; provider {args.slots} slots, ttft {args.ttft} s, "
          f"{args.rate:g} tokens/s{f', {args.prefill:g} prompt tokens/s' if prefill else ''} "
          f"(simulated in {sim_took:.2f} s)")
    tiers = [tier for _, tier, _ in MIXES[args.mix]]
    return compare([(tier, [[w for t, _, w in measured if t == tier] for measured, _ in lives],
                     [o.wait_s for o in predicted.outcomes if o.tier == tier and o.code is None])
                    for tier in tiers], [span for _, span in lives], predicted.makespan_s)


def replay(table: str, calls: list[TraceCall], runs: int, secret: str) -> tuple[
        Simulation, float, list[tuple[list[tuple[str, str, float]], float]]]:
    """The calls simulated on the routing table ``table`` (its YAML), and live ``runs``
    times, each on a fresh ``serve``: (the simulation, how long it took, what each live
    run measured)."""
    with children("bench_fidelity.") as kids:
        config_path = kids.logs / "fidelity.yaml"
        config_path.write_text(table)
        config = load_config(config_path)
        started = time.perf_counter()
        predicted = simulate(config, calls)
        sim_took = time.perf_counter() - started
        lives = []
        for run in range(runs):
            name = f"proxy{run}"
            kids.start(name, [sys.executable, "-m", "proxy", "serve", "--config",
                              str(config_path), "--log-level", "WARNING"])
            url = kids.wait_listening(name)
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                lives.append(runner.run(live(url, calls, secret)))
            kids.stop(name)
    return predicted, sim_took, lives


def within(live: float, simulated: float, floor_s: float) -> bool:
    return abs(simulated - live) <= max(BAND * live, floor_s)


def compare(rows: list[tuple[str, list[list[float]], list[float]]], live_spans: list[float],
            sim_span: float) -> int:
    """One line per (name, each live run's waits, simulated waits): means and p99s, and
    whether the simulated ones are within the band of every live run's; then the
    makespans. 0 when every figure is within, else 1."""
    print(f"{'':<17}{'live mean':>21}{'sim':>8}{'live p99':>21}{'sim':>8}")
    print(f"{'tier / key':<12}{'n':>5}{'(each run)':>21}{'mean':>8}{'(each run)':>21}"
          f"{'p99':>8}   within {BAND:.0%} (or {FLOOR_MEAN_S:g} s, {FLOOR_P99_S:g} s)")
    ok = True
    for name, runs, sim_waits in rows:
        measured = [stats(waits) for waits in runs]
        sm, sp = stats(sim_waits)
        agree = all(within(lm, sm, FLOOR_MEAN_S) and within(lp, sp, FLOOR_P99_S)
                    for lm, lp in measured)
        ok = ok and agree
        means = "/".join(f"{lm:.2f}" for lm, _ in measured)
        p99s = "/".join(f"{lp:.2f}" for _, lp in measured)
        print(f"{name:<12}{len(runs[0]):>5}{means:>21}{sm:>8.2f}{p99s:>21}{sp:>8.2f}   "
              f"{'yes' if agree else 'NO'}")
    span_ok = all(abs(span - sim_span) <= 0.05 * span for span in live_spans)
    print(f"makespan live {'/'.join(f'{span:.1f}' for span in live_spans)} s, simulated "
          f"{sim_span:.1f} s ({'within' if span_ok else 'NOT within'} 5 %)")
    return 0 if ok and span_ok else 1


def scenario(name: str, runs: int) -> int:
    """A scoreboard scenario live against ``serve`` and simulated, per tier and per key."""
    chosen = BUILDERS[name](0)
    calls = [dataclasses.replace(c, stream=False) for c in chosen.calls]
    table = yaml.safe_dump({**chosen.table, "listen": {"host": "127.0.0.1", "port": 0}})
    predicted, _, lives = replay(table, calls, runs, "secret-{}")
    print(f"{name}: {chosen.about} ({len(calls)} calls)")
    config = chosen.config
    seen = {t for measured, _ in lives for t, _, _ in measured}
    rows = [(tier, [[w for t, _, w in measured if t == tier] for measured, _ in lives],
             [o.wait_s for o in predicted.outcomes if o.tier == tier and o.code is None])
            for tier in config.tier_names if tier in seen]
    keys = sorted({k for measured, _ in lives for _, k, _ in measured if k})
    rows += [(f"key {key}", [[w for _, k, w in measured if k == key] for measured, _ in lives],
              [o.wait_s for o in predicted.outcomes if o.key == key and o.code is None])
             for key in keys] if len(keys) > 1 else []
    return compare(rows, [span for _, span in lives], predicted.makespan_s)


if __name__ == "__main__":
    sys.exit(main())
