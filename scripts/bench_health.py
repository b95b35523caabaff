"""Provider-health figures over real sockets on 127.0.0.1 (issue 4's closing measurements).

1. Retry amplification: every call against an upstream that always answers 503, at a
   steady rate; upstream attempts per client call, with the default breaker and with the
   breaker switched off (the retry allowance alone).
2. A dead provider: calls at a steady rate on an ordered chain primary → backup; the
   primary starts refusing connections, later comes back. Time until the breaker opens,
   calls that failed or slowed meanwhile, and time until traffic returns after recovery.

Usage: .venv/bin/python scripts/bench_health.py [--rate 20] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import parse_config
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
REPLY = {"id": "x", "object": "chat.completion", "created": 0, "model": "x",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                      "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@dataclass
class Upstream:
    status: int = 200
    attempts: int = 0
    stamps: list[float] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.attempts += 1
        self.stamps.append(time.monotonic())
        if self.status != 200:
            return web.json_response({"error": {"message": "down", "type": "x", "param": None,
                                                "code": "down"}}, status=self.status)
        return web.json_response(REPLY)


async def serve(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, int(runner.addresses[0][1])


def upstream_app(upstream: Upstream) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.handle)
    return app


async def load(url: str, rate: float, seconds: float) -> list[tuple[float, int, float, str]]:
    """Open-loop calls at ``rate``/s: (sent at, status, latency, upstream)."""
    results: list[tuple[float, int, float, str]] = []

    async def one(session: aiohttp.ClientSession) -> None:
        sent = time.monotonic()
        async with session.post(url, json=CHAT) as resp:
            await resp.read()
            results.append((sent, resp.status, time.monotonic() - sent,
                            resp.headers.get("x-proxy-upstream", "")))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    return results


async def proxy_for(providers: list[dict[str, Any]], models: dict[str, Any]) -> tuple[
    web.AppRunner, str, web.Application
]:
    config = parse_config({"providers": providers, "models": models}, {})
    app = build_app(config)
    runner, port = await serve(app)
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions", app


async def amplification(rate: float, seconds: float, breaker: dict[str, Any]) -> str:
    upstream = Upstream(status=503)
    up_runner, up_port = await serve(upstream_app(upstream))
    runner, url, _ = await proxy_for(
        [{"name": "dead", "base_url": f"http://127.0.0.1:{up_port}/v1", "api_key": "k",
          "max_concurrency": 64, "breaker": breaker}],
        {"m": [{"provider": "dead", "model": "x"}]},
    )
    results = await load(url, rate, seconds)
    await runner.cleanup()
    await up_runner.cleanup()
    statuses: dict[int, int] = {}
    for _, status, _, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    return (f"{len(results)} calls, {upstream.attempts} upstream attempts = "
            f"{upstream.attempts / len(results):.3f} per call; client statuses {statuses}")


async def dead_provider(rate: float, seconds: float) -> str:
    primary, backup = Upstream(), Upstream()
    p_runner, p_port = await serve(upstream_app(primary))
    b_runner, b_port = await serve(upstream_app(backup))
    runner, url, app = await proxy_for(
        [{"name": "primary", "base_url": f"http://127.0.0.1:{p_port}/v1", "api_key": "k",
          "max_concurrency": 64},
         {"name": "backup", "base_url": f"http://127.0.0.1:{b_port}/v1", "api_key": "k",
          "max_concurrency": 64}],
        {"m": [{"provider": "primary", "model": "x"}, {"provider": "backup", "model": "x"}]},
    )
    breaker = app[SERVICE].engine.fleet.breakers["primary/x"]
    opened_at: list[float] = []
    recovered_at: list[float] = []
    death = seconds * 0.25
    revival = seconds * 0.6

    async def script() -> float:
        start = time.monotonic()
        await asyncio.sleep(death)
        died = time.monotonic()
        await p_runner.cleanup()  # connections now refused
        while breaker.state(app[SERVICE].clock.now()).value == "closed":
            await asyncio.sleep(0.001)
        opened_at.append(time.monotonic() - died)
        await asyncio.sleep(max(0.0, start + revival - time.monotonic()))
        await serve(upstream_app(primary), p_port)
        revived = time.monotonic()
        seen = primary.attempts
        while primary.attempts == seen and time.monotonic() - revived < seconds:
            await asyncio.sleep(0.005)
        recovered_at.append(time.monotonic() - revived)
        return died

    script_task = asyncio.create_task(script())
    results = await load(url, rate, seconds)
    died = await script_task
    await runner.cleanup()
    await b_runner.cleanup()
    during = [r for r in results if died <= r[0] <= died + opened_at[0] + 1]
    failed = [r for r in results if r[1] != 200]
    latencies = sorted(r[2] for r in during) or [0.0]
    return (
        f"breaker opened {opened_at[0] * 1000:.0f} ms after the primary died; "
        f"{len(failed)} of {len(results)} calls failed; calls around the death: "
        f"p50 {statistics.median(latencies) * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms; "
        f"traffic back on the primary {recovered_at[0]:.1f} s after it recovered "
        f"(breaker opened {breaker.opened_count}x)"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=20.0, help="calls per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    print("1. retry amplification, upstream always 503")
    print("   default breaker:  ", await amplification(args.rate, args.seconds, {}))
    print("   breaker disabled: ", await amplification(
        args.rate, args.seconds, {"consecutive_failures": 10**6, "min_calls": 10**6}))
    print("2. dead provider (primary refuses connections, then recovers)")
    print("   ", await dead_provider(args.rate, args.seconds))


if __name__ == "__main__":
    asyncio.run(main())
