"""An in-process provider that answers like OpenAI, for trying the proxy with no keys,
for tests and for benchmarks.

Service time: ``ttft_s`` (+ prompt tokens / ``prefill_tokens_per_s``) to the first token,
then one token every ``1 / tokens_per_s``: ``ttft + n / tokens_per_s`` in all for ``n``
tokens, streamed or whole, as the simulator (``proxy.sim.servers``) counts it. Output length is
``max_tokens`` (or ``max_completion_tokens``, ``max_output_tokens``), else
``default_output_tokens``, at most ``max_output_tokens`` (finished for ``length`` where it
is the call's own limit, else ``stop``); answers come in the shape of the API called
(``sim_answers``); a stream is generated as it goes, so memory stays bounded.
With ``capacity`` set it answers 429 past that many concurrent calls, like a real
provider's concurrency limit. With ``slots`` set it is a self-hosted server instead: past
that many calls running, the next wait inside it, first come first served; with
``slows_past``, past that many running each call's tokens come slower in proportion (its
pace set as each batch of tokens starts). ``figures`` says what it runs and what waits in
it, as a self-hosted server's own pages do (``engine``).
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import random
import struct
import zlib
from collections.abc import AsyncIterator, Mapping

import orjson

from ...core.health.engines import Figures
from ...core.health.provider import SimSettings, Timeouts
from .sim_answers import ANSWERS, Answer
from .upstream import UpstreamRequest

_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")
_CHUNK_BATCH_S = 0.005  # below this pace, emit several tokens per await (keeps fast sims cheap)


class SimulatedUpstream:
    def __init__(self, name: str, settings: SimSettings) -> None:
        self.name = name
        self.settings = settings
        self.active = 0
        self.calls = 0
        self.waiting = 0  # calls waiting inside for one of its ``slots``
        self._rng = random.Random(settings.seed)
        self._slots = (asyncio.Semaphore(settings.slots) if settings.slots is not None
                       else None)

    def figures(self, engine: str) -> Figures:
        """What it runs and what waits in it, as ``engine``'s pages would say."""
        return self.settings.figures(engine, self.active - self.waiting, self.waiting)

    def pace(self) -> float:
        """How many times slower than ``tokens_per_s`` it generates now (``slows_past``)."""
        return self.settings.pace(self.active - self.waiting)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of its ``slots`` (at once without them), waited for inside."""
        slots = self._slots
        if slots is None:
            yield
            return
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            slots.release()

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
            return _embedding_response(request.model, body.get("input"),
                                       body.get("encoding_format") == "base64")
        shape = ANSWERS.get(request.path)
        if shape is None:
            return _error_response(404, "not_found", f"no {request.path} here")
        asked = (body.get("max_completion_tokens") or body.get("max_tokens")
                 or body.get("max_output_tokens"))
        n_out = asked if isinstance(asked, int) and asked > 0 else s.default_output_tokens
        n_out = min(n_out, s.max_output_tokens)
        include_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )
        prompt_tokens = _prompt_tokens(body)
        ttft = s.ttft_s + (prompt_tokens / s.prefill_tokens_per_s if s.prefill_tokens_per_s else 0)
        finish = "length" if n_out == asked else "stop"  # at the call's own limit, or done
        return SimulatedResponse(self, shape(request.model, n_out, prompt_tokens, finish),
                                 ttft, request.stream, include_usage)

    async def close(self) -> None:
        return None


def _prompt_tokens(body: dict[str, object]) -> int:
    """About four characters a token, of whatever the API calls its prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    else:
        chars = len(str(body.get("prompt") or "")) + len(str(body.get("input") or "")) + len(
            str(body.get("instructions") or ""))
    return -(-chars // 4)


def _embedding_response(model: str, given: object, base64: bool) -> SimulatedResponse:
    """Deterministic 8-dimensional vectors, one per input; with ``encoding_format:
    base64``, as OpenAI sends them then: the little-endian float32 bytes in base64. As in
    OpenAI's API, a list of integers is one input given as tokens, a list of lists several."""
    tokens_of_one = isinstance(given, list) and bool(given) and all(
        isinstance(token, int) for token in given)
    inputs: list[object] = given if isinstance(given, list) and not tokens_of_one else [given]
    vectors = [[((zlib.crc32(str(text).encode()) >> (4 * d)) % 1000) / 1000 for d in range(8)]
               for text in inputs]
    data = [{"object": "embedding", "index": i,
             "embedding": (binascii.b2a_base64(struct.pack("<8f", *vector), newline=False)
                           .decode("ascii") if base64 else vector)}
            for i, vector in enumerate(vectors)]
    tokens = sum(len(text) if isinstance(text, list) else -(-len(str(text)) // 4)
                 for text in inputs)
    body = orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    return SimulatedResponse(None, None, 0.0, False, False, status=200, body=body)


def _error_response(status: int, code: str, message: str) -> SimulatedResponse:
    body = orjson.dumps({"error": {"message": message, "type": code, "param": None, "code": code}})
    return SimulatedResponse(None, None, 0.0, False, False, status=status, body=body)


class SimulatedResponse:
    def __init__(
        self,
        upstream: SimulatedUpstream | None,
        answer: Answer | None,
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
        self._upstream = upstream
        self._answer = answer
        self._ttft_s = ttft_s
        self._include_usage = include_usage
        self._body = body
        self._closed = False
        self.ended = False
        if upstream is not None:
            upstream.active += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._upstream is not None:
                self._upstream.active -= 1

    def _words(self, start: int, stop: int) -> list[str]:
        n_out = self._answer.n_out if self._answer else 0
        return [_WORDS[i % len(_WORDS)] + " " for i in range(start, min(stop, n_out))]

    async def read(self) -> bytes:
        try:
            if self._upstream is None or self._answer is None:
                return self._body
            upstream = self._upstream
            n_out = self._answer.n_out
            async with upstream.slot():
                await asyncio.sleep(self._ttft_s + n_out * upstream.pace()
                                    / upstream.settings.tokens_per_s)
            return self._answer.whole("".join(self._words(0, n_out)))
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self._upstream is None or self._answer is None:
                self.ended = True
                yield self._body
                return
            answer, upstream = self._answer, self._upstream
            loop = asyncio.get_running_loop()
            async with upstream.slot():
                # Token i is due ttft + i / tokens_per_s after the start (slower while the
                # server is past ``slows_past``), the end one token after the last: each
                # wait is to a due time, so a timer's slack (a millisecond under uvloop) is
                # not added up over a long answer.
                due = loop.time() + self._ttft_s
                await asyncio.sleep(self._ttft_s)
                opening = answer.opening()
                if opening:
                    yield opening
                per_token = 1.0 / upstream.settings.tokens_per_s
                batch = max(1, int(_CHUNK_BATCH_S / per_token))
                for start in range(0, answer.n_out, batch):
                    await _until(loop, due)
                    yield answer.pieces(self._words(start, start + batch))
                    due += min(batch, answer.n_out - start) * per_token * upstream.pace()
                await _until(loop, due)
            text = "".join(self._words(0, answer.n_out)) if answer.repeats_text else ""
            self.ended = True
            yield answer.closing(text, self._include_usage)
        finally:
            self.close()


async def _until(loop: asyncio.AbstractEventLoop, due: float) -> None:
    delay = due - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
