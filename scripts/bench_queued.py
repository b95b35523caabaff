"""How much memory do queued calls hold, and does it come back?  (docs: benchmarks.md, 1)

One provider slot, an upstream that holds the call in it until told to answer, and N
calls sent at once: N - 1 wait in the queue. The resident size is read with them all
queued, then everything is answered and the size read again once they are gone; twice, so
memory kept after a peak (fragmentation, structures sized at the peak) shows as a second
round that does not come back. Same run, same load: the proxy as ``scripts/serve`` runs
it (PYTHONMALLOC=malloc), the proxy on Python's own allocator, and as a baseline a bare
aiohttp gate (one ``asyncio.Semaphore`` in front of a ClientSession) holding the N calls.

    scripts/bench_queued [--calls 10000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web
from bench_common import (
    HOST,
    SESSION,
    Children,
    children,
    loop_factory,
    machine,
    rss_mb,
    serve_until_signalled,
)

BODY = orjson.dumps({
    "model": "bench-model",
    "messages": [{"role": "system", "content": "You are a terse assistant."},
                 {"role": "user", "content": "Say hello in five words."}],
    "max_tokens": 16,
})
ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [{
    "index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21}})
GO = web.AppKey("go", asyncio.Event)
WAVE = 500  # connections opened at a time (listen backlogs are finite)
QUIET_S = 12.0  # over two of the janitor's 5 s ticks


def holding_upstream() -> web.Application:
    """Holds every call until POST /go; after that answers at once until POST /hold."""
    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        app[GO] = asyncio.Event()
        yield

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        await request.app[GO].wait()
        return web.Response(body=ANSWER, content_type="application/json")

    async def go(request: web.Request) -> web.Response:
        request.app[GO].set()
        return web.Response()

    async def hold(request: web.Request) -> web.Response:
        request.app[GO].clear()
        return web.Response()

    app = web.Application()
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/go", go)
    app.router.add_post("/hold", hold)
    return app


def gate_app(upstream: str) -> web.Application:
    """The baseline: one slot as a semaphore, the call passed through as it is."""
    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app[SESSION] = session
            yield

    gate = asyncio.Semaphore(1)

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        async with gate, request.app[SESSION].post(
                upstream + request.path, data=body,
                headers={"content-type": "application/json"}) as response:
            return web.Response(body=await response.read(), status=response.status,
                                content_type="application/json")

    app = web.Application()
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/{tail:.*}", relay)
    return app


def proxy_config(upstream: str, calls: int) -> str:
    return f"""\
listen: {{host: {HOST}, port: 0}}
tiers:
  - {{name: normal, max_wait_s: 3600}}
scheduler: {{max_queue: {calls + 100}}}
classify: {{default_tier: normal}}
providers:
  - {{name: fake, kind: openai, base_url: "{upstream}/v1", api_key: k, max_concurrency: 1,
      timeouts: {{first_byte_s: 3600, response_s: 3600}}}}
models:
  bench-model:
    - {{provider: fake, model: fake-model}}
"""


async def one_round(target: str, upstream: str, pid: int, calls: int) -> tuple[float, float]:
    """(RSS with ``calls`` held, RSS once they are all answered), in MiB."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await session.post(upstream + "/hold")

        async def call() -> int:
            async with session.post(target, data=BODY, headers={
                    "content-type": "application/json"}) as response:
                await response.read()
                return response.status

        tasks = []
        for start in range(0, calls, WAVE):
            tasks += [asyncio.create_task(call()) for _ in range(min(WAVE, calls - start))]
            await asyncio.sleep(0.3)
        held = await settled(pid)
        await session.post(upstream + "/go")
        statuses = await asyncio.gather(*tasks)
    bad = sum(status != 200 for status in statuses)
    if bad:
        raise SystemExit(f"{bad} of {calls} calls failed")
    await asyncio.sleep(QUIET_S)  # the proxy gives memory back once quiet (its janitor)
    return held, await settled(pid)


async def settled(pid: int) -> float:
    """RSS once it stops moving (a second without a change of more than 1 MiB)."""
    last = rss_mb(pid)[0]
    for _ in range(60):
        await asyncio.sleep(1.0)
        now = rss_mb(pid)[0]
        if abs(now - last) < 1.0:
            return now
        last = now
    return last


def start(kids: Children, name: str, argv: list[str]) -> tuple[int, str]:
    proc = kids.start(name, argv)
    return proc.pid, kids.wait_listening(name)


def with_malloc(argv: list[str]) -> list[str]:
    """The proxy as ``scripts/serve`` and the image run it: PYTHONMALLOC=malloc."""
    return ["env", "PYTHONMALLOC=malloc", *argv]


def benchmark(kids: Children, calls: int, rounds: int) -> str:
    python, me = sys.executable, str(Path(__file__).resolve())
    _, upstream = start(kids, "upstream", [python, me, "--role", "upstream"])
    config = kids.logs / "bench.yaml"
    config.write_text(proxy_config(upstream, calls))
    serve = [python, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
             "--log-level", "WARNING"]
    targets = {
        "gate": start(kids, "gate", [python, me, "--role", "gate", "--upstream", upstream]),
        "proxy": start(kids, "proxy", with_malloc(serve)),
        "pymalloc": start(kids, "pymalloc", serve),
    }
    time.sleep(1.0)
    lines = [f"machine: {machine()}",
             f"{calls} calls sent at once, one slot: {calls - 1} queued; {rounds} rounds",
             "", f"{'target':<9}{'idle MiB':>9}" + "".join(
                 f"{f'r{n} held':>9}{f'r{n} after':>10}" for n in range(1, rounds + 1))
             + f"{'KiB/call':>9}"]
    peaks: dict[str, float] = {}
    for name, (pid, url) in targets.items():
        idle = rss_mb(pid)[0]
        figures = []
        for _ in range(rounds):
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                figures += runner.run(one_round(url + "/v1/chat/completions", upstream,
                                                pid, calls))
        peaks[name] = max(figures[0::2])
        per_call = (figures[0] - idle) * 1024 / (calls - 1)
        lines.append(f"{name:<9}{idle:>9.1f}" + "".join(f"{f:>9.1f}" if i % 2 == 0 else
                                                        f"{f:>10.1f}"
                                                        for i, f in enumerate(figures))
                     + f"{per_call:>9.1f}")
    peak_mb = peaks["proxy"] * 1.048576
    lines += ["", "proxy: as scripts/serve and the image run it (PYTHONMALLOC=malloc); "
                  "pymalloc: Python's own small-object allocator",
              f"goal {calls} queued in <= 200 MB: proxy peak {peak_mb:.0f} MB "
              f"{'met' if peak_mb <= 200 else 'MISSED'} (pymalloc "
              f"{peaks['pymalloc'] * 1.048576:.0f} MB, the bare gate "
              f"{peaks['gate'] * 1.048576:.0f} MB)"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--role", choices=("upstream", "gate"), help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        app = holding_upstream() if args.role == "upstream" else gate_app(args.upstream)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve_until_signalled(app))
        return 0
    if args.calls < 2 or args.rounds < 1:
        parser.error("--calls must be at least 2 and --rounds at least 1")
    with children("bench_queued.") as kids:
        print(benchmark(kids, args.calls, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
