"""Parsing and validating a client's JSON body (pure). Unknown fields are kept untouched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from .errors import InvalidRequest


@dataclass
class Call:
    body: dict[str, Any]
    chat: bool  # a chat completion (else embeddings)
    model: str
    stream: bool
    max_tokens: int | None
    service_tier: str | None
    wants_usage: bool  # the client asked for stream_options.include_usage itself


def parse_call(raw: bytes, *, chat: bool) -> Call:
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string.", param="model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                "'messages' is required and must be a non-empty array.", param="messages"
            )
        if not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest("Each message must be an object.", param="messages")
    elif not isinstance(body.get("input"), str | list) or not body["input"]:
        raise InvalidRequest(
            "'input' is required and must be a non-empty string or array.", param="input"
        )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    service_tier = body.get("service_tier")
    if service_tier is not None and not isinstance(service_tier, str):
        raise InvalidRequest("'service_tier' must be a string.", param="service_tier")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    return Call(body, chat, model, stream, max_tokens, service_tier, wants_usage)


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"'{name}' must be a positive integer.", param=name)
    return value
