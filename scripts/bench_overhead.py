"""How much does the proxy cost per request?  (docs: benchmarks.md, section 1)

Three targets, measured in alternation in one run so the machine's noise hits all alike:

- ``upstream``: a fake OpenAI-compatible server (instant reply; a short SSE stream);
- ``bare``: an aiohttp pass-through with no logic, the cost floor of any aiohttp proxy;
- ``proxy``: ``python -m proxy serve`` with its full request path, one ``openai``-kind
  provider pointing at the fake upstream.

Every server and the closed-loop load generator run in their own processes, all on
127.0.0.1 and all on uvloop. The same file is each of those processes (``--role``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
PROXY_KEY = "bench-key"
TARGETS = ("upstream", "bare", "proxy")
MODES = ("json", "stream")
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
WARMUP_S = 0.5
PR_SET_PDEATHSIG = 1
GOALS = "proxy >= 0.8x bare req/s; added p99 <= 2 ms at moderate load; idle RSS < 100 MB"

SESSION = web.AppKey("session", aiohttp.ClientSession)


def request_body(stream: bool) -> bytes:
    return orjson.dumps({
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello in five words."},
        ],
        "max_tokens": 16,
        "stream": stream,
    })


# --- the fake upstream -------------------------------------------------------------------

def _chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    event = {
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
        "model": "fake-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(event) + b"\n\n"


USAGE = {"prompt_tokens": 24, "completion_tokens": 5, "total_tokens": 29}
SSE_EVENTS = (
    _chunk({"role": "assistant", "content": ""}),
    *(_chunk({"content": word}) for word in ("Hello ", "there, ", "nice ", "day!")),
    _chunk({}, "stop"),
)
SSE_USAGE = b"data: " + orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
    "model": "fake-model", "choices": [], "usage": USAGE,
}) + b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
COMPLETION = orjson.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "fake-model",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello there, nice day!"}}],
    "usage": USAGE,
})


async def fake_completion(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    if not body.get("stream"):
        return web.Response(body=COMPLETION, content_type="application/json")
    answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await answer.prepare(request)
    for event in SSE_EVENTS:
        await answer.write(event)
    if (body.get("stream_options") or {}).get("include_usage"):
        await answer.write(SSE_USAGE)
    await answer.write(SSE_DONE)
    await answer.write_eof()
    return answer


def upstream_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake_completion)
    return app


# --- the bare pass-through: one pooled session, no logic ---------------------------------

def bare_app(upstream: str) -> web.Application:
    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            app[SESSION] = session
            yield

    async def relay(request: web.Request) -> web.StreamResponse:
        headers = {"content-type": "application/json", "authorization": "Bearer upstream"}
        async with request.app[SESSION].post(
            upstream + request.path, data=await request.read(), headers=headers,
            allow_redirects=False,
        ) as response:
            if response.content_type != "text/event-stream":
                return web.Response(body=await response.read(), status=response.status,
                                    content_type=response.content_type)
            answer = web.StreamResponse(status=response.status, headers={
                "content-type": "text/event-stream", "cache-control": "no-cache",
            })
            await answer.prepare(request)
            async for chunk in response.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/{tail:.*}", relay)
    return app


async def serve_until_signalled(app: web.Application) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0, backlog=1024).start()
    print(f"listening on http://{HOST}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


# --- the closed-loop load generator ------------------------------------------------------

async def measure(url: str, body: bytes, connections: int, duration_s: float) -> dict[str, Any]:
    """``connections`` workers, each sending its next call as soon as the last one ends.

    Calls that end inside the measured window count (after a warm-up that opens the
    connections); latency is until the last byte of the body, [DONE] included.
    """
    headers = {"content-type": "application/json", "authorization": f"Bearer {PROXY_KEY}"}
    latencies: list[float] = []
    errors = 0
    begin = time.perf_counter() + WARMUP_S
    end = begin + duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while (started := time.perf_counter()) < end:
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            finished = time.perf_counter()
            if begin <= finished <= end:
                if ok:
                    latencies.append(finished - started)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(connections)))
    return {"seconds": duration_s, "errors": errors,
            "latencies_ms": [round(s * 1000, 4) for s in latencies]}


def run_loadgen() -> None:
    """One measurement per JSON line on stdin, one JSON line of results on stdout."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        for line in sys.stdin:
            command = json.loads(line)
            result = runner.run(measure(
                command["url"], request_body(command["stream"]),
                command["connections"], command["duration"],
            ))
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_role(role: str, upstream: str) -> None:
    if role == "loadgen":
        run_loadgen()
        return
    app = upstream_app() if role == "upstream" else bare_app(upstream)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_until_signalled(app))


# --- the orchestrator ----------------------------------------------------------------------

def die_with_parent() -> None:
    """Children get SIGTERM if the benchmark itself is killed outright."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Children:
    logs: Path
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], *, stdin: bool = False) -> subprocess.Popen[str]:
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            argv, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=log,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def wait_listening(self, name: str) -> str:
        """The URL from the child's ``listening on http://...`` line."""
        line = self.read_line(name, READY_TIMEOUT_S)
        if not line.startswith("listening on "):
            self.fail(name, f"unexpected first line {line!r}")
        return line.removeprefix("listening on ").strip()

    def read_line(self, name: str, timeout_s: float) -> str:
        proc = self.procs[name]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            self.fail(name, "exited" if proc.poll() is not None else f"silent for {timeout_s}s")
        return line

    def fail(self, name: str, why: str) -> None:
        tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{name}: {why}\n--- last log lines ---\n{tail}")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def children() -> Iterator[Children]:
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench_overhead.") as tmp:
        kids = Children(Path(tmp))
        try:
            yield kids
        finally:
            kids.stop_all()
            signal.signal(signal.SIGTERM, previous)


def proxy_config(upstream: str) -> str:
    return f"""\
listen: {{host: {HOST}, port: 0}}
classify:
  default_tier: normal
  keys:
    - {{name: bench, key: "{PROXY_KEY}", tier: normal, max_tier: high}}
providers:
  - name: fake
    kind: openai
    base_url: {upstream}/v1
    api_key: upstream
    max_concurrency: 64
models:
  bench-model:
    - {{provider: fake, model: fake-model}}
"""


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


def smoke_check(name: str, url: str) -> None:
    """One call per mode, so a broken target fails loudly instead of benchmarking errors."""
    for stream in (False, True):
        request = urllib.request.Request(url, data=request_body(stream), method="POST", headers={
            "content-type": "application/json", "authorization": f"Bearer {PROXY_KEY}",
        })
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            data = response.read()
            upstream_header = response.headers.get("x-proxy-upstream")
        expected = b"data: [DONE]" if stream else b'"choices"'
        if expected not in data or b'"usage":{"prompt' in data and stream:
            raise SystemExit(f"{name}: unexpected {'stream' if stream else 'JSON'} reply {data!r}")
        if name == "proxy" and upstream_header != "fake/fake-model":
            raise SystemExit(f"proxy: x-proxy-upstream was {upstream_header!r}")
