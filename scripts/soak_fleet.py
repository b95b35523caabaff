"""The soak's processes (scripts/soak.py): a private ``redis-server`` on a free port, the
fake providers (scripts/soak_upstream.py) and three ``python -m proxy serve`` replicas,
each on a port of its own that a restart keeps. Every child is in a session of its own
and dies with the soak (``PR_SET_PDEATHSIG``); logs go to the soak's log folder, a file
per replica generation."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis.asyncio as aredis
from bench_common import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
READY_S = 60.0
PREFIX = "soak"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _spawn(argv: list[str], log: Path, stdout: int | IO[bytes] = subprocess.PIPE,
           ) -> subprocess.Popen[bytes]:
    with log.open("ab") as err:
        return subprocess.Popen(argv, cwd=ROOT, stdout=stdout, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def _listening(proc: subprocess.Popen[bytes], log: Path, name: str) -> str:
    """The URL of the child's ``listening on`` line; the rest of its stdout is copied to
    its log by a thread (so a full pipe never blocks it)."""
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), READY_S)
                ).decode()
    except TimeoutError:
        line = ""
    if not line.startswith("listening on "):
        proc.kill()
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{name} did not start ({line!r}); its log ends:\n{tail}")
    out = proc.stdout

    def copy() -> None:
        with log.open("ab") as sink:
            for chunk in iter(lambda: out.readline(), b""):
                sink.write(chunk)

    threading.Thread(target=copy, daemon=True).start()
    return line.removeprefix("listening on ").strip()


class Redis:
    """A ``redis-server`` of the soak's own that it may kill, restart empty and pause."""

    def __init__(self, logs: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = _spawn(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no"], self.logs / "redis.log",
                           stdout=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    await client.ping()  # type: ignore[misc]
                    return
                except (aredis.RedisError, OSError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    def client(self) -> aredis.Redis:
        return aredis.Redis(port=self.port, socket_timeout=2, decode_responses=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if self.paused:
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    paused = False

    def pause(self, on: bool) -> None:
        assert self.proc is not None
        self.paused = on
        self.proc.send_signal(signal.SIGSTOP if on else signal.SIGCONT)


@dataclass
class Generation:
    """One run of a replica's process."""

    replica: int
    gen: int
    proc: subprocess.Popen[bytes]
    started: float
    log: Path
    ended: float | None = None
    how: str = ""  # killed | terminated | at the end
    exit_code: int | None = None
    drain_s: float | None = None
    replica_id: str = ""  # the proxy's own name for it (/admin/status), as in lease members
    rss: list[tuple[float, int]] = field(default_factory=list)  # (since start s, KiB)

    @property
    def name(self) -> str:
        return f"r{self.replica}.{self.gen}"


class Replica:
    """A replica: a fixed port and the generations that served it."""

    def __init__(self, index: int, config: Path, logs: Path) -> None:
        self.index = index
        self.config = config
        self.logs = logs
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.generations: list[Generation] = []
        self.up = False  # the load may send it calls

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    async def start(self) -> Generation:
        gen = len(self.generations)
        log = self.logs / f"r{self.index}.{gen}.log"
        proc = _spawn([sys.executable, "-m", "proxy", "serve", "--config", str(self.config),
                       "--port", str(self.port), "--log-level", "WARNING", "--access-log"], log)
        generation = Generation(self.index, gen, proc, time.monotonic(), log)
        self.generations.append(generation)
        await _listening(proc, log, generation.name)
        self.up = True
        return generation

    def kill(self) -> Generation:
        self.up = False
        generation = self.current
        generation.proc.kill()
        generation.proc.wait(10)
        generation.ended, generation.how = time.monotonic(), "killed"
        generation.exit_code = generation.proc.returncode
        return generation

    async def terminate(self, grace_s: float, how: str = "terminated") -> Generation:
        """SIGTERM and wait for the drain (SIGKILL past ``grace_s``)."""
        self.up = False
        generation = self.current
        if generation.proc.poll() is None:
            generation.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.to_thread(generation.proc.wait), grace_s)
        except TimeoutError:
            generation.proc.kill()
            await asyncio.to_thread(generation.proc.wait)
        generation.ended, generation.how = time.monotonic(), how
        generation.exit_code = generation.proc.returncode
        generation.drain_s = generation.ended - sent
        return generation


class Upstream:
    def __init__(self, logs: Path, ceilings: dict[str, int], redis_port: int) -> None:
        self.redis_port = redis_port
        self.logs = logs
        self.ceilings = ceilings
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    async def start(self) -> None:
        spec = ",".join(f"{name}={c}" for name, c in self.ceilings.items())
        log = self.logs / "upstream.log"
        self.proc = _spawn([sys.executable, str(HERE / "soak_upstream.py"),
                            "--providers", spec, "--redis-port", str(self.redis_port),
                            "--prefix", PREFIX], log)
        self.url = await _listening(self.proc, log, "upstream")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
