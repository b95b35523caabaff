"""Command line: ``python -m proxy serve|check|simulate --config routing.yaml``, and
``python -m proxy scoreboard``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from . import __version__
from .config import Config, ConfigError, load_config

INTERNAL_TOKEN_ENV = "TRIAGE_INTERNAL_TOKEN"


def _summary(config: Config) -> str:
    lines = [
        f"tiers: {', '.join(config.tier_names)}",
        "keys: " + (
            f"{len(config.keys)} enabled" if config.auth_required
            else "none (any bearer token accepted)"
        ),
        "providers: " + ", ".join(
            f"{p.name} ({p.kind}, max_concurrency {p.max_concurrency}"
            f"{f', via {p.egress.shown}' if p.egress is not None else ''})"
            for p in config.providers.values()
        ),
        "models: " + ", ".join(
            f"{name} -> {' | '.join(d.id for d in route.candidates) or 'nothing enabled'}"
            for name, route in config.models.items()
        ),
    ]
    lines += [f"warning: {w}" for w in config.warnings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triage-proxy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"triage-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", default="routing.yaml", help="the routing table (YAML)")
    serve.add_argument("--host", help="overrides listen.host")
    serve.add_argument("--port", type=int, help="overrides listen.port (0: any free port)")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--access-log", action="store_true",
                       help="one line per call on stdout (access_log.format: json or text)")
    serve.add_argument("--workers", type=int, default=1,
                       help="processes serving one port (more than 1 needs state.backend: "
                            "redis)")
    serve.add_argument("--no-fast-lane", action="store_true",
                       help="serve every call through aiohttp's own request handling "
                            "(as server.fast_lane: false)")
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    check = commands.add_parser("check", help="validate a config and print a summary")
    check.add_argument("--config", default="routing.yaml", help="the routing table (YAML)")
    sim = commands.add_parser(
        "simulate", help="replay a trace through the real scheduler on a virtual clock")
    sim.add_argument("--config", action="append", dest="configs", metavar="PATH",
                     help="the routing table (default routing.yaml); a second one is "
                          "compared with the first on the same trace")
    sim.add_argument("--trace", required=True,
                     help="CSV (TIMESTAMP,ContextTokens,GeneratedTokens[,tier,key,model,"
                          "max_tokens,stream]), .jsonl, or the JSON access log (.log)")
    sim.add_argument("--speed", type=float, default=1.0,
                     help="arrivals this many times as fast (default 1)")
    sim.add_argument("--compare", metavar="fcfs,priority,wfq,static",
                     help="the same calls under reference disciplines (comma-separated): "
                          "first come first served, strict priority, weighted fair "
                          "queueing, static slots per tier")
    sim.add_argument("--json", action="store_true", help="one JSON object, on the last line")
    sim.add_argument("--out", metavar="report.html",
                     help="write a self-contained HTML report with charts")
    board = commands.add_parser(
        "scoreboard", help="the policy's bounds on every scenario, beside reference disciplines")
    board.add_argument("--only", metavar="NAME[,NAME...]", help="these scenarios only")
    board.add_argument("--details", action="store_true",
                       help="each bound's figures and the disciplines side by side")
    board.add_argument("--json", action="store_true", help="one JSON object, on the last line")
    board.add_argument("--markdown", action="store_true", help="the table in Markdown")
    board.add_argument("--seeds", type=int, default=1, metavar="N",
                       help="each scenario drawn with seeds 0 to N-1 and judged on all their "
                            "calls together (default 1: the scoreboard's own calls)")
    fitting = commands.add_parser(
        "fit", help="fit each provider's simulate: timing from a JSON access log")
    fitting.add_argument("--log", required=True, help="the proxy's JSON access log")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "ERROR"),  # check prints its warnings itself
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "scoreboard":
        from .sim.cli import scoreboard_command

        return scoreboard_command(args.only, args.details, args.json, args.markdown,
                                  args.seeds)
    if args.command == "fit":
        from .sim.fit import fit_command

        try:
            return fit_command(args.log)
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    if args.command == "simulate":
        args.config, *others = args.configs or ["routing.yaml"]
    try:
        config = load_config(args.config)
        other = None
        if args.command == "simulate" and others:
            if len(others) > 1:
                print("simulate compares at most two configs", file=sys.stderr)
                return 2
            other = load_config(others[0])
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(f"{args.config}: ok")
        print(_summary(config))
        return 0
    if args.command == "simulate":
        from .sim.cli import simulate_command

        return simulate_command(config, args.trace, args.speed, args.compare, args.json,
                                other, args.out)
    host = args.host or config.listen.host
    port = config.listen.port if args.port is None else args.port
    if args.workers != 1:
        return _workers(args, config, host, port)
    from .http.server.server import run

    if args.access_log:
        config = dataclasses.replace(
            config, access_log=dataclasses.replace(config.access_log, enabled=True))
    if args.no_fast_lane:
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, fast_lane=False))
    try:
        # Workers of one supervisor share the token their own calls (batch lines,
        # background responses) authenticate with: a line may land on any of them.
        run(config, host, port, args.config, reuse_port=args.reuse_port,
            internal_token=os.environ.get(INTERNAL_TOKEN_ENV) if args.reuse_port else None)
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _workers(args: argparse.Namespace, config: Config, host: str, port: int) -> int:
    if args.workers < 1 or args.workers > 256:
        print("--workers must be between 1 and 256", file=sys.stderr)
        return 2
    if config.state.backend != "redis":
        print(f"--workers {args.workers} needs state.backend: redis in {args.config}: the "
              "processes share provider slots, limits and one priority order through it "
              "(the memory backend is one process)", file=sys.stderr)
        return 2
    from .http.server.workers import supervise

    child = ["--config", args.config, "--log-level", args.log_level]
    if args.access_log:
        child.append("--access-log")
    if args.no_fast_lane:
        child.append("--no-fast-lane")
    try:
        return supervise(args.workers, host, port, child, INTERNAL_TOKEN_ENV)
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
