"""End to end against real OpenAI-compatible servers: llama.cpp's, on a tiny model.

The servers live outside the project's environment and the checkout, in
``~/.cache/triage-proxy/llama`` (``TRIAGE_LLAMA_HOME`` names another), built once a machine:
``scripts/llama_setup --server`` builds llama-cpp-python's server and llama.cpp's own
``llama-server`` there (``.ci/run`` does, about 7 min on 2 cores the first time).
``TRIAGE_LLAMA_PYTHON`` (a Python with ``llama_cpp.server`` and ``gguf``) and
``TRIAGE_LLAMA_SERVER`` name others. Whatever is missing is skipped, saying why. The
model is written here (``tiny_gguf.py``): gibberish, 12 words a call, in milliseconds.

Each server is called directly with the official SDK first (the baseline), then through
``python -m proxy serve`` under overload: eight calls at once, streams and plain, chat and
completions, on a provider whose ``max_concurrency`` the server can take (1 for
llama-cpp-python's, which ends a running stream when a second call arrives). Every call
must be answered 200 and whole, and no breaker may count a failure: llama-server closes the
connection after each streamed answer though it says keep-alive, which the proxy must
absorb.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from .serving import serving

ROOT = Path(__file__).resolve().parents[1]
LLAMA_HOME = Path(os.environ.get("TRIAGE_LLAMA_HOME") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "triage-proxy" / "llama")
LLAMA_PYTHON = Path(os.environ.get("TRIAGE_LLAMA_PYTHON", LLAMA_HOME / "bin" / "python"))
LLAMA_SERVER = Path(os.environ.get("TRIAGE_LLAMA_SERVER", LLAMA_HOME / "bin" / "llama-server"))
MAX_TOKENS = 12
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello"}]


@dataclass(frozen=True)
class Upstream:
    name: str
    base_url: str  # .../v1
    max_concurrency: int


def missing(*modules: str) -> str | None:
    """Why ``LLAMA_PYTHON`` cannot import ``modules``, or None."""
    if not LLAMA_PYTHON.exists():
        return (f"no {LLAMA_PYTHON} (scripts/llama_setup builds it, about 5 min, as .ci/run "
                "does; TRIAGE_LLAMA_PYTHON names another)")
    probe = subprocess.run([str(LLAMA_PYTHON), "-c", f"import {', '.join(modules)}"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"{LLAMA_PYTHON} cannot import {', '.join(modules)}: {last} (scripts/llama_setup)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if reason := missing("gguf", "numpy"):
        pytest.skip(f"cannot write the tiny model: {reason}")
    path = tmp_path_factory.mktemp("llama") / "tiny.gguf"
    subprocess.run([str(LLAMA_PYTHON), str(ROOT / "tests" / "tiny_gguf.py"), str(path)],
                   check=True, timeout=60)
    return path


@contextlib.contextmanager
def running(command: list[str], log: Path, base: str) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running, once ``base``/v1/models answers (both servers have it;
    llama-server says 503 while it loads); killed on the way out."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready(f"{base}/v1/models"):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{command[0]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield process
    finally:
        process.kill()
        process.wait(10)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module", params=["llama-cpp-python", "llama-server"])
def upstream(request: pytest.FixtureRequest, model: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("llama") / f"{request.param}.log"
    if request.param == "llama-cpp-python":
        if reason := missing("llama_cpp.server"):
            pytest.skip(reason)
        command = [str(LLAMA_PYTHON), "-m", "llama_cpp.server", "--model", str(model),
                   "--model_alias", "tiny", "--host", "127.0.0.1", "--port", str(port),
                   "--n_ctx", "512", "--n_threads", "1"]
        limit = 1  # it ends a running stream when a second call arrives
    else:
        if not LLAMA_SERVER.exists():
            pytest.skip(f"no {LLAMA_SERVER} (scripts/llama_setup --server builds it; "
                        "TRIAGE_LLAMA_SERVER names another)")
        command = [str(LLAMA_SERVER), "--model", str(model), "--alias", "tiny",
                   "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "1024",
                   "--parallel", "2", "--threads", "1"]
        limit = 2  # its slots: a third call would wait inside it, out of the proxy's sight
    with running(command, log, base):
        yield Upstream(request.param, f"{base}/v1", limit)


def check_chat(answer: Any) -> str:
    choice = answer.choices[0]
    assert choice.finish_reason == "length", answer
    assert answer.usage.completion_tokens == MAX_TOKENS
    content: str = choice.message.content
    assert content.strip(), answer
    return content


def check_text(answer: Any) -> str:
    assert answer.choices[0].finish_reason == "length", answer
    text: str = answer.choices[0].text
    assert text.strip(), answer
    return text


def check_stream(chunks: list[Any], *, chat: bool) -> str:
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or ""
              for c in chunks if c.choices]
    assert "".join(pieces).strip(), chunks
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    return "".join(pieces)


def four_calls(client: openai.AsyncOpenAI, tier: str | None = None) -> list[Awaitable[str]]:
    """One of each, not yet awaited: chat whole and streamed, completion whole and
    streamed, each checked whole."""
    common: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS,
                              "extra_headers": {"X-Priority": tier} if tier else {}}

    async def chat() -> str:
        return check_chat(await client.chat.completions.create(messages=MESSAGES, **common))

    async def chat_stream() -> str:
        stream = await client.chat.completions.create(messages=MESSAGES, stream=True,
                                                      **common)
        return check_stream([c async for c in stream], chat=True)

    async def text() -> str:
        return check_text(await client.completions.create(prompt="Once upon a", **common))

    async def text_stream() -> str:
        stream = await client.completions.create(prompt="Once", stream=True, **common)
        return check_stream([c async for c in stream], chat=False)

    return [chat(), chat_stream(), text(), text_stream()]


async def test_the_sdk_against_the_server_directly(upstream: Upstream) -> None:
    """The baseline: what the proxy is compared with works without it, one call at a
    time."""
    async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="none",
                                  max_retries=0) as client:
        for call in four_calls(client):
            assert await call


def routing(upstream: Upstream) -> str:
    return f"""
tiers:
  - {{name: high, max_wait_s: 120}}
  - {{name: low, max_wait_s: 120}}
classify: {{default_tier: low}}
providers:
  - name: llama
    kind: openai
    base_url: {upstream.base_url}
    max_concurrency: {upstream.max_concurrency}
models:
  tiny: [{{provider: llama, model: tiny}}]
"""


async def settled(base: str) -> dict[str, Any]:
    """``/admin/status`` once no call is in flight (the last stream's slot is freed just
    after its last byte is written)."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(5):
        while True:
            async with session.get(f"{base}/admin/status") as resp:
                status: dict[str, Any] = await resp.json()
            if status["providers"]["llama"]["inflight"] == 0:
                return status
            await asyncio.sleep(0.05)


async def test_the_proxy_answers_every_call_under_overload(
        upstream: Upstream, tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(routing(upstream))
    async with serving(config) as (base, _), openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key="none", max_retries=0) as client:
        started = time.monotonic()
        # Eight calls at once (two rounds of four kinds, both tiers), then four more on
        # the connections they left behind.
        overload = await asyncio.gather(*four_calls(client, "high"),
                                        *four_calls(client, "low"))
        elapsed = time.monotonic() - started
        after = [await call for call in four_calls(client)]
        status = await settled(base)
    assert len(overload) == 8 and len(after) == 4
    breaker = status["breakers"]["llama/tiny"]
    assert breaker["state"] == "closed", breaker
    assert (breaker["consecutive_failures"], breaker["window_failures"],
            breaker["opened_count"]) == (0, 0, 0), breaker
    print(f"{upstream.name}: 8 calls at once through the proxy in {elapsed:.2f} s")
