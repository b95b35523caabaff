"""An in-process provider that answers like OpenAI, for trying the proxy with no keys,
for tests and for benchmarks.

Service time: ``ttft_s`` (+ prompt tokens / ``prefill_tokens_per_s``) to the first token,
then one token every ``1 / tokens_per_s``. Output length is ``max_tokens`` (or
``max_completion_tokens``), else ``default_output_tokens``, at most ``max_output_tokens``;
a stream is generated as it goes, so memory stays bounded. With ``capacity`` set it answers
429 past that many concurrent calls, like a real provider's concurrency limit.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import AsyncIterator, Mapping

import orjson

from ..core.provider import SimSettings, Timeouts
from .upstream import UpstreamRequest

_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
_CHUNK_BATCH_S = 0.005  # below this pace, emit several tokens per await (keeps fast sims cheap)


class SimulatedUpstream:
    def __init__(self, name: str, settings: SimSettings) -> None:
        self.name = name
        self.settings = settings
        self.active = 0
        self.calls = 0
        self._rng = random.Random(settings.seed)

    async def send(self, request: UpstreamRequest, timeouts: Timeouts) -> SimulatedResponse:
        self.calls += 1
        s = self.settings
        if s.capacity is not None and self.active >= s.capacity:
            return _error_response(429, "rate_limit_exceeded", "simulated concurrency limit")
        if s.error_rate and self._rng.random() < s.error_rate:
            return _error_response(500, "server_error", "simulated failure")
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            return _error_response(400, "invalid_request", "body is not JSON")
        if not isinstance(body, dict):
            return _error_response(400, "invalid_request", "body must be an object")
        if request.path == "/embeddings":
            return _embedding_response(request.model, body.get("input"))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        n_out = limit if isinstance(limit, int) and limit > 0 else s.default_output_tokens
        n_out = min(n_out, s.max_output_tokens)
        include_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )
        prompt_tokens = _prompt_tokens(body.get("messages"))
        ttft = s.ttft_s + (prompt_tokens / s.prefill_tokens_per_s if s.prefill_tokens_per_s else 0)
        return SimulatedResponse(
            self, request.model, n_out, prompt_tokens, ttft, request.stream, include_usage
        )

    async def close(self) -> None:
        return None


def _prompt_tokens(messages: object) -> int:
    if not isinstance(messages, list):
        return 0
    chars = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    return -(-chars // 4)


def _embedding_response(model: str, given: object) -> SimulatedResponse:
    """Deterministic 8-dimensional vectors, one per input."""
    inputs = given if isinstance(given, list) else [given]
    data = [
        {"object": "embedding", "index": i,
         "embedding": [((zlib.crc32(str(text).encode()) >> (4 * d)) % 1000) / 1000
                       for d in range(8)]}
        for i, text in enumerate(inputs)
    ]
    tokens = sum(-(-len(str(text)) // 4) for text in inputs)
    body = orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    return SimulatedResponse(None, "", 0, 0, 0.0, False, False, status=200, body=body)


def _error_response(status: int, code: str, message: str) -> SimulatedResponse:
    body = orjson.dumps({"error": {"message": message, "type": code, "param": None, "code": code}})
    return SimulatedResponse(None, "", 0, 0, 0.0, False, False, status=status, body=body)


class SimulatedResponse:
    def __init__(
        self,
        owner: SimulatedUpstream | None,
        model: str,
        n_out: int,
        prompt_tokens: int,
        ttft_s: float,
        stream: bool,
        include_usage: bool,
        *,
        status: int = 200,
        body: bytes = b"",
    ) -> None:
        self.status = status
        content_type = "text/event-stream" if stream and status == 200 else "application/json"
        self.headers: Mapping[str, str] = {"content-type": content_type}
        self._owner = owner
        self._model = model
        self._n_out = n_out
        self._prompt_tokens = prompt_tokens
        self._ttft_s = ttft_s
        self._include_usage = include_usage
        self._body = body
        self._id = f"chatcmpl-sim{time.monotonic_ns():x}"
        self._created = int(time.time())
        self._closed = False
        if owner is not None:
            owner.active += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owner is not None:
                self._owner.active -= 1

    def _words(self, start: int, stop: int) -> list[str]:
        return [_WORDS[i % len(_WORDS)] + " " for i in range(start, min(stop, self._n_out))]

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": self._n_out,
            "total_tokens": self._prompt_tokens + self._n_out,
        }

    async def read(self) -> bytes:
        try:
            if self._owner is None:
                return self._body
            await asyncio.sleep(self._ttft_s + self._n_out / self._owner.settings.tokens_per_s)
            return orjson.dumps({
                "id": self._id,
                "object": "chat.completion",
                "created": self._created,
                "model": self._model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant",
                                "content": "".join(self._words(0, self._n_out))},
                    "logprobs": None,
                    "finish_reason": "length",
                }],
                "usage": self._usage(),
            })
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self._owner is None:
                yield self._body
                return
            await asyncio.sleep(self._ttft_s)
            yield self._event({"role": "assistant", "content": ""}, None)
            per_token = 1.0 / self._owner.settings.tokens_per_s
            batch = max(1, int(_CHUNK_BATCH_S / per_token))
            for start in range(0, self._n_out, batch):
                part = self._words(start, start + batch)
                if start:
                    await asyncio.sleep(per_token * len(part))
                yield b"".join(self._event({"content": w}, None) for w in part)
            tail = self._event({}, "length")
            if self._include_usage:
                tail += self._event(None, None, usage=self._usage())
            yield tail + b"data: [DONE]\n\n"
        finally:
            self.close()

    def _event(
        self, delta: dict[str, str] | None, finish: str | None, usage: dict[str, int] | None = None
    ) -> bytes:
        chunk: dict[str, object] = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            ],
        }
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + orjson.dumps(chunk) + b"\n\n"
