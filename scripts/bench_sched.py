"""Scheduling benchmark (docs/benchmarks.md section 2): does the right work go first?

Replays a window of the Azure LLM conversation trace, sped up, open loop, against one
simulated upstream with C slots (429 past C), through (a) a bare FCFS pass-through with one
semaphore of C and (b) the proxy with tiers tagged, in the same run, and prints per-tier
queue waits and the targets issue 7 sets. Every time printed is in trace seconds (wall
seconds x speed-up), so figures read as if the trace ran in real time.

The upstream and the FCFS gate are this same script started in another role
(``bench_sched.py upstream ...`` / ``bench_sched.py fcfs ...``), so the client, the gate
under test and the upstream are three processes, as for the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.config import Config, load_config
from proxy.config.trace import SHIPPED_TRACE, read_trace

REPO = Path(__file__).resolve().parents[1]
FULL_TRACE = REPO.parent / "shared/traces/azure_llm_conv_2023.csv"
TRACE = FULL_TRACE if FULL_TRACE.exists() else SHIPPED_TRACE
# The tier rules below are written for the shipped routing.yaml's tiers, most urgent first;
# their weights, max_wait_s and the scheduler's settings are read from it.
TIERS = ("critical", "high", "normal", "low")
RANDOM_SHARES = (0.10, 0.20, 0.40, 0.30)
# The middle tier alone fits what the urgent tier leaves: 75 % of the offered load (0.92 of
# the 28 slots at the default window) is critical or high, the overload is normal and low.
FITS_SHARES = (0.30, 0.45, 0.15, 0.10)
RULES = ("random", "size", "size-strict", "fits")
# Simulated provider, in trace seconds: first token after TTFT + prompt / PREFILL, then
# DECODE tokens a second.
TTFT_S = 0.2
PREFILL_TPS = 10_000.0
DECODE_TPS = 40.0
WORD = "word "  # one cl100k token per word
SAMPLE_HZ = 20.0
WARMUP_CALLS = 100
WARMUP_BATCH = 10


@dataclass(frozen=True)
class Call:
    at: float  # trace seconds after the window's start
    ctx: int
    gen: int
    tier: int
    body: bytes


@dataclass
class Outcome:
    tier: int
    gen: int
    status: int = 0
    code: str = ""
    wait: float = math.nan  # trace seconds in the gate's queue, or until refused
    sent: float = 0.0
    done: float = 0.0


@dataclass
class Run:
    name: str
    outcomes: list[Outcome]
    samples: list[tuple[int, int]] = field(default_factory=list)  # (queued, inflight)
    upstream: dict[str, float] = field(default_factory=dict)
    late_max_s: float = 0.0


# --- workload ------------------------------------------------------------------------


def service_s(ctx: int, gen: int) -> float:
    return TTFT_S + ctx / PREFILL_TPS + gen / DECODE_TPS


def assign_tiers(rows: Sequence[tuple[float, int, int]], rule: str, seed: int) -> list[int]:
    """random: 10 % critical, 20 % high, 40 % normal, 30 % low. fits: 30/45/15/10 %, so
    high fits what critical leaves. size-strict: by output length, shortest 20 % critical,
    next 30 % high, next 30 % normal, longest 20 % low.
    size: the same, then 20 % of calls re-drawn with the random shares (urgent calls are
    mostly short, not only short)."""
    rng = random.Random(seed)
    if rule == "fits":
        return [rng.choices(range(4), FITS_SHARES)[0] for _ in rows]
    draw = [rng.choices(range(4), RANDOM_SHARES)[0] for _ in rows]
    if rule == "random":
        return draw
    order = sorted(range(len(rows)), key=lambda i: (rows[i][2], rng.random()))
    tiers = [0] * len(rows)
    for rank, i in enumerate(order):
        q = rank / len(rows)
        tiers[i] = 0 if q < 0.2 else 1 if q < 0.5 else 2 if q < 0.8 else 3
    redraw = 0.2 if rule == "size" else 0.0
    return [draw[i] if rng.random() < redraw else t for i, t in enumerate(tiers)]


def build_calls(rows: Sequence[tuple[float, int, int]], tiers: Sequence[int]) -> list[Call]:
    calls = []
    for (t, ctx, gen), tier in zip(rows, tiers, strict=True):
        body = orjson.dumps({
            "model": "bench", "stream": True, "max_tokens": max(gen, 1),
            "messages": [{"role": "user", "content": WORD * max(ctx, 1)}],
        })
        calls.append(Call(t, ctx, gen, tier, body))
    return calls


# --- the simulated upstream (role "upstream") ----------------------------------------


def upstream_app(capacity: int, speedup: float) -> web.Application:
    state = {"active": 0, "peak": 0, "calls": 0, "refused": 0, "busy_s": 0.0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        state["calls"] += 1
        if state["active"] >= capacity:
            state["refused"] += 1
            error = {"message": "busy", "type": "rate_limit_exceeded", "param": None,
                     "code": "rate_limit_exceeded"}
            return web.json_response({"error": error}, status=429, headers={"retry-after": "1"})
        gen = int(body["max_tokens"])
        ctx = sum(len(m["content"]) for m in body["messages"]) // len(WORD)
        state["active"] += 1
        state["peak"] = max(state["peak"], state["active"])
        began = time.monotonic()
        held = True
        try:
            answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await answer.prepare(request)
            await asyncio.sleep((TTFT_S + ctx / PREFILL_TPS) / speedup)
            await answer.write(_event({"role": "assistant", "content": ""}))
            await asyncio.sleep(gen / DECODE_TPS / speedup)
            usage = {"prompt_tokens": ctx, "completion_tokens": gen, "total_tokens": ctx + gen}
            tail = (_event({"content": "ok"}) + _event({}, "length")
                    + b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"
                    + b"data: [DONE]\n\n")
            # The slot frees before the last bytes leave, so a gate that reuses it at once
            # can never be answered 429.
            state["active"] -= 1
            held = False
            state["busy_s"] += time.monotonic() - began
            await answer.write(tail)
            await answer.write_eof()
            return answer
        finally:
            if held:
                state["active"] -= 1

    async def stats(request: web.Request) -> web.Response:
        snapshot = dict(state)
        state.update(peak=state["active"], calls=0, refused=0, busy_s=0.0)
        return web.json_response(snapshot)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", stats)
    return app


def _event(delta: dict[str, str], finish: str | None = None) -> bytes:
    chunk = {"object": "chat.completion.chunk", "model": "sim",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


# --- the FCFS gate (role "fcfs") -------------------------------------------------------


SESSION = web.AppKey("session", aiohttp.ClientSession)


def fcfs_app(capacity: int, upstream: str) -> web.Application:
    gate = asyncio.Semaphore(capacity)
    state = {"queued": 0, "inflight": 0}

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        arrived = time.monotonic()
        state["queued"] += 1
        try:
            await gate.acquire()
        finally:
            state["queued"] -= 1
        state["inflight"] += 1
        try:
            waited_ms = (time.monotonic() - arrived) * 1000
            async with request.app[SESSION].post(upstream + "/v1/chat/completions", data=body,
                                        headers={"content-type": "application/json"}) as r:
                data = await r.read()
                headers = {"content-type": r.headers.get("content-type", "text/plain"),
                           "x-fcfs-queue-ms": str(round(waited_ms))}
                return web.Response(body=data, status=r.status, headers=headers)
        finally:
            state["inflight"] -= 1
            gate.release()

    async def status(request: web.Request) -> web.Response:
        return web.json_response(state)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as session:
            app[SESSION] = session
            yield

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/status", status)
    return app


async def serve_role(app: web.Application) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


# --- running the targets ----------------------------------------------------------------


# Proxy variants: name -> whether the adaptive headroom is on (scheduler.headroom_spread).
PROXY_VARIANTS: dict[str, bool] = {"proxy": True, "proxy-h0": False}


def proxy_yaml(shipped: Config, capacity: int, speedup: float, upstream: str,
               wait_scale: float, headroom: bool) -> str:
    """The shipped routing.yaml's tiers, scheduler and estimator settings with every time
    divided by the speed-up, and one provider: the simulated upstream."""

    def t(seconds: float) -> str:
        return ".inf" if math.isinf(seconds) else f"{seconds / speedup:.4g}"

    sched, est = shipped.scheduler, shipped.estimate
    tiers = "\n".join(
        f"  - {{name: {spec.name}, weight: {spec.weight}, max_wait_s: "
        f"{t(spec.max_wait_s * wait_scale)}"
        + ("" if spec.reserve is None else f", reserve: {spec.reserve}")
        + ("" if spec.max_queue is None else f", max_queue: {spec.max_queue}") + "}"
        for spec in sched.tiers
    )
    tier_promote = sched.tier_promote_after_s
    return f"""listen: {{host: 127.0.0.1, port: 0}}
tiers:
{tiers}
scheduler:
  max_queue: {sched.max_queue}
  level_bounds_s: [{", ".join(t(b) for b in sched.level_bounds_s)}]
  promote_after_s: [{", ".join(t(p) for p in sched.promote_after_s)}]
  tier_promote_after_s: {t(math.inf if tier_promote is None else tier_promote)}
  headroom_spread: {sched.headroom_spread if headroom and sched.headroom_spread is not None
                    else "false"}
  headroom_horizon_s: {t(sched.headroom_horizon_s)}
  headroom_budget: {sched.headroom_budget}
  rescue_fraction: {sched.rescue_fraction}
estimate:
  output_tokens: {est.output_tokens}
  ttft_s: {t(est.ttft_s)}
  seconds_per_token: {t(est.seconds_per_token)}
  prefill_seconds_per_token: {t(est.prefill_seconds_per_token)}
providers:
  - {{name: up, base_url: "{upstream}/v1", max_concurrency: {capacity}}}
models:
  bench: [{{provider: up, model: sim}}]
"""


@contextlib.asynccontextmanager
async def process(args: Sequence[str], log: Path) -> AsyncIterator[str]:
    """Start a server process; yields its base URL; terminates it on the way out."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *args, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"listening on "):
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{args[1:3]} did not start: {line!r}\n{tail}")
        yield line.split()[-1].decode()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def sample(session: aiohttp.ClientSession, url: str,
                 parse: Callable[[dict[str, object]], tuple[int, int]],
                 out: list[tuple[int, int]], stop: asyncio.Event) -> None:
    period = 1 / SAMPLE_HZ
    while not stop.is_set():
        tick = time.monotonic()
        async with session.get(url) as r:
            out.append(parse(await r.json()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, period - (time.monotonic() - tick)))


def proxy_state(status: dict[str, object]) -> tuple[int, int]:
    sched = status["scheduler"]
    assert isinstance(sched, dict)
    return int(sched["queued"]), int(sched["providers"]["up"]["inflight"])


def fcfs_state(status: dict[str, object]) -> tuple[int, int]:
    return int(str(status["queued"])), int(str(status["inflight"]))


async def replay(name: str, base: str, wait_header: str, status_url: str,
                 parse: Callable[[dict[str, object]], tuple[int, int]],
                 calls: Sequence[Call], speedup: float, upstream: str) -> Run:
    run = Run(name, [Outcome(c.tier, c.gen) for c in calls])
    timeout = aiohttp.ClientTimeout(total=1200 / speedup + 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(call: Call, out: Outcome) -> None:
            headers = {"content-type": "application/json", "authorization": "Bearer bench",
                       "x-priority": TIERS[call.tier]}
            out.sent = time.monotonic()
            try:
                async with session.post(base + "/v1/chat/completions", data=call.body,
                                        headers=headers) as r:
                    data = await r.read()
                    out.status = r.status
                    if r.status == 200:
                        out.wait = float(r.headers[wait_header]) / 1000 * speedup
                    else:
                        out.code = str(orjson.loads(data)["error"].get("code"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.code = type(exc).__name__
            out.done = time.monotonic()
            if out.status != 200:  # never served: all of its time was spent waiting
                out.wait = (out.done - out.sent) * speedup

        # Warm-up, so the proxy starts from learned service times as it would in service:
        # least urgent tier, so no reservation is learned from it.
        warm = [dataclasses.replace(c, tier=len(TIERS) - 1) for c in calls[:WARMUP_CALLS]]
        for i in range(0, len(warm), WARMUP_BATCH):
            await asyncio.gather(*(one(c, Outcome(c.tier, c.gen))
                                   for c in warm[i:i + WARMUP_BATCH]))
        async with session.get(upstream + "/stats") as r:
            await r.read()  # reset the upstream's counters
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(session, status_url, parse, run.samples, stop))
        tasks: list[Awaitable[None]] = []
        start = time.monotonic() + 0.2
        for call, out in zip(calls, run.outcomes, strict=True):
            due = start + call.at / speedup
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            run.late_max_s = max(run.late_max_s, (time.monotonic() - due) * speedup)
            tasks.append(asyncio.create_task(one(call, out)))
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
        async with session.get(upstream + "/stats") as r:
            run.upstream = await r.json()
    return run


async def bench(args: argparse.Namespace, shipped: Config,
                calls_by_rule: dict[str, list[Call]]) -> None:
    py = sys.executable
    me = str(Path(__file__).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="bench_sched_"))
    c, s = args.capacity, args.speedup
    async with process([py, me, "upstream", "--capacity", str(c), "--speedup", str(s)],
                       tmp / "upstream.log") as upstream:
        for rule, calls in calls_by_rule.items():
            runs: list[Run] = []
            for target in args.targets.split(","):
                if target == "fcfs":
                    async with process([py, me, "fcfs", "--capacity", str(c),
                                        "--upstream", upstream], tmp / "fcfs.log") as base:
                        runs.append(await replay(target, base, "x-fcfs-queue-ms",
                                                 base + "/status", fcfs_state, calls, s,
                                                 upstream))
                    continue
                cfg = tmp / f"{target}.yaml"
                cfg.write_text(proxy_yaml(shipped, c, s, upstream, args.wait_scale,
                                          PROXY_VARIANTS[target]))
                async with process([py, "-m", "proxy", "serve", "--config", str(cfg),
                                    "--port", "0"], tmp / f"{target}.log") as base:
                    runs.append(await replay(target, base, "x-proxy-queue-ms",
                                             base + "/admin/status", proxy_state, calls, s,
                                             upstream))
            report(rule, runs, calls, args,
                   [t.max_wait_s * args.wait_scale for t in shipped.scheduler.tiers])
    print(f"(logs and generated configs in {tmp})")


# --- the report ---------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Summary:
    waits: dict[int, list[float]]
    mean: float
    short_p99: float
    makespan: float
    throughput: float
    idle_frac: float
    free_mean: float
    errors: dict[str, int]


def summarize(run: Run, short_gen: int, speedup: float, capacity: int) -> Summary:
    ok = [o for o in run.outcomes if o.status == 200]
    waits = {t: [o.wait for o in run.outcomes if o.tier == t] for t in range(len(TIERS))}
    makespan = (max(o.done for o in run.outcomes) - min(o.sent for o in run.outcomes)) * speedup
    queued = [inflight for q, inflight in run.samples if q > 0]
    errors: dict[str, int] = {}
    for o in run.outcomes:
        if o.status != 200:
            key = f"{TIERS[o.tier]} {o.status} {o.code}"
            errors[key] = errors.get(key, 0) + 1
    return Summary(
        waits=waits,
        mean=sum(o.wait for o in run.outcomes) / len(run.outcomes),
        short_p99=pct([o.wait for o in run.outcomes if o.gen <= short_gen], 0.99),
        makespan=makespan,
        throughput=len(ok) / makespan,
        idle_frac=sum(1 for i in queued if i < capacity) / len(queued) if queued else 0.0,
        free_mean=sum(capacity - i for i in queued) / len(queued) if queued else 0.0,
        errors=errors,
    )


def report(rule: str, runs: Sequence[Run], calls: Sequence[Call], args: argparse.Namespace,
           bounds: Sequence[float]) -> None:
    """``bounds``: each tier's max_wait_s in trace seconds."""
    s, c = args.speedup, args.capacity
    short_gen = int(pct([call.gen for call in calls], 0.25))
    offered = sum(service_s(call.ctx, call.gen) for call in calls) / args.window[1]
    print(f"\n=== rule {rule}: {len(calls)} calls, offered load {offered:.1f} busy slots "
          f"over the window vs C={c} (x{offered / c:.2f}); short = GeneratedTokens <= "
          f"{short_gen}; times in trace seconds (wall x {s:g}) ===")
    print("queue wait per tier (a refused call counts its time until refused):")
    print(f"{'target':8} {'tier':8} {'count':>6} {'ok':>6} {'p50':>8} {'p99':>8} {'max':>8}")
    sums = {}
    for run in runs:
        summary = sums[run.name] = summarize(run, short_gen, s, c)
        for t, name in enumerate(TIERS):
            w = summary.waits[t]
            ok = sum(1 for o in run.outcomes if o.tier == t and o.status == 200)
            print(f"{run.name:8} {name:8} {len(w):6d} {ok:6d} {pct(w, 0.5):8.2f} "
                  f"{pct(w, 0.99):8.2f} {max(w, default=math.nan):8.2f}")
    print(f"\n{'target':8} {'mean':>7} {'shortp99':>8} {'makespan':>9} {'tput/s':>7} "
          f"{'idle|q':>7} {'free|q':>6} {'upst429':>7} {'peak':>5} {'util':>5} {'late':>6}  errors")
    for run in runs:
        m = sums[run.name]
        up = run.upstream
        util = float(up.get("busy_s", 0.0)) * s / (c * m.makespan)
        print(f"{run.name:8} {m.mean:7.2f} {m.short_p99:8.2f} {m.makespan:9.1f} "
              f"{m.throughput:7.2f} {m.idle_frac:7.3f} {m.free_mean:6.2f} "
              f"{int(up.get('refused', 0)):7d} "
              f"{int(up.get('peak', 0)):5d} {util:5.3f} {run.late_max_s:6.2f}  "
              f"{', '.join(f'{k} x{n}' for k, n in m.errors.items()) or '-'}")
    print("mean / shortp99: wait of all calls / p99 of short calls; makespan: first send "
          "to last completion; tput/s: completions per second; idle|q: share of 20 Hz samples "
          "with work queued that saw a free slot, free|q: mean free slots in those; upst429 / "
          "peak / util: upstream refusals, most concurrent calls, busy slot time / (C x "
          "makespan); late: worst send lateness.")
    if "fcfs" in sums:
        for run in runs:
            if run.name != "fcfs":
                print_checks(run, sums[run.name], runs[0], sums["fcfs"], bounds)


def print_checks(run: Run, p: Summary, fcfs: Run, f: Summary, bounds: Sequence[float]) -> None:
    lost = sum(n for k, n in p.errors.items() if "queue_timeout" not in k)
    everyone = [o.wait for o in run.outcomes]
    fcfs_everyone = [o.wait for o in fcfs.outcomes]
    lowest = len(TIERS) - 1
    checks: list[tuple[str, float, Callable[[float], bool]]] = [
        ("most urgent tier p99 wait, proxy/fcfs <= 0.05",
         _ratio(pct(p.waits[0], .99), pct(f.waits[0], .99)), lambda r: r <= 0.05),
        ("overall p99 wait, proxy/fcfs <= 1.3", _ratio(pct(everyone, .99),
                                                      pct(fcfs_everyone, .99)),
         lambda r: r <= 1.3),
        ("least urgent tier max wait, proxy/fcfs max <= 3",
         _ratio(max(p.waits[lowest], default=0.0), max(fcfs_everyone, default=0.0)),
         lambda r: r <= 3),
        ("least urgent tier max wait within its deadline (s)",
         max(p.waits[lowest], default=0.0), lambda w: w <= bounds[lowest] + 1),
        ("makespan, proxy/fcfs <= 1.02", _ratio(p.makespan, f.makespan), lambda r: r <= 1.02),
        ("calls lost within bounds (non-200 other than queue_timeout) == 0", float(lost),
         lambda r: r == 0),
    ]
    for t in (1, 2):
        served = [o.wait if o.status == 200 else math.inf for o in run.outcomes if o.tier == t]
        checks.append((f"{TIERS[t]} p99 wait (refused = inf), proxy/fcfs",
                       _ratio(pct(served, .99), pct(f.waits[t], .99)), lambda r: True))
    missed = [t for t in range(len(TIERS)) if any(
        "queue_timeout" in k and k.startswith(TIERS[t] + " ") for k in p.errors)]
    slack = [t for t in range(len(TIERS))
             if max(p.waits[t], default=0.0) < 0.5 * bounds[t]]
    inverted = [t for t in missed if any(u > t for u in slack)]
    checks.append(("tiers missing deadlines while a less urgent one had slack", len(inverted),
                   lambda n: n == 0))
    print(f"\n  {run.name} vs fcfs:")
    for label, value, ok in checks:
        print(f"  {'MET ' if ok(value) else 'MISS'} {label}: {value:.3f}")
    timeouts = sum(n for k, n in p.errors.items() if "queue_timeout" in k)
    fcfs_over = sum(1 for o in fcfs.outcomes
                    if o.status == 200 and o.wait > bounds[o.tier])
    print(f"  {run.name} queue_timeouts: {timeouts}; FCFS calls that waited past their "
          f"tier's max_wait_s: {fcfs_over}")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


# --- entry point --------------------------------------------------------------------------


def run_async(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="bench", choices=("bench", "upstream", "fcfs"))
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--config", type=Path, default=REPO / "routing.yaml",
                        help="tiers, scheduler and estimate settings to scale (not providers)")
    parser.add_argument("--capacity", type=int, default=28, help="upstream slots C")
    parser.add_argument("--speedup", type=float, default=15.0)
    parser.add_argument("--window", type=float, nargs=2, default=(60.0, 600.0),
                        metavar=("START_S", "LENGTH_S"), help="trace window, trace seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rules", default="random,size,fits",
                        help=f"tier rules, of {', '.join(RULES)}")
    parser.add_argument("--targets", default="fcfs,proxy",
                        help="fcfs, proxy, proxy-h0 (the proxy without adaptive headroom)")
    parser.add_argument("--wait-scale", type=float, default=1.0,
                        help="multiply the tiers' max_wait_s (before the speed-up)")
    parser.add_argument("--upstream", default="", help="(fcfs role) upstream base URL")
    args = parser.parse_args(argv)
    if args.role == "upstream":
        run_async(serve_role(upstream_app(args.capacity, args.speedup)))
        return
    if args.role == "fcfs":
        run_async(serve_role(fcfs_app(args.capacity, args.upstream)))
        return
    for target in args.targets.split(","):
        if target != "fcfs" and target not in PROXY_VARIANTS:
            parser.error(f"unknown target {target!r}")
    for rule in args.rules.split(","):
        if rule not in RULES:
            parser.error(f"unknown rule {rule!r}")
    shipped = load_config(args.config)
    if tuple(t.name for t in shipped.tiers) != TIERS:
        parser.error(f"{args.config}: the tier rules need the tiers {', '.join(TIERS)}")
    rows = read_trace(args.trace, *args.window)
    calls_by_rule = {
        rule: build_calls(rows, assign_tiers(rows, rule, args.seed))
        for rule in args.rules.split(",")
    }
    run_async(bench(args, shipped, calls_by_rule))


if __name__ == "__main__":
    main()
