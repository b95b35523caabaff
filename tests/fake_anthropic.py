"""A fake of Anthropic's Messages API for the tests to start on 127.0.0.1: it answers as
Anthropic's docs show (a whole ``message``, or ``message_start`` … ``message_stop`` with a
``ping``), checks its key and version headers as Anthropic does, and checks every request
body against Anthropic's own spec (``problems``: what the proxy sent that it should not)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from .fakes import Seen
from .vendor_specs import problems

KEY = "sk-ant-provider"
# Every field Anthropic's spec requires, as its API answers today (null where unknown).
USAGE = {"input_tokens": 12, "output_tokens": 3, "cache_read_input_tokens": 4,
         "cache_creation_input_tokens": 2, "cache_creation": None, "inference_geo": None,
         "output_tokens_details": None, "server_tool_use": None, "service_tier": "standard"}
DELTA_USAGE = {key: USAGE[key] for key in (
    "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
    "output_tokens_details", "server_tool_use")}
TOOL_USE = {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9",
            "name": "get_weather", "input": {"location": "Paris"}, "caller": {"type": "direct"}}
TEXT = {"type": "text", "text": "", "citations": None}


def frame(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message},
            "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy"}


@dataclass
class FakeAnthropic:
    """Behaviour per call from ``script`` (then ``default``): ok | tool | 529 | 429 | 400 |
    500 | stream_error | cut | garbage (an ``ok`` call offered ``get_weather`` calls it).
    ``hold_s``: time before answering."""

    default: str = "ok"
    script: deque[str] = field(default_factory=deque)
    words: list[str] = field(default_factory=lambda: ["Hel", "lo", "!"])
    hold_s: float = 0.0
    reply_headers: dict[str, str] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)  # each answer's bytes, as written

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        return app

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        self.seen.append(Seen(dict(request.headers), body, dict(request.query)))
        self.problems += problems("anthropic", "CreateMessageParams", body)
        if request.headers.get("x-api-key") != KEY:
            return web.json_response(error_body("authentication_error", "invalid x-api-key"),
                                     status=401)
        if "anthropic-version" not in request.headers:
            return web.json_response(error_body(
                "invalid_request_error", "anthropic-version: header is required"), status=400)
        mode = self.script.popleft() if self.script else self.default
        if mode == "ok" and any(isinstance(tool, dict) and tool.get("name") == "get_weather"
                                for tool in body.get("tools") or []):
            mode = "tool"
        if self.hold_s:
            await asyncio.sleep(self.hold_s)
        statuses = {"529": ("overloaded_error", "Overloaded"),
                    "429": ("rate_limit_error", "Number of requests has exceeded your rate limit"),
                    "400": ("invalid_request_error", "messages: at least one message is required"),
                    "500": ("api_error", "Internal server error")}
        if mode in statuses:
            kind, message = statuses[mode]
            headers = {"retry-after": "1"} if mode == "429" else {}
            return web.json_response(error_body(kind, message), status=int(mode),
                                     headers={**headers, "request-id": "req_upstream"})
        if mode == "garbage":
            return web.Response(body=b"<html>oops</html>", content_type="application/json")
        model = body["model"]
        text = "".join(self.words)
        headers = {"request-id": "req_upstream", **self.reply_headers}
        if not body.get("stream"):
            content = [{**TEXT, "text": text}]
            if mode == "tool":
                content.append(TOOL_USE)
            answer = {"id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message",
                      "role": "assistant", "model": model, "content": content,
                      "stop_reason": "tool_use" if mode == "tool" else "end_turn",
                      "stop_sequence": None, "stop_details": None, "container": None,
                      "usage": USAGE}
            data = orjson.dumps(answer)
            self.sent.append(data)
            return web.Response(body=data, content_type="application/json", headers=headers)
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                     **headers})
        await response.prepare(request)
        events = self._stream(model, mode)
        self.sent.append(b"".join(events))
        for i, event in enumerate(events):
            if mode == "cut" and i == 4:
                assert request.transport is not None
                request.transport.abort()
                return response
            await response.write(event)
        await response.write_eof()
        return response

    def _stream(self, model: str, mode: str) -> list[bytes]:
        start = {"id": "msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY", "type": "message",
                 "role": "assistant", "content": [], "model": model, "stop_reason": None,
                 "stop_sequence": None, "stop_details": None, "container": None,
                 "usage": {**USAGE, "output_tokens": 1}}
        events = [frame("message_start", {"type": "message_start", "message": start}),
                  frame("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": TEXT}),
                  frame("ping", {"type": "ping"})]
        for word in self.words:
            events.append(frame("content_block_delta", {
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": word}}))
            if mode == "stream_error":
                events.append(frame("error", error_body("overloaded_error", "Overloaded")))
                return events
        events.append(frame("content_block_stop", {"type": "content_block_stop", "index": 0}))
        if mode == "tool":
            events.append(frame("content_block_start", {
                "type": "content_block_start", "index": 1,
                "content_block": {**TOOL_USE, "input": {}}}))
            for piece in ('{"location', '": "Paris"}'):
                events.append(frame("content_block_delta", {
                    "type": "content_block_delta", "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": piece}}))
            events.append(frame("content_block_stop",
                                {"type": "content_block_stop", "index": 1}))
        events.append(frame("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use" if mode == "tool" else "end_turn",
                      "stop_sequence": None, "stop_details": None, "container": None},
            "usage": {**DELTA_USAGE, "output_tokens": len(self.words)}}))
        events.append(frame("message_stop", {"type": "message_stop"}))
        return events
