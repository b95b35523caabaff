"""How much does the proxy cost per request?  (docs: benchmarks.md, section 1)

Three targets, measured in alternation in one run so the machine's noise hits all alike:

- ``upstream``: a fake OpenAI-compatible server (instant reply; a short SSE stream);
- ``bare``: an aiohttp pass-through with no logic, the cost floor of any aiohttp proxy;
- ``proxy``: ``python -m proxy serve`` with its full request path, one ``openai``-kind
  provider pointing at the fake upstream; ``lane-off``: the same with ``--no-fast-lane``
  (every call through aiohttp's own request handling).

Every server and the closed-loop load generator (wrk when installed, else an aiohttp
client) run in their own processes, on 127.0.0.1 and on uvloop; with ``--role`` this script
is one of those processes (their code is in ``bench_common``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
from bench_common import (
    HOST,
    REQUEST_TIMEOUT_S,
    WARMUP_S,
    Children,
    Load,
    Sample,
    bare_app,
    children,
    cpu_s,
    load_command,
    loop_factory,
    machine,
    pin,
    rss_mb,
    serve_loads,
    serve_until_signalled,
    upstream_app,
    wrk_load,
    wrk_path,
)

PROXY_KEY = "bench-key"
TARGETS = ("upstream", "bare", "proxy", "lane-off")
MODES = ("json", "stream")
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {PROXY_KEY}"}


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


def run_role(role: str, upstream: str, openai_headers: bool = False) -> None:
    if role == "loadgen":
        serve_loads()
        return
    app = upstream_app(openai_headers) if role == "upstream" else bare_app(upstream)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_until_signalled(app))


# --- the benchmark ---------------------------------------------------------------------------

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
    api_key: upstream-key
    max_concurrency: 64
models:
  bench-model:
    - {{provider: fake, model: fake-model}}
"""


def smoke_check(name: str, url: str) -> None:
    """One call per mode, so a broken target fails loudly instead of benchmarking errors."""
    for stream in (False, True):
        request = urllib.request.Request(url, data=request_body(stream), method="POST",
                                         headers=HEADERS)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                data = response.read()
                upstream_header = response.headers.get("x-proxy-upstream")
        except urllib.error.URLError as exc:
            raise SystemExit(f"{name}: smoke check failed: {exc}") from exc
        expected = b"data: [DONE]" if stream else b'"choices"'
        if expected not in data:
            raise SystemExit(f"{name}: unexpected {'stream' if stream else 'JSON'} reply {data!r}")
        if stream and b'"choices":[],' in data:
            raise SystemExit(f"{name}: the usage chunk the client did not ask for came through")
        if name == "proxy" and upstream_header != "fake/fake-model":
            raise SystemExit(f"proxy: x-proxy-upstream was {upstream_header!r}")


@dataclass(frozen=True)
class Point:
    connections: int
    duration_s: float


@dataclass(frozen=True)
class Run:
    """One measurement of one target, with the CPU its own process spent per call."""

    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    errors: int


@dataclass(frozen=True)
class Summary:
    """Medians over the rounds (each round is one run per target)."""

    runs: list[Run]

    def median(self, name: str) -> float:
        return statistics.median(float(getattr(run, name)) for run in self.runs)

    @property
    def rps_range(self) -> str:
        rates = [run.rps for run in self.runs]
        return f"{min(rates):.0f}-{max(rates):.0f}"

    @property
    def errors(self) -> int:
        return sum(run.errors for run in self.runs)


Key = tuple[str, str, int]  # target, mode, connections


class Bench:
    """The three targets, started once, and one measurement at a time against them."""

    def __init__(self, kids: Children, client: str, pinned: bool,
                 profile: Path | None, openai_headers: bool) -> None:
        self.kids = kids
        self.client = client
        self.pinned = pinned
        self.profile = profile
        self.openai_headers = openai_headers
        self.pids: dict[str, int] = {}
        self.urls: dict[str, str] = {}

    def start(self) -> dict[str, float]:
        """Starts the three targets; returns the proxy's start-up time and idle size."""
        python, me = sys.executable, str(Path(__file__).resolve())
        path = "/v1/chat/completions"
        self._server("upstream", [python, me, "--role", "upstream",
                                  *(["--openai-headers"] if self.openai_headers else [])], path)
        upstream = self.urls["upstream"].removesuffix(path)
        self._server("bare", [python, me, "--role", "bare", "--upstream", upstream], path)
        config = self.kids.logs / "bench.yaml"
        config.write_text(proxy_config(upstream))
        profiler = [] if self.profile is None else [
            "-m", "pyinstrument", "-r", "html" if self.profile.suffix == ".html" else "text",
            "-o", str(self.profile),
        ]
        started = time.perf_counter()
        serve = ["-m", "proxy", "serve", "--config", str(config), "--port", "0",
                 "--log-level", "WARNING"]
        self._server("proxy", [python, *profiler, *serve], path)
        memory = {"startup_s": time.perf_counter() - started}
        if self.profile is None:
            self._server("lane-off", [python, *serve, "--no-fast-lane"], path)
        time.sleep(1.0)  # let start-up garbage settle before reading the idle size
        memory["idle"] = rss_mb(self.pids["proxy"])[0]
        for name, url in self.urls.items():
            smoke_check(name, url)
        if self.client == "aiohttp":
            self.kids.start("loadgen", [python, me, "--role", "loadgen"], stdin=True)
        return memory

    def _server(self, name: str, argv: list[str], path: str) -> None:
        self.pids[name] = self.kids.start(name, argv).pid
        self.urls[name] = self.kids.wait_listening(name) + path

    def run(self, target: str, stream: bool, point: Point) -> Run:
        load = Load(self.urls[target], request_body(stream), HEADERS, point.connections,
                    point.duration_s)
        if self.pinned:
            pin(self.pids[target], {0})
        cpu_before = cpu_s(self.pids[target])
        try:
            sample = self._load(load)
        finally:
            if self.pinned:
                pin(self.pids[target], {1})
        cpu_us = (cpu_s(self.pids[target]) - cpu_before) / max(sample.completed, 1) * 1e6
        return Run(sample.rps, sample.p50_ms, sample.p99_ms, cpu_us, sample.errors)

    def _load(self, load: Load) -> Sample:
        if self.client == "wrk":
            return wrk_load(load, self.kids.logs)
        loadgen = self.kids.procs["loadgen"]
        assert loadgen.stdin is not None
        loadgen.stdin.write(load_command(load))
        loadgen.stdin.flush()
        timeout_s = load.duration_s + WARMUP_S + REQUEST_TIMEOUT_S + 10.0
        return Sample(**orjson.loads(self.kids.read_line("loadgen", timeout_s)))


@dataclass(frozen=True)
class Comparison:
    """Proxy against bare pass-through at one mode and load."""

    ratios: list[float]  # proxy req/s over bare req/s, round by round
    added_p50_ms: float
    added_p99_ms: float
    added_cpu_us: float

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def compare(proxy: list[Run], bare: list[Run]) -> Comparison:
    def added(name: str) -> float:
        return Summary(proxy).median(name) - Summary(bare).median(name)

    return Comparison([p.rps / b.rps for p, b in zip(proxy, bare, strict=True)],
                      added("p50_ms"), added("p99_ms"), added("cpu_us"))


def goals(points: list[Point], comparisons: dict[tuple[str, int], Comparison],
          off: dict[tuple[str, int], Comparison], idle_mb: float) -> list[str]:
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    full, moderate = points[0].connections, points[-1].connections
    return [
        f"goal proxy >= 1.0x bare req/s at {full} conns: " + ", ".join(
            f"{mode} {comparisons[(mode, full)].ratio:.2f} "
            f"{verdict(comparisons[(mode, full)].ratio >= 1.0)}" for mode in MODES),
        f"goal lane-off >= 0.8x bare req/s at {full} conns: " + ", ".join(
            f"{mode} {off[(mode, full)].ratio:.2f} "
            f"{verdict(off[(mode, full)].ratio >= 0.8)}" for mode in MODES),
        f"goal added CPU <= 100 us per call at {full} conns: " + ", ".join(
            f"{mode} {comparisons[(mode, full)].added_cpu_us:+.0f} us "
            f"{verdict(comparisons[(mode, full)].added_cpu_us <= 100)}" for mode in MODES),
        f"goal added p99 <= 2 ms at {moderate} conns: " + ", ".join(
            f"{mode} {comparisons[(mode, moderate)].added_p99_ms:+.2f} ms "
            f"{verdict(comparisons[(mode, moderate)].added_p99_ms <= 2.0)}" for mode in MODES),
        f"goal idle RSS < 100 MB: {idle_mb:.1f} MiB {verdict(idle_mb * 1.048576 < 100)}",
    ]


def report(args: argparse.Namespace, client: str, points: list[Point],
           results: dict[Key, list[Run]], memory: dict[str, float]) -> str:
    load = ("wrk, 1 thread" if client == "wrk" else "aiohttp client on uvloop") + (
        "; target pinned alone on CPU 0, the rest on CPU 1" if args.pin
        else ", in its own process"
    )
    lines = [
        f"machine: {machine()}",
        f"load: closed loop, {load}; {args.rounds} rounds, targets alternated within each; "
        + ", ".join(f"{p.connections} conns x {p.duration_s:g} s" for p in points),
        "figures: medians over the rounds; cpu = the target process's own CPU per call",
        "upstream answers: " + ("with api.openai.com's 19 headers" if args.openai_headers
                                else "content-type alone"),
        "",
        f"{'target':<10}{'mode':<7}{'conns':>5}{'req/s':>8}{'rounds':>12}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'cpu us':>8}{'errors':>7}",
    ]
    for mode in MODES:
        for point in points:
            for target in TARGETS:
                s = Summary(results[(target, mode, point.connections)])
                lines.append(
                    f"{target:<10}{mode:<7}{point.connections:>5}{s.median('rps'):>8.0f}"
                    f"{s.rps_range:>12}{s.median('p50_ms'):>8.2f}{s.median('p99_ms'):>8.2f}"
                    f"{s.median('cpu_us'):>8.0f}{s.errors:>7}"
                )
    by_target: dict[str, dict[tuple[str, int], Comparison]] = {}
    for target in ("proxy", "lane-off"):
        lines += ["", f"{target + ' vs bare':<18}{'conns':>5}{'req/s ratio':>12}{'rounds':>12}"
                      f"{'+p50 ms':>9}{'+p99 ms':>9}{'+cpu us':>9}"]
        comparisons = by_target[target] = {}
        for mode in MODES:
            for point in points:
                c = comparisons[(mode, point.connections)] = compare(
                    results[(target, mode, point.connections)],
                    results[("bare", mode, point.connections)],
                )
                lines.append(
                    f"{mode:<18}{point.connections:>5}{c.ratio:>12.2f}"
                    f"{f'{min(c.ratios):.2f}-{max(c.ratios):.2f}':>12}"
                    f"{c.added_p50_ms:>+9.2f}{c.added_p99_ms:>+9.2f}{c.added_cpu_us:>+9.0f}"
                )
    lines += [
        "",
        f"proxy: listening {memory['startup_s']:.1f} s after launch; RSS idle after start-up "
        f"{memory['idle']:.1f} MiB, after the load {memory['after']:.1f} MiB "
        f"(peak {memory['peak']:.1f} MiB)",
        *goals(points, by_target["proxy"], by_target["lane-off"], memory["idle"]),
    ]
    return "\n".join(lines)


def benchmark(kids: Children, args: argparse.Namespace) -> str:
    if args.client == "wrk" and not wrk_path():
        raise SystemExit("--client wrk: wrk is not installed (apt-get install wrk)")
    client = "wrk" if args.client != "aiohttp" and wrk_path() else "aiohttp"
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--pin needs two CPUs")
        os.sched_setaffinity(0, {1})  # every child inherits CPU 1; the target moves to 0
    bench = Bench(kids, client, args.pin, args.profile, args.openai_headers)
    targets = ("proxy",) if args.profile else TARGETS
    memory = bench.start()
    # wrk only takes whole seconds
    seconds: Callable[[float], float] = math.ceil if client == "wrk" else float
    points = [Point(args.connections, seconds(args.duration))]
    if args.moderate != args.connections:
        points.append(Point(args.moderate, seconds(max(1.0, args.duration / 2))))
    warm_up = 0.0 if client == "wrk" else WARMUP_S
    per_round = len(MODES) * len(targets) * sum(p.duration_s + warm_up for p in points)
    print(f"{client} load, about {per_round * args.rounds:.0f} s ...", file=sys.stderr)
    results: dict[Key, list[Run]] = {}
    for round_no in range(1, args.rounds + 1):
        for mode in MODES:
            for point in points:
                for target in targets:
                    run = bench.run(target, mode == "stream", point)
                    results.setdefault((target, mode, point.connections), []).append(run)
                    print(f"round {round_no}/{args.rounds} {mode:<6} {point.connections:>3} "
                          f"conns {target:<8} {run.rps:>7.0f} req/s "
                          f"p99 {run.p99_ms:6.2f} ms", file=sys.stderr)
    memory["after"], memory["peak"] = rss_mb(bench.pids["proxy"])
    if args.profile:
        kids.stop("proxy")  # pyinstrument writes its report as the proxy exits
        return f"pyinstrument profile of the proxy under this load: {args.profile}"
    return report(args, client, points, results, memory)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Requests/s, latency and CPU per call of the proxy against a bare aiohttp "
                    "pass-through and the upstream itself, measured in alternation.")
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds per target per round at full load (default 5; the "
                             "moderate-load point runs half as long)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--connections", type=int, default=32,
                        help="concurrent connections at full load (default 32)")
    parser.add_argument("--moderate", type=int, default=4,
                        help="concurrent connections at moderate load (default 4)")
    parser.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto",
                        help="load generator (default: wrk if installed, else aiohttp)")
    parser.add_argument("--pin", action="store_true",
                        help="the target alone on CPU 0, everything else on CPU 1")
    parser.add_argument("--profile", type=lambda p: Path(p).resolve(), metavar="FILE",
                        help="run only the proxy, under pyinstrument, and write its profile "
                             "to FILE (.html for the HTML view, else text)")
    parser.add_argument("--openai-headers", action="store_true",
                        help="the fake upstream answers with the 19 headers api.openai.com "
                             "sends (x-ratelimit-*, cookies, ...), not content-type alone")
    parser.add_argument("--role", choices=("upstream", "bare", "loadgen"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.rounds < 1 or args.connections < 1 or args.moderate < 1:
        parser.error("--duration must be positive; --rounds and connections at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        run_role(args.role, args.upstream, args.openai_headers)
        return 0
    try:
        with children("bench_overhead.") as kids:
            print(benchmark(kids, args))
    except KeyboardInterrupt:
        print("interrupted; children stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
