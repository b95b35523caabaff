"""``serve --workers N``: N serving processes on one port (``SO_REUSEPORT``: the kernel
spreads connections over them), sharing slots, limits and order through the redis state
backend. This process only supervises: it forwards SIGTERM/SIGINT/SIGHUP, restarts a
worker that dies on its own, and exits once every worker has stopped."""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 1.0
PR_SET_PDEATHSIG = 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) with SO_REUSEPORT: it holds the port for the workers,
    and when ``port`` is 0 picks the one they all bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _death_signal() -> Callable[[], None] | None:
    """Linux: run in a new worker, it gets SIGTERM if the supervisor dies (even by
    SIGKILL). Looked up before forking: nothing but the call itself runs in the child."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(workers: int, host: str, port: int, child_args: Sequence[str],
              token_env: str) -> int:
    """Run ``workers`` copies of ``serve`` (``child_args`` plus the port) until told to
    stop; the exit status is the first non-zero one of a stopping worker, else 0. Each gets
    the same internal token in ``token_env``."""
    held = reserve_port(host, port)
    port = held.getsockname()[1]
    command = [sys.executable, "-m", "proxy", "serve", *child_args, "--host", host,
               "--port", str(port), "--reuse-port"]
    on_fork = _death_signal()
    token = secrets.token_urlsafe(32)
    stopping = False
    children: dict[int, subprocess.Popen[bytes]] = {}

    def start() -> None:
        # Its own session: a terminal's Ctrl-C reaches the workers once, through this
        # process (twice would cut their drain short).
        child = subprocess.Popen(command, start_new_session=True, preexec_fn=on_fork,
                                 env={**os.environ, token_env: token})
        children[child.pid] = child

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    log.info("%d workers on http://%s:%d", workers, host, port)
    for _ in range(workers):
        start()
    status = 0
    try:
        while children:
            pid, code = os.wait()  # woken by a worker's exit; signals run their handler
            child = children.pop(pid, None)
            if child is None:
                continue
            child.returncode = os.waitstatus_to_exitcode(code)
            if stopping:
                status = status or max(child.returncode, 0)
            else:
                log.warning("worker %d exited (%d); starting another", pid, child.returncode)
                time.sleep(RESTART_PAUSE_S)
                start()
    finally:
        held.close()
    return status
