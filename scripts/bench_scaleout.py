"""Scale-out: what Redis adds per admission, and throughput with 1, 2 and 3 processes.
(docs: benchmarks.md, section 3)

- Admission: ``RedisState.lease`` on loopback with a free slot (one Lua script round trip),
  sequentially (no hand-over: a lone caller's next lease would always take the slot it
  just gave back) and with 32 callers at once; the memory backend asks nothing (0).
- Throughput: closed-loop load (aiohttp client, its own process) on ``serve`` with the
  memory backend, then with the redis backend as 1 process and as ``--workers 2`` and
  ``--workers 3`` on one port, against one fast fake upstream; targets alternated round by
  round. On a 2-core machine the load generator and the upstream share the cores with
  the proxy's processes: read the ratios, not the absolute numbers.
- Under the proxy (``--under-proxy``): the same load on the memory and the redis backend,
  1 process each, alternated round by round: the latency the client sees, and what
  ``proxy_shared_admission_seconds`` on ``/metrics`` counted meanwhile. With
  ``--latency-ms MS`` first on an upstream answering MS later (32 connections then keep
  32 LLM-like calls in flight, far below saturation), then on the instant one (the loop
  saturated). With ``--against DIR``, alternated with the proxies of another checkout too
  (its code, this venv).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import orjson
import redis
from bench_common import (
    REQUEST_TIMEOUT_S,
    ROOT,
    WARMUP_S,
    Children,
    Load,
    Sample,
    children,
    cpu_s,
    load_command,
    loop_factory,
    machine,
    machine_cpu_s,
    percentile,
    serve_loads,
    serve_until_signalled,
    upstream_app,
)

from proxy.config.state import StateSettings
from proxy.http.server.server import tune_gc
from proxy.state import batcher
from proxy.state.batcher import HANDOFF_S
from proxy.state.shared import RedisState

REDIS_URL = "redis://127.0.0.1:6379/0"
ADMISSIONS = 20_000
WARMUP_LEASES = 20  # per caller, before the counted ones
HEADERS = {"Content-Type": "application/json"}
TARGETS = {"memory x1": ("memory", 1), "redis x1": ("redis", 1),
           "redis --workers 2": ("redis", 2), "redis --workers 3": ("redis", 3)}


async def admission(calls: int, callers: int, warmup: int = WARMUP_LEASES) -> tuple[
        float, float, int]:
    """p50, p99 of one lease with a free slot, in ms, and how many were handed over from
    a call that had just ended (``proxy.state.batcher``, warm-up included); each caller's
    first ``warmup`` leases (the connection opened, the script loaded) are not timed."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    state = RedisState(StateSettings(backend="redis", url=REDIS_URL, prefix=prefix), "bench")
    state.configure({"p": 1_000_000}, [])
    await state.start(_Hooks())
    tune_gc()  # as serve does once it is up
    took: list[float] = []

    async def caller(n: int) -> None:
        for i in range(warmup + n):
            started = time.perf_counter()
            lease = await state.lease("p", 1_000_000, 0, 0.0, 10.0)
            if i >= warmup:
                took.append(time.perf_counter() - started)
            assert lease is not None
            state.release(lease)

    try:
        await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))
    finally:
        await state.close()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    took.sort()
    return percentile(took, 0.5) * 1000, percentile(took, 0.99) * 1000, state.handed


def scripts_run() -> tuple[int, int]:
    """Scripts Redis has run since it started, and the µs it spent in them (every
    client's: run the bench on a Redis of its own for exact figures)."""
    stats = redis.Redis.from_url(REDIS_URL).info("commandstats")
    found = [stats.get(name, {}) for name in ("cmdstat_evalsha", "cmdstat_eval")]
    return (sum(int(s.get("calls", 0)) for s in found),
            sum(int(s.get("usec", 0)) for s in found))


class _Hooks:
    def on_mode(self, mode: str, alive: int) -> None:
        if mode != "shared":
            raise SystemExit(f"Redis at {REDIS_URL} is not reachable")

    def on_breakers(self, open_for_s: object) -> None:
        return None


def config(upstream: str, backend: str, prefix: str, latency_ms: float = 0.0,
           jitter_ms: float = 0.0) -> str:
    """``bench-model`` on the instant upstream; with ``latency_ms``, ``bench-slow`` too, on
    the upstream answering that much later, give or take ``jitter_ms`` (its own provider)."""
    slow = latency_ms > 0
    delay = (f"{latency_ms:g}" if not jitter_ms else
             f"{max(latency_ms - jitter_ms, 0):g}-{latency_ms + jitter_ms:g}")
    return f"""\
classify: {{default_tier: normal}}
state: {{backend: {backend}, url: "{REDIS_URL}", prefix: {prefix}}}
providers:
  - {{name: fake, base_url: "{upstream}/v1", api_key: k, max_concurrency: 256}}
""" + (f"""\
  - {{name: slow, base_url: "{upstream}/delay/{delay}/v1", api_key: k,
     max_concurrency: 256}}
""" if slow else "") + """\
models:
  bench-model: [{provider: fake, model: fake-model}]
""" + ("  bench-slow: [{provider: slow, model: fake-model}]\n" if slow else "")


def body(model: str) -> bytes:
    return orjson.dumps({"model": model, "max_tokens": 16, "messages": [
        {"role": "user", "content": "Say hello in five words."}]})


def measure(kids: Children, url: str, connections: int, duration_s: float,
            payload: bytes | None = None) -> Sample:
    loadgen = kids.procs["loadgen"]
    assert loadgen.stdin is not None
    load = Load(url, payload or body("bench-model"), HEADERS, connections, duration_s)
    loadgen.stdin.write(load_command(load))
    loadgen.stdin.flush()
    line = kids.read_line("loadgen", duration_s + WARMUP_S + REQUEST_TIMEOUT_S + 10)
    return Sample(**orjson.loads(line))


def load(kids: Children) -> str:
    """The fake upstream and the load generator started; the upstream's URL."""
    me = str(Path(__file__).resolve())
    kids.start("upstream", [sys.executable, me, "--role", "upstream"])
    upstream = kids.wait_listening("upstream")
    kids.start("loadgen", [sys.executable, me, "--role", "loadgen"], stdin=True)
    return upstream


def proxy(kids: Children, name: str, upstream: str, backend: str, workers: int = 1,
          tree: Path = ROOT, latency_ms: float = 0.0, jitter_ms: float = 0.0) -> str:
    """``serve`` (of the checkout ``tree``) on a fresh prefix, started; its base URL."""
    file = kids.logs / f"{name.replace(' ', '_')}.yaml"
    file.write_text(config(upstream, backend, f"bench-{uuid.uuid4().hex[:8]}", latency_ms,
                            jitter_ms))
    kids.start(name, [sys.executable, "-m", "proxy", "serve", "--config", str(file),
                      "--port", "0", "--log-level", "WARNING", "--workers", str(workers)],
               cwd=tree)
    return kids.wait_listening(name)


def throughput(args: argparse.Namespace) -> list[str]:
    path = "/v1/chat/completions"
    lines = []
    with children("bench-scaleout-") as kids:
        upstream = load(kids)
        urls = {name: proxy(kids, name, upstream, backend, workers) + path
                for name, (backend, workers) in TARGETS.items()}
        time.sleep(3.0)  # every worker up and beating
        runs: dict[str, list[Sample]] = {name: [] for name in TARGETS}
        for _ in range(args.rounds):
            for name, url in urls.items():
                runs[name].append(measure(kids, url, args.connections, args.duration))
        base = statistics.median(s.rps for s in runs["memory x1"])
        lines.append(f"{'target':<20}{'req/s':>8}{'vs memory':>11}{'p50 ms':>8}{'p99 ms':>8}"
                     f"{'errors':>7}")
        for name, samples in runs.items():
            rps = statistics.median(s.rps for s in samples)
            lines.append(
                f"{name:<20}{rps:>8.0f}{rps / base:>11.2f}"
                f"{statistics.median(s.p50_ms for s in samples):>8.2f}"
                f"{statistics.median(s.p99_ms for s in samples):>8.2f}"
                f"{sum(s.errors for s in samples):>7}")
    return lines


def admitted(base_url: str) -> dict[str, float]:
    """``proxy_shared_admission_seconds`` on ``/metrics``: each bucket's cumulative count
    by its bound (``inf`` for ``+Inf``), and ``sum`` and ``count``."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("proxy_shared_admission_seconds_bucket"):
            found[str(float(name.split('le="')[1].rstrip('"}')))] = float(value)
        elif name in ("proxy_shared_admission_seconds_sum",
                      "proxy_shared_admission_seconds_count"):
            found[name.rsplit("_", 1)[1]] = float(value)
    return found


def quantile(got: dict[str, float], q: float) -> tuple[float, float]:
    """The ``q`` quantile of the histogram's deltas in ms: linear within its bucket, as
    Prometheus' ``histogram_quantile`` does, and the bucket's bound (the quantile is at
    most that); NaN without observations."""
    bounds = sorted((float(k), v) for k, v in got.items() if k not in ("sum", "count"))
    rank, low, below = q * got["count"], 0.0, 0.0
    for bound, cumulative in bounds:
        if cumulative >= rank > 0:
            if math.isinf(bound):
                return low * 1000, bound
            share = (rank - below) / max(cumulative - below, 1e-12)
            return (low + (bound - low) * share) * 1000, bound * 1000
        low, below = bound, cumulative
    return math.nan, math.nan


def under_proxy(args: argparse.Namespace) -> list[str]:
    """Each case (the delayed upstream, then the instant one: saturation) on the memory and
    the redis backend of each tree, alternated round by round; then the medians."""
    trees = {"this": ROOT} | ({"against": Path(args.against).resolve()}
                             if args.against else {})
    slow = f"{args.latency_ms:g}" + (f"±{args.jitter_ms:g}" if args.jitter_ms else "") + " ms"
    cases = ({slow: "bench-slow"} if args.latency_ms > 0 else {}) | {
        "instant": "bench-model"}
    lines = [f"{'upstream':<10}{'proxy':<8}{'backend':<8}{'round':>5}{'others':>7}{'req/s':>7}"
             f"{'p50 ms':>8}{'p99 ms':>8} | admission: {'mean':>5}{'p50~':>6}{'p99~':>6}"
             f"{'p99<=':>7}{'<=0.1':>7}{'<=1ms':>7}"]
    runs: dict[tuple[str, str, str], list[Sample]] = {}
    with children("bench-admission-") as kids:
        upstream = load(kids)
        bases = {(tree, backend): proxy(kids, f"{tree} {backend}", upstream, backend,
                                        tree=path, latency_ms=args.latency_ms,
                                        jitter_ms=args.jitter_ms)
                 for tree, path in trees.items() for backend in ("memory", "redis")}
        time.sleep(3.0)  # beating
        ours = [os.getpid(), redis.Redis.from_url(REDIS_URL).info("server")["process_id"],
                *(child.pid for child in kids.procs.values())]
        for number in range(args.rounds):
            for case, model in cases.items():
                for (tree, backend), base in bases.items():
                    before, cpu = admitted(base), cpu_now(ours)
                    sample = measure(kids, base + "/v1/chat/completions", args.connections,
                                     args.duration, body(model))
                    others, after = others_cores(cpu, cpu_now(ours)), admitted(base)
                    runs.setdefault((case, tree, backend), []).append(sample)
                    got = {k: after[k] - before.get(k, 0.0) for k in after}
                    lines.append(f"{case:<10}{tree:<8}{backend:<8}{number + 1:>5}"
                                 f"{others:>7.2f}{sample.rps:>7.0f}{sample.p50_ms:>8.2f}"
                                 f"{sample.p99_ms:>8.2f} | {histogram_row(got)}")
    lines.append("medians of the rounds; redis - memory: the median of each round's "
                 "difference (alternated, so paired)")
    for (case, tree, backend), samples in runs.items():
        memory = runs[(case, tree, "memory")]
        row = (f"{case:<10}{tree:<8}{backend:<8}{'':>12}"
               f"{statistics.median(s.rps for s in samples):>7.0f}"
               f"{statistics.median(s.p50_ms for s in samples):>8.2f}"
               f"{statistics.median(s.p99_ms for s in samples):>8.2f}")
        if backend == "redis":
            p50, p99 = (statistics.median(getattr(r, name) - getattr(m, name)
                                          for r, m in zip(samples, memory, strict=True))
                        for name in ("p50_ms", "p99_ms"))
            row += f" | redis - memory: p50 {p50:+.2f} ms, p99 {p99:+.2f} ms"
        lines.append(row)
    return lines


def cpu_now(pids: list[int]) -> tuple[float, float, float]:
    """The clock, the machine's CPU seconds, and those of ``pids``."""
    return time.monotonic(), machine_cpu_s(), sum(cpu_s(pid) for pid in pids)


def others_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """The cores other processes than ours used on average in between (the machine is
    shared: a row measured while others kept the cores busy says so)."""
    wall, machine_s, ours_s = (a - b for a, b in zip(after, before, strict=True))
    return max(machine_s - ours_s, 0.0) / wall


def histogram_row(got: dict[str, float]) -> str:
    count = got.get("count", 0.0)
    if not count:
        return "none (nothing asked)"
    (p50, _), (p99, bound) = quantile(got, 0.5), quantile(got, 0.99)
    within = {b: got.get(str(b), math.nan) / count for b in (0.0001, 0.001)}
    return (f"{got['sum'] / count * 1000:>16.2f}{p50:>6.2f}{p99:>6.2f}{bound:>7.2f}"
            f"{within[0.0001]:>7.1%}{within[0.001]:>7.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["upstream", "loadgen"], help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--admission-only", action="store_true",
                        help="measure admission, not throughput")
    parser.add_argument("--under-proxy", action="store_true",
                        help="measure admission under the proxy, not throughput")
    parser.add_argument("--against", metavar="DIR",
                        help="with --under-proxy: alternate with the proxy in DIR")
    parser.add_argument("--latency-ms", type=float, default=0.0, metavar="MS",
                        help="with --under-proxy: first the same load on an upstream that "
                             "answers MS later (an LLM-like call), then on the instant one")
    parser.add_argument("--jitter-ms", type=float, default=0.0, metavar="MS",
                        help="with --latency-ms: each answer up to MS sooner or later "
                             "(uniform), so the calls do not keep in step")
    args = parser.parse_args()
    if args.role == "loadgen":
        serve_loads()
        return
    if args.role == "upstream":
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve_until_signalled(upstream_app()))
        return
    print(f"machine: {machine()}")
    if args.under_proxy:
        print(f"admission under the proxy: closed loop, {args.connections} conns, "
              f"{args.rounds} rounds x {args.duration:g} s, memory and redis backends "
              f"alternated; admission: proxy_shared_admission_seconds' deltas in ms "
              f"(p50~/p99~ interpolated in their bucket, p99<= its bound); others: "
              f"the cores processes not this bench's (nor Redis) used meanwhile")
        for line in under_proxy(args):
            print(line)
        return
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        for callers, handing in ((1, False), (32, True), (32, False)):
            batcher.HANDOFF_S = HANDOFF_S if handing else -1.0
            before = scripts_run()
            p50, p99, handed = runner.run(admission(ADMISSIONS, callers))
            calls, usec = (a - b for a, b in zip(scripts_run(), before, strict=True))
            print(f"admission through Redis, {callers:>2} at once"
                  f"{'' if handing else ', none handed over'}: p50 {p50:.3f} ms, "
                  f"p99 {p99:.3f} ms (memory backend: none); "
                  f"{100 * handed / (ADMISSIONS + WARMUP_LEASES * callers):.0f} % handed "
                  f"over; Redis ran {calls} scripts, {usec / max(calls, 1):.0f} µs each")
    if args.admission_only:
        return
    print(f"throughput: closed loop, {args.connections} conns, {args.rounds} rounds x "
          f"{args.duration:g} s, targets alternated (medians)")
    for line in throughput(args):
        print(line)


if __name__ == "__main__":
    main()
