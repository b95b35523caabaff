"""A chaos soak: three ``serve`` replicas sharing one private Redis, throttling fake
providers, a steady mixed load, and one fault after another; then the checks.

    scripts/soak                                   # 10 minutes, a fault every minute
    scripts/soak --minutes 1.4 --fault-every 12    # the short form tests/test_soak.py runs
    scripts/soak --json --logs /tmp/soak-logs

The load (``--rate`` calls/s, Poisson): four tiers by ``X-Priority``, three keys, JSON and
streams, client cancels mid-queue and mid-stream, bad bodies; a budget key's calls one at
a time; a Batch API batch always running. The faults, in turn every ``--fault-every`` s:
SIGKILL a replica and start it again; restart Redis empty; pause Redis 3 s (SIGSTOP,
SIGCONT); a 429 storm from a provider; a slow provider (4 s to the first byte); SIGTERM a
replica (it drains) and start it again.

The checks (scripts/soak_checks.py) are printed at the end, and with ``--json`` as one JSON
object on the last line; the exit status is 1 if any fails. Everything stays on
127.0.0.1; every child ends with the soak. Needs ``redis-server`` on the path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from soak_batch import Batches
from soak_checks import Run, evaluate, render
from soak_fleet import PREFIX, Redis, Replica, Upstream, rss_kib
from soak_load import Clients, Load
from soak_upstream import MAX_WORDS, PROMPT_TOKENS, cost

LIMITS = {"alpha": 4, "beta": 3}
REPLICAS = 3
LEASE_TTL_S = 3.0
BEAT_S = min(1.0, LEASE_TTL_S / 3)
DRAIN_TIMEOUT_S = 8.0
BUDGET_USD = 0.02
PAUSE_S = 3.0
SLOW_DELAY_S = 4.0
FAULTS = ("kill_replica", "redis_restart_empty", "redis_pause", "storm_429",
          "slow_upstream", "term_replica")
REDIS_FAULTS = frozenset({"redis_restart_empty", "redis_pause"})
MAX_WAIT_S = {"critical": 10, "high": 15, "normal": 20, "low": 30}


def config_text(upstream: str, redis_url: str) -> str:
    tiers = "\n".join(f"  - {{name: {t}, max_wait_s: {w}}}" for t, w in MAX_WAIT_S.items())
    keys = "\n".join(
        f"    - {{name: {name}, key: sk-soak-{name[2:]}, max_tier: critical{extra}}}"
        for name, extra in (("k-a", ""), ("k-b", ", weight: 2"), ("k-c", ""),
                            ("k-budget", f", budget_usd: {{amount: {BUDGET_USD}, "
                                         "period: day}"), ("k-batch", "")))
    providers = "\n".join(f"""  - name: {name}
    base_url: {upstream}/{name}/v1
    max_concurrency: {limit}
    timeouts: {{first_byte_s: 20, response_s: 30}}""" for name, limit in LIMITS.items())
    price = "input_cost: 100, output_cost: 200"
    return f"""\
tiers:
{tiers}
classify:
  default_tier: normal
  keys:
{keys}
state: {{backend: redis, url: "{redis_url}", prefix: {PREFIX}, lease_ttl_s: {LEASE_TTL_S},
         on_error: local}}
drain_timeout_s: {DRAIN_TIMEOUT_S}
batch: {{tier: low, max_in_flight: 4}}
providers:
{providers}
models:
  chat: [{{provider: alpha, model: up-a, {price}}}, {{provider: beta, model: up-b, {price}}}]
  chat-b: [{{provider: beta, model: up-b, {price}}}]
"""


@dataclass
class Fault:
    kind: str
    start: float
    end: float = 0.0
    target: str = ""
    detail: str = ""
    settled: float = 0.0  # Redis faults: every replica shared again, plus a heartbeat
    modes: dict[str, str] = field(default_factory=dict)


class Soak:
    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args = args
        self.logs = logs
        self.redis = Redis(logs)
        self.upstream = Upstream(logs, LIMITS, self.redis.port)
        self.replicas: list[Replica] = []
        self.clients = Clients(args.call_timeout)
        self.rng = random.Random(args.seed)
        self.load = Load(self.pick, self.clients, args.rate, args.seed)
        self.redis_restarts: list[float] = []
        self.batches = Batches(self.pick, args.batch_lines, self.redis_restarts)
        self.faults: list[Fault] = []
        self.polls: list[tuple[float, str, str, int, int, int]] = []
        self.t0 = 0.0
        self.wall0 = 0.0
        self.done = asyncio.Event()

    def pick(self) -> tuple[int, int, str] | None:
        up = [r for r in self.replicas if r.up]
        if not up:
            return None
        chosen = self.rng.choice(up)
        return chosen.index, chosen.current.gen, chosen.base

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", file=sys.stderr, flush=True)

    async def start(self) -> None:
        await self.redis.start()
        await self.upstream.start()
        config = self.logs / "routing.yaml"
        config.write_text(config_text(self.upstream.url, self.redis.url))
        self.replicas = [Replica(i, config, self.logs) for i in range(REPLICAS)]
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def status(self, session: aiohttp.ClientSession,
                     replica: Replica) -> dict[str, Any] | None:
        try:
            async with session.get(f"{replica.base}/admin/status") as resp:
                found: dict[str, Any] = orjson.loads(await resp.read())
                return found
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            return None

    async def poll(self) -> None:
        """Every replica's shared-state mode twice a second; every process's RSS."""
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tick = 0
            while not self.done.is_set():
                for replica in self.replicas:
                    generation = replica.current
                    if tick % 4 == 0 and generation.ended is None:
                        kib = rss_kib(generation.proc.pid)
                        if kib is not None:
                            generation.rss.append((time.monotonic() - generation.started, kib))
                    if not replica.up:
                        continue
                    found = await self.status(session, replica)
                    if found is not None:
                        state = found["state"]
                        generation.replica_id = state["replica"]
                        self.polls.append((time.monotonic(), generation.name, state["mode"],
                                           state["replicas_alive"], state["leases_held"],
                                           state["waiting"]))
                tick += 1
                await asyncio.sleep(0.5)

    async def settle(self, fault: Fault, back: float) -> None:
        """After a Redis fault: until every replica says shared (30 s at most), at least
        two heartbeats after Redis answered again; the window ends a heartbeat later."""
        timeout = aiohttp.ClientTimeout(total=2)
        deadline = back + 30
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                modes = {}
                for replica in self.replicas:
                    if replica.up:
                        found = await self.status(session, replica)
                        modes[replica.current.name] = found["state"]["mode"] if found else "?"
                now = time.monotonic()
                fault.modes = modes
                if (set(modes.values()) == {"shared"} and now >= back + 2 * BEAT_S) or \
                        now > deadline:
                    fault.settled = now + BEAT_S
                    if now > deadline:
                        fault.detail += f"; not all shared 30 s after Redis was back: {modes}"
                    return
                await asyncio.sleep(0.2)

    async def fault(self, kind: str, n: int) -> Fault:
        fault = Fault(kind, time.monotonic())
        self.faults.append(fault)
        short = min(8.0, self.args.fault_every / 2)
        if kind in ("kill_replica", "term_replica"):
            replica = self.replicas[(n + (kind == "term_replica")) % REPLICAS]
            fault.target = replica.current.name
            if kind == "kill_replica":
                replica.kill()
            else:
                gen = await replica.terminate(DRAIN_TIMEOUT_S + 10)
                fault.detail = f"exit {gen.exit_code} after {gen.drain_s:.1f} s"
            await replica.start()
            fault.detail += f"; {replica.current.name} up"
        elif kind == "redis_restart_empty":
            self.redis.kill()
            self.redis_restarts.append(time.monotonic())
            await self.redis.start()
            await self.settle(fault, time.monotonic())
        elif kind == "redis_pause":
            self.redis.pause(True)
            await asyncio.sleep(PAUSE_S)
            self.redis.pause(False)
            await self.settle(fault, time.monotonic())
        else:
            provider = "alpha" if kind == "storm_429" else "beta"
            fault.target = provider
            order: dict[str, Any] = {"provider": provider}
            if kind == "storm_429":
                order["storm_s"] = short
                fault.detail = f"every call 429 for {short:.0f} s"
            else:
                order.update(slow_for_s=short, delay_s=SLOW_DELAY_S)
                fault.detail = f"{SLOW_DELAY_S:.0f} s to the first byte for {short:.0f} s"
            async with aiohttp.ClientSession() as session, \
                    session.post(self.upstream.url + "/_control", json=order) as resp:
                resp.raise_for_status()
            await asyncio.sleep(short)
        fault.end = time.monotonic()
        self.say(f"fault {kind} {fault.target} done {fault.detail}")
        return fault

    async def faults_in_turn(self, duration: float) -> None:
        kinds = [k for k in FAULTS if k in self.args.faults]
        n = 0
        while True:
            at = self.t0 + (n + 1) * self.args.fault_every
            if at > self.t0 + duration - self.args.fault_every / 2 or not kinds:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            kind = kinds[n % len(kinds)]
            self.say(f"fault {kind}")
            await self.fault(kind, n // len(kinds))
            n += 1
        await asyncio.sleep(max(0.0, self.t0 + duration - time.monotonic()))

    async def leases_left(self) -> dict[str, list[tuple[str, float]]]:
        client = self.redis.client()
        try:
            left: dict[str, list[tuple[str, float]]] = {}
            for kind in ("leases", "waiters", "wexp"):
                async for key in client.scan_iter(f"{PREFIX}:{kind}:*"):
                    members = await client.zrange(key, 0, -1, withscores=True)
                    if members:
                        left[key] = [(str(m), float(s)) for m, s in members]
            return left
        finally:
            await client.aclose()

    async def run(self) -> Run:
        args = self.args
        duration = args.minutes * 60
        await self.start()
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.say(f"3 replicas up, Redis on {self.redis.port}, upstream {self.upstream.url}; "
                 f"{duration:.0f} s of load, a fault every {args.fault_every:.0f} s")
        poller = asyncio.ensure_future(self.poll())
        arrivals = asyncio.ensure_future(self.load.arrivals())
        budget = asyncio.ensure_future(self.load.budget_key(0.4))
        batches = asyncio.ensure_future(self.batches.run(args.batch_tail))
        await self.faults_in_turn(duration)
        self.load.stop.set()
        self.batches.stop.set()
        load_end = time.monotonic()
        self.say("load stopped; waiting for the calls in flight and the batch")
        await asyncio.gather(arrivals, budget)
        await self.load.drain()
        await batches
        await asyncio.sleep(2.0)
        final_rss = {r.current.name: rss_kib(r.current.proc.pid) for r in self.replicas}
        statuses = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for replica in self.replicas:
                statuses[replica.current.name] = await self.status(session, replica)
        deadline = time.monotonic() + 3 * BEAT_S
        while (running := await self.leases_left()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        self.done.set()
        await poller
        self.say("draining the replicas")
        for generation in await asyncio.gather(*(
                r.terminate(DRAIN_TIMEOUT_S + 10, "at the end") for r in self.replicas)):
            self.say(f"{generation.name} exit {generation.exit_code} "
                     f"after {generation.drain_s:.1f} s")
        drained = await self.leases_left()
        async with aiohttp.ClientSession() as session, \
                session.get(self.upstream.url + "/_stats") as resp:
            upstream = orjson.loads(await resp.read())
        await self.clients.close()
        return Run(
            args=vars(args), t0=self.t0, wall0=self.wall0, load_end=load_end, limits=LIMITS,
            replicas=REPLICAS, beat_s=BEAT_S, budget_usd=BUDGET_USD,
            budget_call_usd=cost(8), max_call_usd=cost(MAX_WORDS),
            prompt_tokens=PROMPT_TOKENS, calls=self.load.calls, skipped=self.load.skipped,
            faults=[f.__dict__ for f in self.faults],
            generations=[g for r in self.replicas for g in r.generations],
            final_rss=final_rss, statuses=statuses, leases_running=running,
            leases_drained=drained, upstream=upstream, batches=self.batches.batches,
            polls=self.polls, max_wait_s=MAX_WAIT_S, drain_timeout_s=DRAIN_TIMEOUT_S)

    def stop_all(self) -> None:
        for replica in self.replicas:
            for generation in replica.generations:
                if generation.proc.poll() is None:
                    generation.proc.kill()
        self.upstream.stop()
        self.redis.kill()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="the load's length")
    parser.add_argument("--fault-every", type=float, default=60.0, metavar="S",
                        help="seconds between two faults (default 60)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"the faults, in turn (default all: {','.join(FAULTS)})")
    parser.add_argument("--rate", type=float, default=8.0, help="calls per second (Poisson)")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--batch-lines", type=int, default=40, help="lines of each batch")
    parser.add_argument("--batch-tail", type=float, default=120.0, metavar="S",
                        help="how long the last batch may take once the load stopped")
    parser.add_argument("--call-timeout", type=float, default=90.0, metavar="S",
                        help="the client's bound on one call: past it the call hung")
    parser.add_argument("--critical-p99-ms", type=float, default=1000.0,
                        help="the most the critical tier's p99 queue wait may be outside "
                             "the faults (default 1000; over the whole run: its max_wait_s)")
    parser.add_argument("--rss-window", type=float, default=60.0, metavar="S",
                        help="a replica's RSS reference: its highest in its first S seconds")
    parser.add_argument("--no-budget-check", action="store_true",
                        help="report the budget check without failing on it")
    parser.add_argument("--json", action="store_true", help="one JSON object, on the last line")
    parser.add_argument("--logs", type=Path, help="keep the logs in this folder")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    return args


async def main_async(args: argparse.Namespace, logs: Path) -> int:
    soak = Soak(args, logs)
    try:
        run = await soak.run()
    finally:
        soak.stop_all()
    report = evaluate(run)
    print(render(report))
    if args.json:
        print(orjson.dumps(report).decode())
    return 0 if report["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
        return asyncio.run(main_async(args, args.logs))
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        return asyncio.run(main_async(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
