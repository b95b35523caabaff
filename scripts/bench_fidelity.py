"""Does the simulator predict the live proxy? A slice of the shipped trace is replayed
twice on the same routing table: live (the real ``serve``, its built-in simulated provider
as the upstream, calls sent at the trace's arrival times) and simulated
(``python -m proxy simulate``'s core on a virtual clock). Per tier mean and p99 queue wait
(the live ones from ``x-proxy-queue-ms``) and the makespan are compared.

The provider's timing is the same on both sides: ``ttft_s`` + output / ``tokens_per_s``,
the output being the trace's ``GeneratedTokens`` (sent as ``max_tokens``; the simulated
upstream produces exactly that many, up to 4096).

``--scenario NAME`` replays one of the scoreboard's scenarios (``proxy.sim.scenarios``)
instead, on its own routing table, each call with its tier (``X-Priority``) and key; the
waits are compared per tier and per key.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

import aiohttp
import yaml
from bench_common import children, loop_factory, percentile

from proxy.config import load_config
from proxy.config.trace import SHIPPED_TRACE, TraceCall, read_calls
from proxy.sim.run import simulate
from proxy.sim.scenarios import BUILDERS

KEYS = (("chat", "high", 0.3), ("analytics", "normal", 0.3), ("batch", "low", 0.4))
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
    - {{name: chat, key: chat-key, tier: high}}
    - {{name: analytics, key: analytics-key, tier: normal}}
    - {{name: batch, key: batch-key, tier: low}}
providers:
  - name: sim
    kind: simulated
    max_concurrency: {slots}
    simulate: {{ttft_s: {ttft}, tokens_per_s: {rate}, max_output_tokens: 4096}}
models:
  m: [{{provider: sim, model: s, max_output_tokens: 4096}}]
"""


def the_calls(start_s: float, length_s: float) -> list[TraceCall]:
    """The slice, each call given a key (so a tier) by a fixed pattern of shares."""
    calls = []
    for i, call in enumerate(c for c in read_calls(SHIPPED_TRACE)
                             if start_s <= c.t < start_s + length_s):
        share = (i * 0.618034) % 1.0  # golden-ratio spread: deterministic, well mixed
        key = next(name for name, _, bound in _bounds() if share < bound)
        output = max(1, min(call.output_tokens, 4096))
        calls.append(TraceCall(call.t - start_s, call.prompt_tokens, output, key=key,
                               max_tokens=output))
    return calls


def _bounds() -> list[tuple[str, str, float]]:
    total, out = 0.0, []
    for name, tier, share in KEYS:
        total += share
        out.append((name, tier, total))
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
            body = {"model": "m", "max_tokens": call.max_tokens, "messages": [
                {"role": "user", "content": "hello " * max(call.prompt_tokens - 8, 1)}]}
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
    parser.add_argument("--start", type=float, default=0.0, help="slice start (s)")
    parser.add_argument("--seconds", type=float, default=60.0, help="slice length (s)")
    parser.add_argument("--slots", type=int, default=6, help="the provider's slots")
    parser.add_argument("--ttft", type=float, default=0.2)
    parser.add_argument("--rate", type=float, default=250.0, help="output tokens per s")
    parser.add_argument("--scenario", choices=sorted(BUILDERS),
                        help="a scoreboard scenario instead of a trace slice")
    args = parser.parse_args()
    if args.scenario is not None:
        return scenario(args.scenario)
    calls = the_calls(args.start, args.seconds)
    with children("bench_fidelity.") as kids:
        config_path = kids.logs / "fidelity.yaml"
        config_path.write_text(CONFIG.format(slots=args.slots, ttft=args.ttft, rate=args.rate))
        config = load_config(config_path)
        started = time.perf_counter()
        predicted = simulate(config, calls)
        sim_took = time.perf_counter() - started
        kids.start("proxy", [sys.executable, "-m", "proxy", "serve", "--config",
                             str(config_path), "--log-level", "WARNING"])
        url = kids.wait_listening("proxy")
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            measured, live_span = runner.run(live(url, calls))
    print(f"{len(calls)} calls over {args.seconds:g} s of the shipped trace; provider "
          f"{args.slots} slots, ttft {args.ttft} s, {args.rate:g} tokens/s "
          f"(simulated in {sim_took:.2f} s)")
    print(f"{'tier':<8}{'n':>6}{'live mean':>11}{'sim mean':>10}{'live p99':>10}"
          f"{'sim p99':>9}   within")
    compare([(tier, [w for t, _, w in measured if t == tier],
              [o.wait_s for o in predicted.outcomes if o.tier == tier and o.code is None])
             for _, tier, _ in KEYS], live_span, predicted.makespan_s)
    return 0


def compare(rows: list[tuple[str, list[float], list[float]]], live_span: float,
            sim_span: float) -> None:
    """One line per (name, live waits, simulated waits): means and p99s, and whether they
    agree within 15 % (0.5 s where waits are short); then the makespans."""
    for name, live_waits, sim_waits in rows:
        (lm, lp), (sm, sp) = stats(live_waits), stats(sim_waits)

        def close(a: float, b: float) -> bool:
            return abs(a - b) <= max(0.15 * a, 0.5)

        print(f"{name:<12}{len(live_waits):>6}{lm:>10.2f}s{sm:>9.2f}s{lp:>9.2f}s{sp:>8.2f}s   "
              f"{'yes' if close(lm, sm) and close(lp, sp) else 'NO'}")
    span_ok = abs(live_span - sim_span) <= 0.05 * live_span
    print(f"makespan live {live_span:.1f} s, simulated {sim_span:.1f} s "
          f"({'within' if span_ok else 'NOT within'} 5 %)")


def scenario(name: str) -> int:
    """A scoreboard scenario live against ``serve`` and simulated, per tier and per key."""
    chosen = BUILDERS[name](0)
    calls = list(chosen.calls)
    with children("bench_fidelity.") as kids:
        config_path = kids.logs / "scenario.yaml"
        config_path.write_text(yaml.safe_dump(
            {**chosen.table, "listen": {"host": "127.0.0.1", "port": 0}}))
        config = load_config(config_path)
        predicted = simulate(config, calls)
        kids.start("proxy", [sys.executable, "-m", "proxy", "serve", "--config",
                             str(config_path), "--log-level", "WARNING"])
        url = kids.wait_listening("proxy")
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            measured, live_span = runner.run(live(url, calls, secret="secret-{}"))
    print(f"{name}: {chosen.about} ({len(calls)} calls)")
    print(f"{'tier / key':<12}{'n':>6}{'live mean':>11}{'sim mean':>10}{'live p99':>10}"
          f"{'sim p99':>9}   within")
    rows = [(tier, [w for t, _, w in measured if t == tier],
             [o.wait_s for o in predicted.outcomes if o.tier == tier and o.code is None])
            for tier in config.tier_names if any(t == tier for t, _, _ in measured)]
    keys = sorted({k for _, k, _ in measured if k})
    rows += [(f"key {key}", [w for _, k, w in measured if k == key],
              [o.wait_s for o in predicted.outcomes if o.key == key and o.code is None])
             for key in keys] if len(keys) > 1 else []
    compare(rows, live_span, predicted.makespan_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
