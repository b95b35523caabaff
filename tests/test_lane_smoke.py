"""The real ``serve`` with the fast lane on, switched off, and off because the aiohttp it
runs on lacks what the lane reads: each serves health, models, JSON and streamed calls on
one keep-alive connection, frees the slot of a client that leaves mid-stream, and says in
``/admin/status`` (and once in the log) whether the lane is on. ``.ci/run`` runs this
module on the lowest and the newest aiohttp that ``pyproject.toml`` admits."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from .serving import serving

CONFIG = """
providers:
  - name: sim
    kind: simulated
    max_concurrency: 2
    simulate: {ttft_s: 0.01, tokens_per_s: 400}
models:
  m: [{provider: sim, model: s}]
"""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
# Run at start-up by Python itself: an aiohttp without a name the lane reads (aiohttp's
# own modules hold it already).
LACKING = """import aiohttp.web, aiohttp.tcp_helpers
del aiohttp.tcp_helpers.tcp_keepalive
"""


def one_connection(base: str) -> list[tuple[int, bytes]]:
    """Health, models, a JSON call and a streamed one on one connection (http.client
    opens a new one only if the server closed it: the socket must stay the same)."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    answers = []
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/healthz", None), ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
        ("POST", "/v1/chat/completions", CHAT)]
    sock = None
    for method, path, body in calls:
        connection.request(method, path, body=None if body is None else orjson.dumps(body),
                           headers={"content-type": "application/json"})
        answer = connection.getresponse()
        answers.append((answer.status, answer.read()))
        assert not answer.will_close, path
        if sock is None:
            sock = connection.sock
        assert connection.sock is sock, f"{path}: the server closed the connection"
    connection.close()
    return answers


async def leave_mid_stream(base: str) -> None:
    """Read the head and a first event of a long stream, then hang up: the slot is free
    again at once."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps({**CHAT, "stream": True, "max_tokens": 4000})
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert (await reader.readuntil(b"data: ")).startswith(b"HTTP/1.1 200")
    writer.transport.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.close()


async def status(base: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/admin/status") as got:
        shown: dict[str, Any] = await got.json()
        return shown


@pytest.mark.parametrize("mode", ["on", "--no-fast-lane", "server.fast_lane: false",
                                  "aiohttp lacks"])
async def test_serve_answers_everything_whether_the_lane_is_on_or_not(
        tmp_path: Path, mode: str) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(CONFIG + ("server: {fast_lane: false}\n" if mode.startswith("server")
                                else ""))
    args = ("--no-fast-lane",) if mode.startswith("--") else ()
    env = None
    if mode == "aiohttp lacks":
        (tmp_path / "sitecustomize.py").write_text(LACKING)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(tmp_path),
                                                            os.environ.get("PYTHONPATH"))))}
    log = tmp_path / "log.txt"
    with log.open("w") as stderr:
        async with serving(config, *args, env=env, stderr=stderr) as (base, _):
            answers = await asyncio.to_thread(one_connection, base)
            assert [status for status, _ in answers] == [200] * 5
            assert orjson.loads(answers[1][1])["data"][0]["id"] == "m"
            assert orjson.loads(answers[2][1])["choices"][0]["message"]["content"]
            assert answers[3][1].startswith(b"data: ") and b"data: [DONE]" in answers[3][1]
            await leave_mid_stream(base)
            async with asyncio.timeout(2):
                while (await status(base))["providers"]["sim"]["inflight"]:
                    await asyncio.sleep(0.02)
            server = (await status(base))["server"]
    assert server["aiohttp"] == aiohttp.__version__
    assert server["fast_lane"] is (mode == "on")
    warned = [line for line in log.read_text().splitlines() if "fast lane off" in line]
    if mode == "on":
        assert server["fast_lane_off_because"] is None and not warned
    elif mode == "aiohttp lacks":
        assert "aiohttp.tcp_helpers.tcp_keepalive" in server["fast_lane_off_because"]
        assert len(warned) == 1 and "tcp_keepalive" in warned[0]
    else:
        assert "turned off" in server["fast_lane_off_because"] and not warned
