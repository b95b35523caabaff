"""Helpers for the benchmark scripts: child processes, /proc readings, closed-loop load
(aiohttp or wrk), a fake OpenAI-compatible upstream and a bare aiohttp pass-through.

Everything stays on 127.0.0.1; every child is stopped on exit, on Ctrl-C and on SIGTERM,
and dies with its parent if the parent is killed outright.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
WARMUP_S = 0.5
PR_SET_PDEATHSIG = 1

SESSION = web.AppKey("session", aiohttp.ClientSession)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's, when installed (the proxy runs on it too)."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the benchmark itself dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Children:
    """Named child processes; stdout is a pipe for their ready line, stderr a log file."""

    logs: Path
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], *, stdin: bool = False,
              cwd: Path = ROOT) -> subprocess.Popen[str]:
        with (self.logs / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(
                argv, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=log,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )
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
        raise SystemExit(f"{name}: {why}\n--- last lines of its log ---\n{tail}")

    def stop(self, *names: str) -> None:
        """SIGTERM, then SIGKILL whatever is still there after the grace period."""
        procs = [self.procs[name] for name in names or self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def children(prefix: str) -> Iterator[Children]:
    """Children stopped on the way out, SIGTERM to this process included."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        kids = Children(Path(tmp))
        try:
            yield kids
        finally:
            kids.stop()
            signal.signal(signal.SIGTERM, previous)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    utime, stime = stat.rpartition(")")[2].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    """CPU seconds every process on the machine has used so far (``/proc/stat``: user,
    nice, system, irq, softirq), to tell how much of it others used meanwhile."""
    fields = [int(n) for n in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields[:3]) + sum(fields[5:7])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Move every thread of a process onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            continue  # a thread that just ended


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    loop = "uvloop" if loop_factory() else "asyncio (no uvloop)"
    return (f"{os.cpu_count()} CPUs ({cpu}), Python {sys.version.split()[0]}, "
            f"aiohttp {aiohttp.__version__}, {loop}")


def percentile(ordered: list[float], q: float) -> float:
    """Nearest rank of a sorted list; NaN when empty."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


@dataclass(frozen=True)
class Load:
    """One closed-loop measurement: ``connections`` callers, each waiting for its answer."""

    url: str
    body: bytes
    headers: dict[str, str]
    connections: int
    duration_s: float


@dataclass(frozen=True)
class Sample:
    seconds: float  # the measured window
    requests: int  # successful calls that ended inside the window
    errors: int
    p50_ms: float
    p99_ms: float
    completed: int  # successful calls in the whole run, warm-up included (for CPU per call)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


async def aiohttp_load(load: Load) -> Sample:
    """Calls ending inside the window count, after a warm-up that opens the connections;
    latency runs to the last byte of the body ([DONE] included)."""
    latencies: list[float] = []
    errors = completed = 0
    begin = time.perf_counter() + WARMUP_S
    end = begin + load.duration_s

    async def caller(session: aiohttp.ClientSession) -> None:
        nonlocal errors, completed
        while (started := time.perf_counter()) < end:
            try:
                async with session.post(load.url, data=load.body,
                                        headers=load.headers) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            finished = time.perf_counter()
            completed += ok
            if begin <= finished <= end:
                if ok:
                    latencies.append(finished - started)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(caller(session) for _ in range(load.connections)))
    latencies.sort()
    return Sample(load.duration_s, len(latencies), errors, percentile(latencies, 0.5) * 1000,
                  percentile(latencies, 0.99) * 1000, completed)


def serve_loads() -> None:
    """The load-generator process: one JSON ``Load`` per stdin line, one ``Sample`` back."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        for line in sys.stdin:
            spec: dict[str, Any] = json.loads(line)
            load = Load(spec["url"], spec["body"].encode(), spec["headers"],
                        spec["connections"], spec["duration_s"])
            sample = runner.run(aiohttp_load(load))
            sys.stdout.write(json.dumps(sample.__dict__) + "\n")
            sys.stdout.flush()


def load_command(load: Load) -> str:
    return json.dumps({**load.__dict__, "body": load.body.decode()}) + "\n"


WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = [==[{body}]==]
{headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\n{{"us": %d, "requests": %d, "non2xx": %d, "socket_errors": %d, "p50": %d, "p99": %d}}\\n',
    summary.duration, summary.requests, e.status, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk_load(load: Load, scratch: Path) -> Sample:
    """The same measurement with wrk (one thread; whole seconds, rounded up; the whole run
    counts, as wrk has no warm-up)."""
    script = scratch / "wrk_post.lua"
    script.write_text(WRK_SCRIPT.format(
        body=load.body.decode(),
        headers="\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in load.headers.items()),
    ))
    seconds = max(1, math.ceil(load.duration_s))
    result = subprocess.run(
        ["wrk", "-t1", f"-c{load.connections}", f"-d{seconds}s",
         f"--timeout={REQUEST_TIMEOUT_S:.0f}s", "-s", str(script), load.url],
        capture_output=True, text=True, timeout=seconds + REQUEST_TIMEOUT_S + 10,
        check=False, preexec_fn=die_with_parent,
    )
    if result.returncode != 0:
        raise SystemExit(f"wrk failed ({result.returncode}): {result.stderr.strip()}")
    found = json.loads(result.stdout.strip().splitlines()[-1])
    ok = found["requests"] - found["non2xx"]
    return Sample(found["us"] / 1e6, ok, found["non2xx"] + found["socket_errors"],
                  found["p50"] / 1000, found["p99"] / 1000, ok)


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


# What api.openai.com sends besides the body's own headers (values made up), for
# ``--openai-headers``: a proxy pays for every header it parses, and most of these it drops.
OPENAI_HEADERS = (
    ("access-control-expose-headers", "X-Request-ID"),
    ("openai-organization", "user-bench"),
    ("openai-processing-ms", "231"),
    ("openai-project", "proj_bench"),
    ("openai-version", "2020-10-01"),
    ("x-ratelimit-limit-requests", "10000"),
    ("x-ratelimit-limit-tokens", "2000000"),
    ("x-ratelimit-remaining-requests", "9999"),
    ("x-ratelimit-remaining-tokens", "1999970"),
    ("x-ratelimit-reset-requests", "6ms"),
    ("x-ratelimit-reset-tokens", "0s"),
    ("x-request-id", "req_0123456789abcdef0123456789abcdef"),
    ("strict-transport-security", "max-age=31536000; includeSubDomains; preload"),
    ("cf-cache-status", "DYNAMIC"),
    ("set-cookie", "__cf_bm=bench; path=/; expires=Tue, 01-Dec-26 10:30:00 GMT; "
                   "domain=.api.openai.com; HttpOnly; Secure; SameSite=None"),
    ("set-cookie", "_cfuvid=bench; path=/; domain=.api.openai.com; HttpOnly; Secure; "
                   "SameSite=None"),
    ("x-content-type-options", "nosniff"),
    ("cf-ray", "8e0123456789abcd-AMS"),
    ("alt-svc", 'h3=":443"; ma=86400'),
)


EXTRA_HEADERS = web.AppKey("extra_headers", tuple)


def _answer_headers(request: web.Request, content_type: str) -> CIMultiDict[str]:
    return CIMultiDict((("content-type", content_type), *request.app[EXTRA_HEADERS]))


async def fake_completion(request: web.Request) -> web.StreamResponse:
    """Answers at once; streams add the usage chunk only when asked, as OpenAI does."""
    body = orjson.loads(await request.read())
    if not body.get("stream"):
        return web.Response(body=COMPLETION,
                            headers=_answer_headers(request, "application/json"))
    answer = web.StreamResponse(headers=_answer_headers(request, "text/event-stream"))
    await answer.prepare(request)
    for event in SSE_EVENTS:
        await answer.write(event)
    if (body.get("stream_options") or {}).get("include_usage"):
        await answer.write(SSE_USAGE)
    await answer.write(SSE_DONE)
    await answer.write_eof()
    return answer


async def delayed_completion(request: web.Request) -> web.StreamResponse:
    """``/delay/{ms}/v1/...``: the same answer, ``ms`` milliseconds after the body is in
    (an LLM-like service time, on the same upstream); ``ms`` as ``LOW-HIGH``: drawn
    uniformly between."""
    await request.read()
    low, _, high = request.match_info["ms"].partition("-")
    await asyncio.sleep(random.uniform(float(low), float(high or low)) / 1000)
    return await fake_completion(request)


def upstream_app(openai_headers: bool = False) -> web.Application:
    """The fake provider; with ``openai_headers``, its answers carry OpenAI's 19 headers.
    Under ``/delay/{ms}`` it answers ``ms`` milliseconds later."""
    app = web.Application()
    app[EXTRA_HEADERS] = OPENAI_HEADERS if openai_headers else ()
    app.router.add_post("/v1/chat/completions", fake_completion)
    app.router.add_post("/delay/{ms}/v1/chat/completions", delayed_completion)
    return app


# --- the bare pass-through: one pooled session, no logic ---------------------------------

def bare_app(upstream: str) -> web.Application:
    """Forwards the body as it is and relays the answer: the floor of any aiohttp proxy."""
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
    """Serves on a free port, announced like the proxy does, until SIGTERM or SIGINT."""
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
