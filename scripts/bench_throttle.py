"""Throttling benchmark: upstreams that really allow fewer calls than the proxy is told.

Two fake upstreams answer 429 (with ``retry-after``) past their real concurrency: A
allows 6 of its configured 8, B 4 of its configured 6. An open-loop Poisson load in four
tiers (10/20/40/30 %) overloads both for ``--seconds``, then drains. Reported:

- client-visible failures other than the proxy's own ``queue_timeout`` (goal: none);
- per upstream, its mean calls in flight while work waited in the proxy, over what it
  really accepts (goal: >= 0.9), the 429s it answered, and the proxy's adaptive limit.

Every process is local (127.0.0.1): the upstreams and the proxy are children of this script.

    .venv/bin/python scripts/bench_throttle.py [--seconds 60] [--rate 25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from bench_common import children, loop_factory, serve_until_signalled

TIERS = ("critical", "high", "normal", "low")
SHARES = (0.10, 0.20, 0.40, 0.30)
UPSTREAMS = {"a": (8, 6), "b": (6, 4)}  # name: (configured max_concurrency, real capacity)
TOKENS_PER_S = 400.0
SAMPLE_HZ = 20.0


# --- the upstream (role "upstream") ------------------------------------------------------


def upstream_app(capacity: int, retry_after: str) -> web.Application:
    state = {"active": 0, "refused": 0, "served": 0, "peak": 0}

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if state["active"] >= capacity:
            state["refused"] += 1
            return web.json_response(
                {"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                           "code": "rate_limit_exceeded"}},
                status=429, headers={"retry-after": retry_after})
        state["active"] += 1
        state["peak"] = max(state["peak"], state["active"])
        try:
            tokens = int(body.get("max_tokens") or 64)
            await asyncio.sleep(0.02 + tokens / TOKENS_PER_S)
        finally:
            state["active"] -= 1
        state["served"] += 1
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": tokens,
                      "total_tokens": 10 + tokens}})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(state)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/stats", stats)
    return app


# --- the load ------------------------------------------------------------------------------


@dataclass
class Outcome:
    tier: int
    status: int = 0
    code: str = ""


@dataclass
class Samples:
    queued: list[int] = field(default_factory=list)
    active: dict[str, list[int]] = field(default_factory=dict)
    limit: dict[str, list[int]] = field(default_factory=dict)


def proxy_yaml(urls: dict[str, str], scale: float) -> str:
    providers = "\n".join(
        f'  - {{name: {name}, base_url: "{url}/v1", api_key: k, max_concurrency: '
        f'{UPSTREAMS[name][0]}, breaker: {{consecutive_failures: 1000, min_calls: 1000}}}}'
        for name, url in urls.items())
    waits = (10, 30, 120, 900)
    tiers = "\n".join(f"  - {{name: {t}, weight: {w}, max_wait_s: {m * scale:g}}}"
                      for t, w, m in zip(TIERS, (8, 4, 2, 1), waits, strict=True))
    return f"""tiers:
{tiers}
estimate: {{ttft_s: 0.02, seconds_per_token: {1 / TOKENS_PER_S}}}
providers:
{providers}
models:
  m: [{", ".join(f"{{provider: {n}, model: x}}" for n in urls)}]
"""


async def run_load(base: str, rate: float, seconds: float, seed: int,
                   outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(out: Outcome, tokens: int) -> None:
            body = {"model": "m", "max_tokens": tokens,
                    "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(base + "/v1/chat/completions", json=body,
                                    headers={"x-priority": TIERS[out.tier]}) as r:
                data = await r.read()
                out.status = r.status
                if r.status != 200:
                    out.code = str(orjson.loads(data)["error"].get("code"))

        tasks = []
        start = time.monotonic()
        at = 0.0
        while at < seconds:
            at += rng.expovariate(rate)
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            out = Outcome(rng.choices(range(4), SHARES)[0])
            outcomes.append(out)
            tokens = max(1, int(rng.lognormvariate(4.9, 0.8)))  # median ~134, like the trace
            tasks.append(asyncio.create_task(one(out, tokens)))
        await asyncio.gather(*tasks)


async def sample(base: str, upstreams: dict[str, str], samples: Samples,
                 stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(base + "/admin/status") as r:
                status = await r.json()
            samples.queued.append(int(status["scheduler"]["queued"]))
            for name, url in upstreams.items():
                async with session.get(url + "/stats") as r:
                    samples.active.setdefault(name, []).append(int((await r.json())["active"]))
                samples.limit.setdefault(name, []).append(int(status["providers"][name]["limit"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / SAMPLE_HZ)


def report(outcomes: list[Outcome], samples: Samples, stats: dict[str, dict[str, int]]) -> None:
    print(f"\n{len(outcomes)} calls")
    for t, name in enumerate(TIERS):
        mine = [o for o in outcomes if o.tier == t]
        codes: dict[str, int] = {}
        for o in mine:
            key = "200" if o.status == 200 else f"{o.status} {o.code}"
            codes[key] = codes.get(key, 0) + 1
        print(f"  {name:8} {len(mine):5d}  " + ", ".join(f"{k}: {v}" for k, v in codes.items()))
    failures = [o for o in outcomes if o.status != 200 and o.code != "queue_timeout"]
    print(f"client-visible failures other than queue_timeout: {len(failures)} (goal 0)")
    busy = [i for i, q in enumerate(samples.queued) if q > 0]
    print(f"samples with work queued: {len(busy)} of {len(samples.queued)}")
    for name, (configured, real) in UPSTREAMS.items():
        active = [samples.active[name][i] for i in busy]
        limits = [samples.limit[name][i] for i in busy]
        mean = sum(active) / len(active) if active else 0.0
        print(f"  {name}: configured {configured}, really {real}: mean in flight while work "
              f"waited {mean:.2f} = {mean / real:.2f} of real (goal >= 0.9); 429s "
              f"{stats[name]['refused']}, served {stats[name]['served']}, peak "
              f"{stats[name]['peak']}; proxy limit mean "
              f"{sum(limits) / max(len(limits), 1):.1f}")


async def bench(args: argparse.Namespace) -> None:
    me = str(Path(__file__).resolve())
    with children("bench_throttle_") as kids:
        urls = {}
        for name, (_, real) in UPSTREAMS.items():
            kids.start(name, [sys.executable, me, "upstream", "--capacity", str(real),
                              "--retry-after", args.retry_after])
            urls[name] = kids.wait_listening(name)
        config = kids.logs / "routing.yaml"
        config.write_text(proxy_yaml(urls, args.wait_scale))
        kids.start("proxy", [sys.executable, "-m", "proxy", "serve", "--config", str(config),
                             "--port", "0"])
        base = kids.wait_listening("proxy")
        outcomes: list[Outcome] = []
        samples = Samples()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(base, urls, samples, stop))
        await run_load(base, args.rate, args.seconds, args.seed, outcomes)
        stop.set()
        await sampler
        stats = {}
        async with aiohttp.ClientSession() as session:
            for name, url in urls.items():
                async with session.get(url + "/stats") as r:
                    stats[name] = await r.json()
        report(outcomes, samples, stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="bench", choices=("bench", "upstream"))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=25.0, help="calls per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--retry-after", default="1", help="what the upstreams' 429s say")
    parser.add_argument("--wait-scale", type=float, default=0.1,
                        help="multiply the tiers' max_wait_s (10, 30, 120, 900)")
    parser.add_argument("--capacity", type=int, default=1, help="(upstream role)")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        if args.role == "upstream":
            runner.run(serve_until_signalled(upstream_app(args.capacity, args.retry_after)))
        else:
            runner.run(bench(args))


if __name__ == "__main__":
    main()
