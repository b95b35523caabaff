"""Instructions per call: the proxy against the bare pass-through, counted, not timed.

These machines are noisy: the same code's CPU per call moves by a third from one run of
``bench_overhead`` to the next. valgrind's callgrind counts the instructions a process
executes, which repeat to a fraction of a percent whatever else the machine does. Each
target (``bare``, ``proxy``) runs under callgrind with counting off; after a warm-up the
benchmark turns counting on for ``--calls`` sequential calls over ``--connections``
keep-alive connections, then off, so start-up and shut-down are not counted. The fake
upstream runs outside valgrind.

The count still depends a little on timing: how many reads a stream's events arrive in
(each read is another pass through the parser and the relay) moved it by up to 4 %. So
every target runs ``--rounds`` times, in alternation, and the fewest instructions per call
(the most coalesced reads) is the figure; the spread is shown beside it.

Instructions are not time (cache misses, syscalls and the kernel are not in them), but a
change that executes fewer of them on the same path is cheaper: use it to compare
commits, and ``bench_overhead`` for requests per second. The ratio ``bare / proxy`` is
the requests/s ratio a CPU-bound proxy would reach if instructions were all that counted.

    .venv/bin/python scripts/bench_instructions.py [--calls 200] [--rounds 3]
        [--modes json,stream] [--openai-headers]
"""

from __future__ import annotations

import argparse
import http.client
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench_common import Children, children, machine
from bench_overhead import HEADERS, proxy_config, request_body

READY_S = 120.0  # start-up under valgrind is some 20x slower
TOTALS = re.compile(r"^totals: (\d+)", re.MULTILINE)


def calls(url: str, stream: bool, count: int, connections: int) -> None:
    """``count`` calls, one at a time, over ``connections`` keep-alive connections."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(connections)]
    body = request_body(stream)
    for i in range(count):
        conn = conns[i % connections]
        conn.request("POST", "/v1/chat/completions", body=body, headers=HEADERS)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status} {data[:200]!r}")
    for conn in conns:
        conn.close()


def counted(kids: Children, name: str, argv: list[str], stream: bool,
            args: argparse.Namespace) -> float:
    """Instructions per call of one target, started under callgrind for this mode alone."""
    out = kids.logs / f"{name}.callgrind"
    kids.start(name, ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                      f"--callgrind-out-file={out}", *argv])
    line = kids.read_line(name, READY_S)
    if not line.startswith("listening on "):
        kids.fail(name, f"unexpected first line {line!r}")
    url = line.removeprefix("listening on ").strip()
    pid = str(kids.procs[name].pid)
    calls(url, stream, args.warmup, args.connections)
    subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
    calls(url, stream, args.calls, args.connections)
    subprocess.run(["callgrind_control", "--instr=off", pid], check=True, capture_output=True)
    kids.stop(name)
    found = TOTALS.search(out.read_text())
    if found is None:
        kids.fail(name, f"no totals in {out}")
    return int(found[1]) / args.calls


def benchmark(kids: Children, args: argparse.Namespace) -> str:
    python, here = sys.executable, Path(__file__).resolve().parent
    kids.start("upstream", [python, str(here / "bench_overhead.py"), "--role", "upstream",
                            *(["--openai-headers"] if args.openai_headers else [])])
    upstream = kids.wait_listening("upstream")
    config = kids.logs / "bench.yaml"
    config.write_text(proxy_config(upstream))
    targets = {
        "bare": [python, str(here / "bench_overhead.py"), "--role", "bare",
                 "--upstream", upstream],
        "proxy": [python, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
                  "--log-level", "WARNING"],
    }
    targets["lane-off"] = [*targets["proxy"], "--no-fast-lane"]
    lines = [f"machine: {machine()}",
             f"{args.calls} calls after {args.warmup} of warm-up, one at a time over "
             f"{args.connections} keep-alive connections; callgrind instruction counts, the "
             f"fewest of {args.rounds} rounds (spread in brackets); upstream answers with "
             + ("api.openai.com's 19 headers" if args.openai_headers else "content-type alone"),
             "", f"{'mode':8}{'target':10}{'bare':>20}{'target':>20}{'added':>10}"
                 f"{'bare/target':>12}"]
    for mode in args.modes:
        runs: dict[str, list[float]] = {name: [] for name in targets}
        for round_ in range(args.rounds):
            for name, argv in targets.items():
                runs[name].append(counted(kids, f"{name}-{mode}-{round_}", argv,
                                          mode == "stream", args))
        bare = min(runs["bare"])
        for name in ("proxy", "lane-off"):
            target = min(runs[name])
            lines.append(f"{mode:8}{name:10}{_spread(runs['bare']):>20}"
                         f"{_spread(runs[name]):>20}{target - bare:>+10,.0f}"
                         f"{bare / target:>12.3f}")
    return "\n".join(lines)


def _spread(runs: list[float]) -> str:
    low = min(runs)
    return f"{low:,.0f} (+{(max(runs) - low) / low:.1%})"



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls counted (default 200)")
    parser.add_argument("--warmup", type=int, default=50, help="calls before (default 50)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each target, the fewest counted (default 3)")
    parser.add_argument("--connections", type=int, default=4,
                        help="keep-alive connections the calls take turns on (default 4)")
    parser.add_argument("--openai-headers", action="store_true",
                        help="the fake upstream answers with the 19 headers api.openai.com "
                             "sends, not content-type alone")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["json", "stream"],
                        help="comma-separated: json, stream (default both)")
    args = parser.parse_args(argv)
    if min(args.calls, args.warmup, args.connections, args.rounds) < 1:
        parser.error("--calls, --warmup, --connections and --rounds must be at least 1")
    if not set(args.modes) <= {"json", "stream"}:
        parser.error("--modes takes json and stream")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("needs valgrind (Debian: apt-get install valgrind)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with children("bench_instructions.") as kids:
        print(benchmark(kids, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
