"""The soak's throttling fake providers (scripts/soak.py): one loopback aiohttp server,
a provider per path (``/{provider}/v1/chat/completions``), OpenAI-shaped chat JSON and SSE
streams.

Each provider has a concurrency ceiling, its ``max_concurrency`` in the proxies' routing
table. A call that arrives while the ceiling is reached is answered 429 and counted: the
highest concurrency ever seen, every time it went past the ceiling (on the system-wide
monotonic clock, which the soak shares), the highest per second. A call stops counting just
before its last bytes are written, so the proxy cannot see it end (and start another) while
it still counts here. An arrival past the ceiling is looked at again 5 ms later: one that
was only the loop not yet having seen a closed connection counts as ``transient``.

Faults, from ``POST /_control``: a 429 storm (every call 429 for a while) and a slow
provider (seconds to the first byte). Besides, 1 % of streams are cut mid-way (the proxy
must end them with an error event). What the calls would cost is tallied per tag: a
call's first message starts ``[tag] id``, the tag a proxy key's name; and every call id's
successful answers are counted (an interactive call answered twice would show).

At each violation the provider's leases in the proxies' Redis are recorded too
(``--redis-port``): were there more than the limit, or calls running without one?

Run as ``python scripts/soak_upstream.py --providers alpha=4,beta=3``: it prints
``listening on http://127.0.0.1:PORT`` and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aredis
from aiohttp import web
from redis.exceptions import RedisError

PROMPT_TOKENS = 10
MAX_WORDS = 16
INPUT_COST = 100.0  # dollars per million tokens, as the soak's routing table says
OUTPUT_COST = 200.0
CUT_SHARE = 0.01
RECHECK_S = 0.005
TAG = re.compile(r"^\[([\w-]+)\] (\S+)")


def cost(completion_tokens: int) -> float:
    return (PROMPT_TOKENS * INPUT_COST + completion_tokens * OUTPUT_COST) / 1e6


@dataclass
class Provider:
    name: str
    ceiling: int
    now: int = 0
    most: int = 0
    calls: int = 0
    ok: int = 0
    over: int = 0  # answered 429 for the ceiling
    transient: int = 0  # past the ceiling for under RECHECK_S
    storm_429: int = 0
    cut: int = 0
    cancelled: int = 0  # the proxy closed the connection before the end
    storm_until: float = 0.0
    slow_until: float = 0.0
    slow_s: float = 0.0
    # (when, level, [(call id, running for s)], [(lease member, ms left)] in Redis then)
    violations: list[tuple[float, int, list[tuple[str, float]],
                           list[tuple[str, int]] | None]] = field(default_factory=list)
    running: dict[object, tuple[str, float]] = field(default_factory=dict)
    per_second: dict[int, int] = field(default_factory=dict)

    def arrive(self) -> int:
        self.now += 1
        self.calls += 1
        self.most = max(self.most, self.now)
        second = int(time.monotonic())
        self.per_second[second] = max(self.per_second.get(second, 0), self.now)
        return self.now


class Upstream:
    def __init__(self, ceilings: dict[str, int], redis_port: int | None = None,
                 prefix: str = "") -> None:
        self.redis = None if redis_port is None else aredis.Redis(
            port=redis_port, socket_timeout=0.2, decode_responses=True)
        self.prefix = prefix
        self.providers = {name: Provider(name, c) for name, c in ceilings.items()}
        self.billed: Counter[str] = Counter()  # tag -> dollars (in micro-dollars, exact)
        self.served: Counter[str] = Counter()  # call id -> successful answers
        self.random = random.Random(23)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        provider = self.providers.get(request.match_info["provider"])
        if provider is None:
            raise web.HTTPNotFound()
        body = orjson.loads(await request.read())
        content = str(body["messages"][0].get("content", ""))
        found = TAG.match(content)
        tag, call_id = (found.group(1), found.group(2)) if found else ("", "")
        level = provider.arrive()
        token = object()
        provider.running[token] = (call_id, time.monotonic())
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                provider.now -= 1
                provider.running.pop(token, None)

        try:
            if level > provider.ceiling:
                await asyncio.sleep(RECHECK_S)
                if provider.now > provider.ceiling:
                    provider.over += 1
                    at = time.monotonic()
                    running = [(i, round(at - since, 3))
                               for i, since in provider.running.values()]
                    leases = await self._leases(provider.name)
                    provider.violations.append((at - RECHECK_S, level, running, leases))
                    leave()
                    return _error(429, "over the provider's concurrency ceiling")
                provider.transient += 1
            now = time.monotonic()
            if provider.storm_until > now:
                provider.storm_429 += 1
                leave()
                return _error(429, "rate limited (storm)")
            if provider.slow_until > now:
                await asyncio.sleep(provider.slow_s)
            words = max(1, min(int(body.get("max_tokens") or 8), MAX_WORDS))
            if body.get("stream"):
                return await self._stream(request, provider, body, words, tag, call_id, leave)
            await asyncio.sleep(self.random.uniform(0.2, 0.8))
            self._billed(tag, call_id, words)
            provider.ok += 1
            leave()
            return web.Response(body=orjson.dumps(_completion(body, words)),
                                content_type="application/json")
        except (asyncio.CancelledError, ConnectionError):
            provider.cancelled += 1
            raise
        finally:
            leave()

    async def _stream(self, request: web.Request, provider: Provider, body: dict[str, Any],
                      words: int, tag: str, call_id: str, leave: Any) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream",
                                             "cache-control": "no-cache"})
        await asyncio.sleep(self.random.uniform(0.1, 0.3))
        await answer.prepare(request)
        cut_at = self.random.randrange(1, words + 1) if self.random.random() < CUT_SHARE else 0
        await answer.write(_chunk(body, {"role": "assistant", "content": ""}))
        for i in range(words):
            if cut_at and i == cut_at:
                provider.cut += 1
                leave()
                assert request.transport is not None
                request.transport.close()
                return answer
            await asyncio.sleep(0.04)
            await answer.write(_chunk(body, {"content": f"w{i} "}))
        tail = _chunk(body, {}, "stop")
        if (body.get("stream_options") or {}).get("include_usage"):
            tail += b"data: " + orjson.dumps({**_base(body, "chat.completion.chunk"),
                                              "choices": [], "usage": _usage(words)}) + b"\n\n"
        self._billed(tag, call_id, words)
        provider.ok += 1
        leave()
        await answer.write(tail + b"data: [DONE]\n\n")
        await answer.write_eof()
        return answer

    async def _leases(self, provider: str) -> list[tuple[str, int]] | None:
        """The provider's leases in Redis right now: (member, ms left), for the record."""
        if self.redis is None:
            return None
        try:
            async with asyncio.timeout(0.2):
                seconds, micros = await self.redis.time()
                now = int(seconds) * 1000 + int(micros) // 1000
                found = await self.redis.zrange(f"{self.prefix}:leases:{provider}", 0, -1,
                                                withscores=True)
            return [(str(m), int(score) - now) for m, score in found]
        except (RedisError, OSError, TimeoutError):
            return None

    def _billed(self, tag: str, call_id: str, words: int) -> None:
        self.billed[tag] += round(cost(words) * 1e6)
        if call_id:
            self.served[call_id] += 1

    async def control(self, request: web.Request) -> web.Response:
        order = await request.json()
        provider = self.providers[order["provider"]]
        now = time.monotonic()
        if "storm_s" in order:
            provider.storm_until = now + float(order["storm_s"])
        if "slow_for_s" in order:
            provider.slow_until = now + float(order["slow_for_s"])
            provider.slow_s = float(order["delay_s"])
        return web.json_response({"ok": True})

    async def stats(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps({
            "providers": {name: {
                "ceiling": p.ceiling, "most": p.most, "now": p.now, "calls": p.calls,
                "ok": p.ok, "over_ceiling_429": p.over, "transient": p.transient,
                "storm_429": p.storm_429, "cut": p.cut, "cancelled": p.cancelled,
                "violations": p.violations[-2000:],
                "per_second": sorted(p.per_second.items()),
            } for name, p in self.providers.items()},
            "billed_usd": {tag: micro / 1e6 for tag, micro in self.billed.items()},
            "served_twice": sorted(i for i, n in self.served.items() if n > 1),
        }), content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/{provider}/v1/chat/completions", self.chat)
        app.router.add_post("/_control", self.control)
        app.router.add_get("/_stats", self.stats)
        return app


def _base(body: dict[str, Any], kind: str) -> dict[str, Any]:
    return {"id": "chatcmpl-soak", "object": kind, "created": 1700000000,
            "model": body.get("model", "soak")}


def _usage(words: int) -> dict[str, int]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": words,
            "total_tokens": PROMPT_TOKENS + words}


def _completion(body: dict[str, Any], words: int) -> dict[str, Any]:
    text = " ".join(f"w{i}" for i in range(words))
    return {**_base(body, "chat.completion"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": _usage(words)}


def _chunk(body: dict[str, Any], delta: dict[str, str], finish: str | None = None) -> bytes:
    event = {**_base(body, "chat.completion.chunk"),
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, headers={"retry-after": "1"}, body=orjson.dumps(
        {"error": {"message": message, "type": "rate_limit_error", "param": None,
                   "code": "rate_limit_exceeded"}}), content_type="application/json")


async def main(ceilings: dict[str, int], redis_port: int | None, prefix: str) -> None:
    # handler_cancellation: a call whose proxy closed the connection stops counting at once.
    runner = web.AppRunner(Upstream(ceilings, redis_port, prefix).app(), access_log=None,
                           handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", required=True, help="name=ceiling,name=ceiling")
    parser.add_argument("--redis-port", type=int,
                        help="record the provider's leases in this Redis at each violation")
    parser.add_argument("--prefix", default="soak", help="the proxies' Redis prefix")
    args = parser.parse_args()
    asyncio.run(main({name: int(c) for name, c in
                      (pair.split("=") for pair in args.providers.split(","))},
                     args.redis_port, args.prefix))
