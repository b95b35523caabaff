"""The edge for request bodies (pure): every check a client's JSON passes before the proxy
acts on it, each bounded in the work it costs, each failing as a 400, never a 500.

Unknown fields are kept untouched. The order matters for the cost: the byte-level scan
refuses a body with too many arrays and objects before it is parsed (a 4 MiB body of a
million empty objects costs milliseconds, not seconds), parsing is then bounded by the
size and that count, and depth is checked on the brackets alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ..call.tokens import TokenCounter
from ..errors import InvalidRequest

Kind = Literal["chat", "completions", "responses", "embeddings", "messages"]
MAX_MODEL_NAME = 256
MAX_CHOICES = 128  # OpenAI's own limit on ``n``
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class BodyLimits:
    max_depth: int = 64  # nesting of arrays and objects (orjson itself writes at most 254)
    max_containers: int = 100_000  # arrays and objects in one body
    exact_token_chars: int = 16_000  # longer prompts are estimated, not tokenized


@dataclass(slots=True)
class Call:
    body: dict[str, Any]
    kind: Kind
    model: str
    stream: bool
    max_tokens: int | None
    service_tier: str | None
    wants_usage: bool  # the client asked for stream_options.include_usage itself
    choices: int = 1  # ``n``: completions generated, each up to max_tokens
    prompt_tokens: int = 0
    last_user_message: str = ""
    previous_response_id: str | None = None  # responses: the answer this call continues
    background: bool = False  # chat, responses: stored, answered at once, run later

    @property
    def generates(self) -> bool:
        """The call produces output tokens (else it only reads its input)."""
        return self.kind != "embeddings"


def parse_call(raw: bytes, kind: Kind, limits: BodyLimits, counter: TokenCounter) -> Call:
    """The checked call, its prompt counted; raises InvalidRequest. Costs time in
    proportion to the body's size and its count of arrays and objects, both bounded."""
    body = _parse_object(raw, limits)
    model = _model(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    service_tier = body.get("service_tier")
    if service_tier is not None and not isinstance(service_tier, str):
        raise InvalidRequest("'service_tier' must be a string.", param="service_tier")
    call = Call(body, kind, model, stream, None, service_tier,
                bool(options and options.get("include_usage")))
    _READERS[kind](call, counter, limits.exact_token_chars)
    return call


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string.", param="model")
    if len(model) > MAX_MODEL_NAME:
        raise InvalidRequest(f"'model' is longer than {MAX_MODEL_NAME} characters.",
                             param="model")
    return model


def _messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body's ``messages``, a non-empty array of objects (Chat's and Anthropic's)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "'messages' is required and must be a non-empty array.", param="messages")
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequest("Each message must be an object.", param="messages")
    return messages


def _chat(call: Call, counter: TokenCounter, exact: int) -> None:
    messages = _messages_of(call.body)
    call.max_tokens = (_positive_int(call.body, "max_completion_tokens")
                       or _positive_int(call.body, "max_tokens"))
    call.choices = _positive_int(call.body, "n", MAX_CHOICES) or 1
    call.prompt_tokens = counter.count_messages(messages, exact)
    call.last_user_message = counter.last_user_message(messages)
    call.background = call.body.get("background") is True


def _completions(call: Call, counter: TokenCounter, exact: int) -> None:
    # OpenAI's spec: ``prompt`` is required but may be null (the model's own start of
    # text); ``max_tokens`` may be 0 (with ``echo``, the prompt's log probabilities).
    if "prompt" not in call.body:
        raise InvalidRequest("'prompt' is required.", param="prompt")
    prompt = call.body["prompt"]
    if prompt is None:
        prompt = ""
    elif not isinstance(prompt, str | list) or not prompt:
        raise InvalidRequest(
            "'prompt' must be a non-empty string or array, or null.", param="prompt")
    call.max_tokens = _positive_int(call.body, "max_tokens", minimum=0)
    call.choices = _positive_int(call.body, "n", MAX_CHOICES) or 1
    call.prompt_tokens = counter.count_input(prompt, exact)
    call.last_user_message = prompt if isinstance(prompt, str) else ""


def _responses(call: Call, counter: TokenCounter, exact: int) -> None:
    body = call.body
    value, instructions = body.get("input"), body.get("instructions")
    if value is not None and not isinstance(value, str | list):
        raise InvalidRequest("'input' must be a string or an array.", param="input")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string.", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or len(previous) > 256):
        raise InvalidRequest("'previous_response_id' must be a response id.",
                             param="previous_response_id")
    call.background = body.get("background") is True
    call.max_tokens = _positive_int(body, "max_output_tokens")
    call.previous_response_id = previous
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value or []
    if instructions:
        items = [{"role": "system", "content": instructions}, *items]
    call.prompt_tokens = counter.count_messages(items, exact) if items else 0
    call.last_user_message = counter.last_user_message(items)


def _embeddings(call: Call, counter: TokenCounter, exact: int) -> None:
    if call.stream:
        raise InvalidRequest("Embeddings cannot be streamed; leave 'stream' out.",
                             param="stream")
    value = call.body.get("input")
    if not isinstance(value, str | list) or not value:
        raise InvalidRequest(
            "'input' is required and must be a non-empty string or array.", param="input")
    call.prompt_tokens = counter.count_input(value, exact)


def _messages(call: Call, counter: TokenCounter, exact: int) -> None:
    """Anthropic's Messages API: ``max_tokens`` is required, as Anthropic requires it; its
    ``service_tier`` (``auto``, ``standard_only``) is Anthropic's own, not OpenAI's."""
    call.prompt_tokens, call.last_user_message = _message_prompt(call.body, counter, exact)
    call.max_tokens = _positive_int(call.body, "max_tokens")
    if call.max_tokens is None:
        raise InvalidRequest("'max_tokens' is required.", param="max_tokens")
    call.service_tier = None


def _message_prompt(body: dict[str, Any], counter: TokenCounter,
                    exact: int) -> tuple[int, str]:
    """A Messages request's prompt tokens (its system prompt, messages and tools) and its
    last user message."""
    messages, system, tools = _messages_of(body), body.get("system"), body.get("tools")
    if system is not None and not isinstance(system, str | list):
        raise InvalidRequest("'system' must be a string or an array of blocks.",
                             param="system")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array.", param="tools")
    items = [{"role": "system", "content": system}, *messages] if system else messages
    tokens = counter.count_messages(items, exact)
    if tools:
        tokens += counter.count_input(orjson.dumps(tools).decode(), exact)
    return tokens, counter.last_user_message(messages)


def count_message_tokens(raw: bytes, limits: BodyLimits, counter: TokenCounter
                         ) -> tuple[str, int]:
    """``POST /v1/messages/count_tokens``: the model named and the prompt's tokens, as
    the proxy counts them; raises InvalidRequest."""
    body = _parse_object(raw, limits)
    return _model(body), _message_prompt(body, counter, limits.exact_token_chars)[0]


_READERS: dict[str, Callable[[Call, TokenCounter, int], None]] = {
    "chat": _chat, "completions": _completions, "responses": _responses,
    "embeddings": _embeddings, "messages": _messages,
}


def _parse_object(raw: bytes, limits: BodyLimits) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    _check_shape(raw, limits)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return body


def _check_shape(raw: bytes, limits: BodyLimits) -> None:
    """Refuse too many or too deeply nested arrays and objects, looking only at the
    brackets outside strings, at C speed. A malformed text is left to the parser."""
    opened = raw.count(b"[") + raw.count(b"{")
    if opened <= limits.max_depth and opened <= limits.max_containers:
        return
    # Escapes first (``\\`` before ``\"``, as a parser reads them), then every other piece
    # between quotes is outside a string. UTF-8 never hides a quote or backslash byte.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(plain.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    containers = brackets.count(b"[") + brackets.count(b"{")
    if containers > limits.max_containers:
        raise InvalidRequest(
            f"The request body has {containers} JSON arrays and objects; "
            f"this proxy accepts at most {limits.max_containers}.")
    # Each pass removes the innermost pairs, and only those: what nests within the limit
    # is gone after it; a pair still left is nested deeper.
    for _ in range(limits.max_depth):
        if not brackets:
            return
        brackets = (brackets.replace(b"[]", b"\0").replace(b"{}", b"\0")
                    .replace(b"\0", b""))
    if b"[]" in brackets or b"{}" in brackets:
        raise InvalidRequest(
            f"The request body nests arrays and objects deeper than {limits.max_depth} levels.")


def _positive_int(body: dict[str, Any], name: str, maximum: int | None = None,
                  minimum: int = 1) -> int | None:
    """An integer field (JSON Schema's integer: ``100.0`` is one); None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise InvalidRequest(f"'{name}' must be {expected}.", param=name)
    if maximum is not None and value > maximum:
        raise InvalidRequest(f"'{name}' must be at most {maximum}.", param=name)
    return value
