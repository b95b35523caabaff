"""Does a running batch delay urgent calls?  (issue: work that can wait)

The real ``serve`` with one simulated provider (8 slots, ~0.2 s a call). Urgent calls
(tier ``high``) arrive open loop, Poisson, at about half the provider's capacity, for
``--seconds``; the same arrivals run twice in this process: alone, then while a batch of
``--lines`` lines (tier ``low``, ``max_in_flight`` 64) runs. Reported: the urgent calls'
queue wait (``x-proxy-queue-ms``) p50/p99/max in both runs, the batch lines answered
during the second run against the capacity the urgent calls left idle, and the proxy's
resident memory while the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from bench_common import machine, percentile, rss_mb

CONFIG = """\
tiers:
  - {{name: high, weight: 8, max_wait_s: 30{reserve}}}
  - {{name: low, max_wait_s: 900}}
classify: {{default_tier: high}}
providers:
  - name: sim
    kind: simulated
    max_concurrency: 8
    simulate: {{ttft_s: 0.15, tokens_per_s: 400}}
models:
  m: [{{provider: sim, model: s}}]
batch: {{tier: low, max_in_flight: 64}}
storage: {{path: bench.db}}
"""
SERVICE_S = 0.2  # about: ttft and a short answer
SLOTS = 8


def chat(text: str) -> dict[str, object]:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}


async def urgent_run(base: str, seconds: float, rate: float, seed: int) -> list[float]:
    """Queue waits (s) of urgent calls arriving at ``rate`` per second."""
    rng = random.Random(seed)
    waits: list[float] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        async with session.post(f"{base}/v1/chat/completions", json=chat(f"u{i}"),
                                headers={"X-Priority": "high"}) as response:
            await response.read()
            if response.status == 200:
                waits.append(int(response.headers["x-proxy-queue-ms"]) / 1000)

    async with aiohttp.ClientSession() as session:
        tasks = []
        started = time.monotonic()
        i = 0
        while (at := time.monotonic() - started) < seconds:
            tasks.append(asyncio.ensure_future(one(session, i)))
            i += 1
            await asyncio.sleep(max(rng.expovariate(rate), 0.0))
        await asyncio.gather(*tasks)
        del at
    return waits


async def submit_batch(base: str, lines: int) -> str:
    data = b"\n".join(orjson.dumps({"custom_id": f"l{i}", "method": "POST",
                                    "url": "/v1/chat/completions", "body": chat(f"b{i}")})
                      for i in range(lines))
    async with aiohttp.ClientSession() as session:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="batch.jsonl")
        async with session.post(f"{base}/v1/files", data=form) as response:
            file_id = (await response.json())["id"]
        async with session.post(f"{base}/v1/batches", json={
                "input_file_id": file_id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}) as response:
            return str((await response.json())["id"])


async def batch_done(base: str, batch_id: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(
            f"{base}/v1/batches/{batch_id}") as response:
        return int((await response.json())["request_counts"]["completed"])


def summary(waits: list[float]) -> str:
    ordered = sorted(waits)
    return (f"n {len(ordered)}, p50 {percentile(ordered, 0.5) * 1000:.0f} ms, p99 "
            f"{percentile(ordered, 0.99) * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms, "
            f"mean {statistics.mean(ordered) * 1000:.0f} ms")


async def main(args: argparse.Namespace) -> None:
    rate = args.load * SLOTS / SERVICE_S
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        config = Path(tmp) / "routing.yaml"
        config.write_text(CONFIG.format(
            reserve=f", reserve: {args.reserve}" if args.reserve is not None else ""))
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
             "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None
            base = process.stdout.readline().split()[-1]
            await urgent_run(base, 2.0, rate, 0)  # warm up the estimators
            alone = await urgent_run(base, args.seconds, rate, 1)
            batch_id = await submit_batch(base, args.lines)
            await asyncio.sleep(2.0)  # the batch fills the idle slots
            before = await batch_done(base, batch_id)
            started = time.monotonic()
            together = await urgent_run(base, args.seconds, rate, 1)
            elapsed = time.monotonic() - started
            lines = await batch_done(base, batch_id) - before
            rss = rss_mb(process.pid)
        finally:
            process.terminate()
            process.wait(30)
    idle = SLOTS * elapsed - len(together) * SERVICE_S  # slot-seconds urgent calls left
    print(f"machine: {machine()}")
    print(f"urgent calls at {rate:.0f}/s ({args.load:.0%} of {SLOTS} slots x {SERVICE_S} s), "
          f"{args.seconds:g} s per run, same arrivals in both runs; high tier reserve: "
          f"{'adaptive' if args.reserve is None else args.reserve}")
    print(f"urgent queue wait, alone:              {summary(alone)}")
    print(f"urgent queue wait, {args.lines}-line batch running: {summary(together)}")
    print(f"batch lines answered meanwhile: {lines} in {elapsed:.1f} s = "
          f"{lines * SERVICE_S / max(idle, 1e-9):.0%} of the idle capacity "
          f"({idle:.0f} slot-seconds at ~{SERVICE_S} s a line)")
    print(f"proxy resident memory with the batch running: {rss[0]:.0f} MiB (peak {rss[1]:.0f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--reserve", type=int, default=None,
                        help="the urgent tier's reserve (slots the batch tier must leave it; "
                             "default: adaptive headroom)")
    parser.add_argument("--load", type=float, default=0.5,
                        help="urgent load as a fraction of the provider's capacity")
    asyncio.run(main(parser.parse_args()))
