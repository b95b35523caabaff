"""Real Redis for the tests: the one on 127.0.0.1:6379 (``.ci/run`` starts it), under a
prefix of the test's own, or a private ``redis-server`` a test may kill and restart."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

URL = "redis://127.0.0.1:6379/0"
NO_SERVER = "redis-server is not on PATH: install Debian's redis-server package"


def shared_redis() -> redis.Redis:
    client = redis.Redis.from_url(URL, socket_timeout=2, decode_responses=True)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {URL}: {exc} (.ci/run starts one when redis-server is "
                    "installed)")
    return client


@contextlib.contextmanager
def prefixed() -> Iterator[tuple[redis.Redis, str]]:
    """A client and a fresh prefix; the prefix's keys are deleted afterwards."""
    client = shared_redis()
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    try:
        yield client, prefix
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free port, that it may stop and start."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip(NO_SERVER)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


class SlowRelay:
    """A loopback relay to Redis on ``port`` that holds each of Redis' answers
    ``delay_s`` before passing it on: a slow Redis, as a client sees it."""

    def __init__(self, port: int, delay_s: float) -> None:
        self.target = port
        self.delay_s = delay_s
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        pipes = [asyncio.ensure_future(self._pipe(reader, up_writer, 0.0)),
                 asyncio.ensure_future(self._pipe(up_reader, writer, self.delay_s))]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for pipe in pipes:
            pipe.cancel()
        writer.close()
        up_writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    delay_s: float) -> None:
        while data := await reader.read(65536):
            if delay_s:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
