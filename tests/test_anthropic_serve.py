"""Anthropic's clients against the real ``serve``: the ``anthropic`` Python SDK, the Node
``@anthropic-ai/sdk`` (``tests/node/anthropic.mjs``) and Claude Code in its non-interactive
mode (``claude -p``), each reaching a Claude candidate (a fake of Anthropic's API this test
runs on 127.0.0.1) and an OpenAI-style one (the simulated provider).

The Node packages are pinned in ``tests/node`` and ``tests/claude`` (``package.json`` and its
lock); ``.ci/run`` installs them with ``npm ci``. Without ``node`` or a package its tests skip,
saying why."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import orjson
import pytest
from aiohttp import web

from .fake_anthropic import KEY, FakeAnthropic
from .serving import serving

HERE = Path(__file__).resolve().parent
NODE_SCRIPT = HERE / "node" / "anthropic.mjs"
NODE_SDK = HERE / "node" / "node_modules" / "@anthropic-ai" / "sdk" / "package.json"
CLAUDE = HERE / "claude" / "node_modules" / ".bin" / "claude"
CONFIG = """
classify:
  keys:
    - {{name: interactive, key: interactive-key, tier: high}}
    - {{name: agents, key: agents-key, tier: low}}
providers:
  - name: claude
    kind: anthropic
    base_url: {claude_url}
    api_key: {key}
    max_concurrency: 2
  - name: sim
    kind: simulated
    max_concurrency: 4
    simulate: {{ttft_s: 0.01, tokens_per_s: 500, max_output_tokens: 8}}
models:
  claude-m: [{{provider: claude, model: claude-sonnet-4-5}}]
  sim-m: [{{provider: sim, model: sim-small}}]
"""
T = TypeVar("T")
# Claude Code, quiet: no updates, telemetry or other traffic than its calls to the proxy.
QUIET = {"DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


async def fake_server(fake: FakeAnthropic) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Served:
    base: str  # serve's URL
    fake: FakeAnthropic  # the Claude candidate behind it


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One ``serve`` on the test's routing table and its Claude fake, for the module: both
    on an event loop of their own, so the clients here can block."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(step: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(step, loop).result(60)

    fake = FakeAnthropic()
    runner, claude_url = call(fake_server(fake))
    config = tmp_path_factory.mktemp("anthropic") / "routing.yaml"
    config.write_text(CONFIG.format(claude_url=claude_url, key=KEY))
    context = serving(config)
    try:
        base, _ = call(context.__aenter__())
        yield Served(base, fake)
        call(context.__aexit__(None, None, None))
    finally:
        call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# --- the anthropic Python SDK ---------------------------------------------------------------

@pytest.mark.parametrize(("model", "text"), [("claude-m", "Hello!"),
                                             ("sim-m", "lorem ipsum dolor sit amet")])
def test_the_python_sdk_gets_json_and_streams_from_both_kinds(
        served: Served, model: str, text: str) -> None:
    client = anthropic.Anthropic(base_url=served.base, api_key="interactive-key", max_retries=0)
    raw = client.messages.with_raw_response.create(model=model, max_tokens=5,
                                                   messages=[{"role": "user", "content": "hi"}])
    message = raw.parse()
    assert "".join(b.text for b in message.content if b.type == "text").strip() == text
    assert raw.headers["x-proxy-tier"] == "high" and message._request_id is not None
    with client.messages.stream(model=model, max_tokens=5,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        assert "".join(stream.text_stream).strip() == text
    client.close()


# --- the Node @anthropic-ai/sdk -------------------------------------------------------------

def node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH: the Node SDK's checks need Node.js 20 or later")
    if not NODE_SDK.exists():
        pytest.skip(f"@anthropic-ai/sdk is not in {NODE_SDK.parents[2]}: "
                    "`npm ci --prefix tests/node` installs it (.ci/run does)")
    return node


@pytest.fixture(scope="module")
def node_checks(served: Served) -> dict[str, dict[str, Any]]:
    node = node_or_skip()
    done = subprocess.run([node, str(NODE_SCRIPT), served.base], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = [orjson.loads(line) for line in done.stdout.splitlines()]
    return {line.pop("check"): line for line in lines}


def check(checks: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    assert name in checks, f"anthropic.mjs printed no line for {name!r}: {sorted(checks)}"
    assert "error" not in checks[name], f"{name}: {checks[name]['error']}"
    return checks[name]


def test_the_node_sdk_run_is_the_pinned_one(node_checks: dict[str, dict[str, Any]]) -> None:
    lock = orjson.loads((HERE / "node" / "package-lock.json").read_bytes())
    pinned = lock["packages"]["node_modules/@anthropic-ai/sdk"]["version"]
    assert check(node_checks, "versions")["sdk"] == pinned


@pytest.mark.parametrize(("model", "text", "upstream"), [
    ("claude-m", "Hello!", "claude/claude-sonnet-4-5"),
    ("sim-m", "lorem ipsum dolor sit amet ", "sim/sim-small")])
def test_the_node_sdk_gets_json_from_both_kinds(node_checks: dict[str, dict[str, Any]],
                                                model: str, text: str, upstream: str) -> None:
    seen = check(node_checks, f"json {model}")
    assert (seen["type"], seen["role"], seen["text"]) == ("message", "assistant", text)
    assert (seen["tier"], seen["upstream"]) == ("low", upstream)
    assert seen["usage"]["output_tokens"] in (3, 5)
    assert seen["request_id"].startswith("req_")  # the SDK's _request_id: request-id


@pytest.mark.parametrize("model", ["claude-m", "sim-m"])
def test_the_node_sdk_streams_from_both_kinds(node_checks: dict[str, dict[str, Any]],
                                              model: str) -> None:
    seen = check(node_checks, f"stream {model}")
    assert (seen["first"], seen["last"]) == ("message_start", "message_stop")
    assert seen["text"] and seen["output_tokens"] > 0


def test_the_node_sdk_gets_a_claude_tool_call(node_checks: dict[str, dict[str, Any]]) -> None:
    seen = check(node_checks, "tools claude-m")
    assert seen == {"stop_reason": "tool_use", "blocks": ["text", "tool_use"]}
    # The simulated provider answers in words, never with a tool call.
    assert check(node_checks, "tools sim-m")["blocks"] == ["text"]


def test_the_node_sdk_counts_tokens_and_reads_errors(
        node_checks: dict[str, dict[str, Any]]) -> None:
    assert check(node_checks, "count_tokens")["input_tokens"] > 0
    seen = check(node_checks, "error")
    assert seen["thrown"] and seen["name"] == "NotFoundError" and seen["status"] == 404
    assert seen["type"] == "not_found_error" and seen["request_id"].startswith("req_")


# --- Claude Code ------------------------------------------------------------------------------

def claude_or_skip() -> Path:
    if not CLAUDE.exists():
        pytest.skip(f"Claude Code is not in {CLAUDE.parents[1]}: "
                    "`npm ci --prefix tests/claude` installs it (.ci/run does)")
    return CLAUDE


@pytest.mark.parametrize(("model", "answer"), [
    ("claude-m", "Hello!"),
    ("sim-m", "lorem ipsum dolor sit amet consectetur adipiscing elit")])  # its 8 at most
def test_claude_code_gets_its_answer_through_the_proxy(served: Served, tmp_path: Path,
                                                       model: str, answer: str) -> None:
    claude = claude_or_skip()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}, **QUIET,
           "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": served.base,
           "ANTHROPIC_API_KEY": "agents-key"}
    seen_before = len(served.fake.seen)
    done = subprocess.run([str(claude), "-p", "Say hello", "--model", model],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert done.stdout.strip().endswith(answer), done.stdout[-500:]
    if model == "claude-m":
        calls = served.fake.seen[seen_before:]
        assert calls and all(c.headers["x-api-key"] == KEY for c in calls)
        assert {c.body["model"] for c in calls} == {"claude-sonnet-4-5"}
