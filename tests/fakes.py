"""A fake OpenAI-compatible upstream the tests start on 127.0.0.1, with scripted faults."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from proxy.http.upstream.sim_answers import ANSWERS


class Sink(asyncio.Transport):
    """A transport that keeps what is written to it; closing once told."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.data += data

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.data += chunk

    def is_closing(self) -> bool:
        return self.closing


def aiohttp_request(keep_alive: bool) -> tuple[web.Request, Sink]:
    """A request as aiohttp's server makes it, whose answer's bytes land in the Sink."""
    loop = asyncio.get_running_loop()
    protocol = BaseProtocol(loop)
    sink = Sink()
    protocol.transport = sink
    request = make_mocked_request("POST", "/v1/chat/completions", closing=not keep_alive,
                                  writer=StreamWriter(protocol, loop))
    return request, sink


def completion(model: str, text: str = "Hello there!") -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def sse_events(model: str, words: list[str], usage: bool) -> list[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000,
            "model": model}
    events = [event({**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""},
                                          "finish_reason": None}]})]
    events += [event({**base, "choices": [{"index": 0, "delta": {"content": w},
                                           "finish_reason": None}]}) for w in words]
    events.append(event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if usage:
        events.append(event({**base, "choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": len(words),
            "total_tokens": 5 + len(words)}}))
    events.append(b"data: [DONE]\n\n")
    return events


TOOL_CALL = {"id": "call_abc123", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}


def tool_events(events: list[bytes]) -> list[bytes]:
    """``sse_events`` whose answer calls ``TOOL_CALL`` after its text (its arguments in two
    pieces) and finishes for it."""
    head = orjson.loads(events[0][6:])
    head.pop("choices")
    function = TOOL_CALL["function"]
    assert isinstance(function, dict)
    pieces = [{"index": 0, "id": TOOL_CALL["id"], "type": "function",
               "function": {"name": function["name"], "arguments": ""}},
              {"index": 0, "function": {"arguments": '{"location": '}},
              {"index": 0, "function": {"arguments": '"Paris"}'}}]
    calls = [b"data: " + orjson.dumps({**head, "choices": [
        {"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]}) + b"\n\n"
             for piece in pieces]
    calls.append(b"data: " + orjson.dumps({**head, "choices": [
        {"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}) + b"\n\n")
    stop = next(i for i, e in enumerate(events) if b'"finish_reason":"stop"' in e)
    return [*events[:stop], *calls, *events[stop + 1:]]


@dataclass
class Seen:
    headers: dict[str, str]
    body: dict[str, Any]
    query: dict[str, str]


@dataclass
class FakeUpstream:
    """Behaviour per call comes from ``script`` (then ``default``):
    ok | tool | 500 | 429 | flex_429 | 400 | 401 | stall | cut | half | early_end | slow |
    flood (tool: the answer calls ``get_weather`` after its text). With
    ``capacity`` set, a call past that many at once is answered 429 whatever the script
    says, like a provider whose real limit is lower than the proxy was told."""

    default: str = "ok"
    script: deque[str] = field(default_factory=deque)
    words: list[str] = field(default_factory=lambda: ["Hello", " there", "!"])
    chunk_delay_s: float = 0.0
    hold_s: float = 0.0  # non-streaming: time before answering
    capacity: int | None = None
    retry_after_ms: str = "50"
    usage: dict[str, Any] | None = None  # reported instead of the default usage
    served_tier: str | None = None  # the service_tier a plain answer reports
    reply_headers: dict[str, str] = field(default_factory=dict)
    raw_stream: list[bytes] | None = None  # streamed exactly, chunk by chunk, instead
    seen: list[Seen] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # ids of completions and responses
    active: int = 0
    peak: int = 0
    cancelled: int = 0
    completed: int = 0
    throttled: int = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/completions", self.shaped)
        app.router.add_post("/v1/responses", self.shaped)
        return app

    async def shaped(self, request: web.Request) -> web.StreamResponse:
        """Completions and Responses, in the simulated provider's shapes; ``ok`` or the
        error modes."""
        body = await request.json(loads=orjson.loads)  # fast: the proxy shares its loop
        self.seen.append(Seen(dict(request.headers), body, dict(request.query)))
        mode = self.script.popleft() if self.script else self.default
        if mode in ("500", "400", "429", "401") or (self.raw_stream and body.get("stream")):
            return await self._respond(request, body, mode)
        answer = ANSWERS[request.path.removeprefix("/v1")](body["model"], len(self.words), 5)
        self.answers.append(answer.id)
        text = "".join(self.words)
        self.completed += 1
        if not body.get("stream"):
            return web.Response(body=answer.whole(text), content_type="application/json",
                                headers=self.reply_headers)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await response.write(answer.opening() + answer.pieces(self.words))
        await response.write(answer.closing(text, usage))
        await response.write_eof()
        return response

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json(loads=orjson.loads)  # fast: the proxy shares its loop
        self.seen.append(Seen(dict(request.headers), body, dict(request.query)))
        return web.json_response({"object": "list", "model": body["model"], "data": [
            {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)  # fast: the proxy shares its loop
        self.seen.append(Seen(dict(request.headers), body, dict(request.query)))
        mode = self.script.popleft() if self.script else self.default
        if self.capacity is not None and self.active >= self.capacity:
            mode = "429"
        if mode == "429":
            self.throttled += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self._respond(request, body, mode)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _respond(
        self, request: web.Request, body: dict[str, Any], mode: str
    ) -> web.StreamResponse:
        model = body["model"]
        if mode in ("500", "400"):
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            return web.json_response(
                {"error": {"message": f"fake {mode}", "type": "x", "param": None,
                           "code": f"fake_{mode}"}}, status=int(mode))
        if mode == "429":
            return web.json_response(
                {"error": {"message": "slow down", "type": "rate_limit", "param": None,
                           "code": "rate_limit_exceeded"}},
                status=429, headers={"retry-after-ms": self.retry_after_ms})
        if mode == "flex_429":  # OpenAI's flex tier has no room just now
            return web.json_response(
                {"error": {"message": "Resource unavailable, please try again later.",
                           "type": "server_error", "param": None,
                           "code": "resource_unavailable"}}, status=429)
        if mode == "401":
            return web.json_response(
                {"error": {"message": "Incorrect API key provided: sk-prov***ider",
                           "type": "invalid_request_error", "param": None,
                           "code": "invalid_api_key"}}, status=401)
        if mode == "stall":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            self.completed += 1
            answer = completion(model)
            if mode == "tool":
                answer["choices"][0]["message"]["tool_calls"] = [TOOL_CALL]
                answer["choices"][0]["finish_reason"] = "tool_calls"
            if self.usage is not None:
                answer["usage"] = self.usage
            if self.served_tier is not None:
                answer["service_tier"] = self.served_tier
            return web.json_response(answer, headers={
                "set-cookie": "a=b", "x-upstream-extra": "1", "connection": "keep-alive, x-hop",
                "x-hop": "private", **self.reply_headers})
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", **self.reply_headers})
        await response.prepare(request)
        if self.raw_stream is not None:
            for chunk in self.raw_stream:
                await response.write(chunk)
                await asyncio.sleep(0.005)  # one read per chunk on the proxy's side
            if mode == "cut":
                assert request.transport is not None
                request.transport.abort()
                return response
            await response.write_eof()
            self.completed += 1
            return response
        if mode == "flood":  # far more than socket buffers hold, as fast as it can
            padding = "x" * 100_000
            for _ in range(500):
                await response.write(sse_events(model, [padding], usage=False)[1])
        events = sse_events(model, self.words, usage)
        if mode == "tool":
            events = tool_events(events)
        for i, event in enumerate(events):
            if mode == "early_end" and i == 2:  # a clean close, but no [DONE]
                await response.write_eof()
                return response
            if mode == "half" and i == 2:  # half an event, then the connection dies
                await response.write(event[: len(event) // 2])
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return response
            if mode == "cut" and i == 2:
                assert request.transport is not None
                request.transport.abort()
                return response
            if mode == "slow" and i >= 1:
                await asyncio.sleep(3600)
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            await response.write(event)
        await response.write_eof()
        self.completed += 1
        return response
