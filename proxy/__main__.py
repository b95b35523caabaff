"""The command line, ``python -m proxy`` or ``triage-proxy``: ``serve``, ``check``,
``simulate``, ``scoreboard`` and ``fit``. What ``--help`` prints is plain text, not this
docstring's reST."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from . import __version__
from .config import Config, ConfigError, load_config

INTERNAL_TOKEN_ENV = "TRIAGE_INTERNAL_TOKEN"
ABOUT = "An OpenAI-compatible reverse proxy that decides which LLM call goes first."
COMMANDS = {
    "serve": "run the proxy; it prints 'listening on URL' when ready",
    "check": "validate a routing table and print a summary",
    "simulate": "replay a trace through the real scheduler on a virtual clock",
    "scoreboard": "check the scheduling policy's bounds on every scenario, beside reference "
                  "disciplines (exit status 1 if one fails)",
    "fit": "fit each provider's timing (its simulate: block) from the proxy's JSON access "
           "log",
}
# When stdout's reader has gone (``simulate ... | head``): the status of a process that
# SIGPIPE ended, as ``yes | head`` gives; 1 is the scoreboard's failed bound, 2 a usage error.
STDOUT_CLOSED = 141


def _summary(config: Config) -> str:
    lines = [
        f"tiers: {', '.join(config.tier_names)}",
        "keys: " + (
            f"{len(config.keys)} enabled" if config.auth_required
            else "none (any bearer token accepted)"
        ),
        "providers: " + ", ".join(
            f"{p.name} ({p.kind}, max_concurrency {p.max_concurrency}"
            f"{f', via {p.egress.display_url}' if p.egress is not None else ''})"
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
    try:
        try:
            return _command(argv)
        finally:
            # Flushed here, where a reader that has gone can still be caught, not at exit.
            sys.stdout.flush()
    except BrokenPipeError:
        # As the Python docs advise (the signal module, "Note on SIGPIPE"): what is still
        # buffered goes to devnull, or the flush at exit fails again and prints a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return STDOUT_CLOSED


def _command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="triage-proxy", description=ABOUT,
        epilog="Each command's options: triage-proxy COMMAND --help. More in README.md and "
               "docs/.")
    parser.add_argument("--version", action="version", version=f"triage-proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str) -> argparse.ArgumentParser:
        # Its help in the list of commands, and its description atop its own --help.
        return commands.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])

    serve = command("serve")
    serve.add_argument("--config", default="routing.yaml",
                       help="the routing table (YAML; default routing.yaml)")
    serve.add_argument("--host", help="overrides listen.host")
    serve.add_argument("--port", type=int, help="overrides listen.port (0: any free port)")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    serve.add_argument("--access-log", action="store_true",
                       help="one line per call on stdout (access_log.format: json or text)")
    serve.add_argument("--workers", type=int, default=1,
                       help="processes serving one port (default 1; more needs "
                            "state.backend: redis)")
    serve.add_argument("--no-fast-lane", action="store_true",
                       help="serve every call through aiohttp's own request handling "
                            "(as server.fast_lane: false)")
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    check = command("check")
    check.add_argument("--config", default="routing.yaml",
                       help="the routing table (YAML; default routing.yaml)")
    sim = command("simulate")
    sim.add_argument("--config", action="append", dest="configs", metavar="PATH",
                     help="the routing table (default routing.yaml); a second one is "
                          "compared with the first on the same trace")
    sim.add_argument("--trace", required=True,
                     help="CSV (TIMESTAMP, ContextTokens, GeneratedTokens, and optionally "
                          "tier, key, model, max_tokens, stream), .jsonl, or the JSON access "
                          "log (.log)")
    sim.add_argument("--speed", type=float, default=1.0,
                     help="arrivals this many times as fast (default 1)")
    sim.add_argument("--compare", metavar="fcfs,priority,wfq,static",
                     help="the same calls under reference disciplines (comma-separated): "
                          "first come first served, strict priority, weighted fair "
                          "queueing, static slots per tier")
    sim.add_argument("--json", action="store_true", help="one JSON object, on the last line")
    sim.add_argument("--out", metavar="report.html",
                     help="write a self-contained HTML report with charts")
    board = command("scoreboard")
    board.add_argument("--only", metavar="NAME[,NAME...]", help="these scenarios only")
    board.add_argument("--details", action="store_true",
                       help="each bound's figures and the disciplines side by side")
    board.add_argument("--json", action="store_true", help="one JSON object, on the last line")
    board.add_argument("--markdown", action="store_true", help="the table in Markdown")
    board.add_argument("--seeds", type=int, default=1, metavar="N",
                       help="each scenario drawn with seeds 0 to N-1 and judged on all their "
                            "calls together (default 1: the scoreboard's own calls)")
    board.add_argument("--held-out", action="store_true",
                       help="workloads the policy was not tuned on (other rates and seeds of "
                            "the peak, a real code trace) instead of the scoreboard's own")
    fitting = command("fit")
    fitting.add_argument("--log", required=True,
                         help="the proxy's JSON access log (serve --access-log)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "ERROR"),  # check prints its warnings itself
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "scoreboard":
        from .sim.cli import scoreboard_command

        return scoreboard_command(args.only, args.details, args.json, args.markdown,
                                  args.seeds, args.held_out)
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
    except BrokenPipeError:
        raise  # "listening on" met a closed stdout, not a port in use: main ends quietly
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
