"""The Node ``openai`` SDK against the real ``serve``: ``tests/node/clients.mjs`` runs each
check once (chat, a stream with usage, tools, embeddings in the SDK's default base64,
Responses, a background response, the Batch API, a 429 with ``retry-after``) and prints
what the SDK gave back, one JSON line a check; each test here asserts on one of them.

The package is pinned in ``tests/node/package.json`` and its lock; ``.ci/run`` installs it
into ``tests/node/node_modules`` (not committed) with ``npm ci``. Without ``node`` or the
package the tests skip, saying why."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from .serving import serving

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "clients.mjs"
INSTALLED = NODE_DIR / "node_modules" / "openai" / "package.json"
INSTALL = "npm ci --prefix tests/node"
CONFIG = """
classify:
  keys:
    - {name: app, key: app-key}
    - {name: limited, key: limited-key, rpm: 1}
providers:
  - name: sim
    kind: simulated
    max_concurrency: 4
    simulate: {ttft_s: 0.01, tokens_per_s: 500}
models:
  m: [{provider: sim, model: sim-small}]
batch: {max_in_flight: 4}
storage: {path: work.db}
"""
# What the simulated provider writes: its words in turn, one a token.
FIVE_WORDS = "lorem ipsum dolor sit amet "


def pinned() -> str:
    lock = orjson.loads((NODE_DIR / "package-lock.json").read_bytes())
    return str(lock["packages"]["node_modules/openai"]["version"])


def node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH: the Node SDK's checks need Node.js 20 or later, "
                    f"then `{INSTALL}` for the package")
    version = subprocess.run([node, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
    if int(version.removeprefix("v").split(".")[0]) < 20:
        pytest.skip(f"node {version} is older than the openai package needs (20)")
    if not INSTALLED.exists():
        pytest.skip(f"the Node openai package is not in {INSTALLED.parent.parent}: "
                    f"`{INSTALL}` installs it (.ci/run does)")
    return node


async def run_clients(node: str, config: Path) -> dict[str, dict[str, Any]]:
    async with serving(config) as (base, _):
        process = await asyncio.create_subprocess_exec(
            node, str(SCRIPT), base, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(process.communicate(), 90)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, err.decode()
    lines = [orjson.loads(line) for line in out.splitlines()]
    return {line.pop("check"): line for line in lines}


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    node = node_or_skip()
    config = tmp_path_factory.mktemp("node") / "routing.yaml"
    config.write_text(CONFIG)
    return asyncio.run(run_clients(node, config))


def check(checks: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    assert name in checks, f"clients.mjs printed no line for {name!r}: {sorted(checks)}"
    seen = checks[name]
    assert "error" not in seen, f"{name}: {seen['error']}"
    return seen


def test_the_versions_run_are_the_pinned_ones(checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "versions")
    assert seen["openai"] == pinned(), f"installed {seen['openai']}: run `{INSTALL}`"
    assert int(seen["node"].removeprefix("v").split(".")[0]) >= 20


def test_chat_completion_as_json(checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "chat")
    assert seen["object"] == "chat.completion" and seen["role"] == "assistant"
    assert seen["content"] == FIVE_WORDS and seen["finish_reason"] == "length"
    assert seen["usage"]["completion_tokens"] == 5
    assert seen["usage"]["total_tokens"] == seen["usage"]["prompt_tokens"] + 5
    assert seen["request_id"].startswith("req_")  # the SDK's _request_id: x-request-id
    assert (seen["tier"], seen["upstream"]) == ("normal", "sim/sim-small")


def test_a_stream_with_include_usage_ends_with_the_usage(
        checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "stream")
    assert seen["text"] == FIVE_WORDS and seen["finish_reasons"] == ["length"]
    assert seen["usage"]["completion_tokens"] == 5
    # As OpenAI sends it: the usage alone in a last chunk with no choices.
    assert seen["last_choices"] == 0 and seen["usage_only_on_last"]


def test_a_call_with_tools_is_parsed_plain_and_streamed(
        checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "tools")
    assert seen["tools_sent"] == ["get_weather"]
    # The simulated provider answers in words, never with a tool call.
    assert seen["object"] == "chat.completion" and seen["role"] == "assistant"
    assert seen["content"] == FIVE_WORDS and seen["tool_calls"] is None
    assert seen["streamed"] == FIVE_WORDS  # the SDK's stream helper put it back together


def test_embeddings_in_the_sdks_default_base64_are_the_floats(
        checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "embeddings")
    assert seen["default_encoding_sent"] == "base64"
    decoded, floats = seen["default"], seen["float"]
    assert len(decoded) == len(floats) == 2
    assert all(len(vector) == 8 for vector in decoded + floats)
    for got, given in zip(decoded, floats, strict=True):
        assert got == pytest.approx(given, abs=1e-6)  # float32 on the wire
    assert decoded[0] != decoded[1]
    assert seen["usage"]["prompt_tokens"] > 0


def test_responses_whole_and_streamed(checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "responses")
    assert (seen["object"], seen["status"]) == ("response", "completed")
    assert seen["id"].startswith("resp_")
    assert seen["output_text"] == seen["streamed"] == seen["final_text"] == FIVE_WORDS
    assert seen["usage"]["output_tokens"] == 5 and seen["final_status"] == "completed"
    assert seen["events"][0] == "response.created"
    assert seen["events"][-1] == "response.completed"
    assert "response.output_text.delta" in seen["events"]


def test_a_background_response_is_retrieved_once_done(
        checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "background")
    assert (seen["first_status"], seen["background"]) == ("queued", True)
    assert seen["status"] == "completed" and seen["same_id"]
    assert seen["output_text"] == FIVE_WORDS and seen["usage"]["output_tokens"] == 5


def test_a_batch_answers_each_custom_id_once(checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "batch")
    assert seen["file"]["object"] == "file" and seen["file"]["purpose"] == "batch"
    assert seen["file"]["bytes"] > 0
    assert seen["status"] == "completed", seen
    assert seen["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert sorted(seen["custom_ids"]) == ["c0", "c1", "c2", "c3", "c4"]  # each once
    assert seen["status_codes"] == [200] * 5
    assert seen["contents"] == ["lorem ipsum dolor "] * 5  # max_tokens: 3
    assert seen["error_file_id"] is None


def test_a_key_over_its_rpm_is_a_429_with_retry_after(
        checks: dict[str, dict[str, Any]]) -> None:
    seen = check(checks, "rate_limit")
    assert seen["first"] == "chat.completion"
    assert seen.get("api_error"), f"the second call in the minute was answered: {seen}"
    assert seen["rate_limit_error"] and seen["status"] == 429
    assert (seen["code"], seen["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert 0 < int(seen["retry_after"]) <= 60
    assert seen["request_id"].startswith("req_")
