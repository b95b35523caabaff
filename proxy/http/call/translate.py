"""A call sent in another wire format than the client's (``proxy.core.formats.wires``): its
body translated on the way out, and the answer on the way back — a whole JSON answer or
an error at once, a stream event by event (``Translating``, in ``relay``'s place of the
pass-through tally), never held whole.
"""

from __future__ import annotations

import time
from typing import Any

from ...core.formats import chat, messages
from ...core.formats.chat_to_messages import to_messages
from ...core.formats.events import End, Error, Event, Translation, Usage
from ...core.formats.messages_to_chat import to_chat
from ...core.formats.wires import MESSAGES_PATH
from .tally import event_data

CHAT_PATH = "/chat/completions"
MAX_NAMES = 1000  # characters of the fields a translation names in its answer's headers


def outgoing(body: dict[str, Any], direction: str) -> tuple[str, Translation]:
    """The upstream's path and the call's body in its format (the body already edited:
    model, service tier)."""
    if direction == "chat_to_messages":
        return MESSAGES_PATH, to_messages(body)
    return CHAT_PATH, to_chat(body)


def translation_headers(translation: Translation) -> dict[str, str]:
    """What a translated call's answer says of its request: the fields left out
    (``x-proxy-dropped``) and those only approximated (``x-proxy-approximated``)."""
    headers = {}
    for name, fields in (("x-proxy-dropped", translation.dropped),
                         ("x-proxy-approximated", translation.approximated)):
        if fields:
            headers[name] = ", ".join(fields)[:MAX_NAMES]
    return headers


def answer(direction: str, data: bytes, status: int, input_tokens: int,
           request_id: str) -> bytes:
    """A whole answer or error body of the upstream's, in the client's format; raises
    UpstreamBadResponse for a 2xx answer that is not one."""
    if direction == "chat_to_messages":
        if status >= 400:
            return chat.encode_error(messages.decode_error(status, data))
        return chat.encode_answer(messages.decode_answer(data), created=int(time.time()))
    if status >= 400:
        return messages.encode_error(chat.decode_error(status, data), request_id)
    return messages.encode_answer(chat.decode_answer(data), input_tokens=input_tokens)


def error_body(client_kind: str, status: int, message: str, code: str | None,
               request_id: str) -> bytes:
    """The proxy's own error body in the client's format (Anthropic's for Messages)."""
    error = Error(status, message, code)
    if client_kind == "messages":
        return messages.encode_error(error, request_id)
    return chat.encode_error(error)


class Translating:
    """A stream in the upstream's format relayed in the client's, event by event: what
    ``relay`` asks of its tally (``feed``, ``finish``, ``done``, ``usage`` …). With
    ``keep_bytes``, the client's events' data is kept (``kept``) for the response cache,
    as a pass-through tally keeps the upstream's."""

    def __init__(self, direction: str, *, include_usage: bool, input_tokens: int,
                 request_id: str, keep_bytes: int = 0) -> None:
        self._decoder: chat.ChatStreamDecoder | messages.MessagesStreamDecoder
        self._encoder: chat.ChatStreamEncoder | messages.MessagesStreamEncoder
        if direction == "chat_to_messages":
            self._decoder = messages.MessagesStreamDecoder()
            self._encoder = chat.ChatStreamEncoder(created=int(time.time()),
                                                   include_usage=include_usage)
        else:
            self._decoder = chat.ChatStreamDecoder()
            self._encoder = messages.MessagesStreamEncoder(input_tokens=input_tokens,
                                                           request_id=request_id)
        self.done = False
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None
        self.service_tier: object = None
        self.failure: str | None = None
        self.kept: list[bytes] | None = [] if keep_bytes else None
        self._keep_bytes = keep_bytes

    def feed(self, data: bytes) -> bytes:
        return self._encode(self._decoder.feed(data))

    def finish(self) -> bytes:
        return self._encode(self._decoder.close())

    def error_event(self, message: str, code: str) -> bytes:
        if self.failure is not None:  # the upstream's error is written already
            return b""
        return self._encoder.encode(Error(502, message, code))

    def _encode(self, events: list[Event]) -> bytes:
        out = []
        for event in events:
            if isinstance(event, Error):  # written in the client's format; nothing after
                self.failure = event.message[:1000]
            elif isinstance(event, Usage):
                self.usage = {"prompt_tokens": event.input, "completion_tokens": event.output}
            elif isinstance(event, End):
                self.done = True
            self.events += 1
            out.append(self._encoder.encode(event))
        written = b"".join(out)
        if self.kept is not None and written:
            self._keep(written)
        return written

    def _keep(self, written: bytes) -> None:
        kept = self.kept
        assert kept is not None
        for event in written.split(b"\n\n")[:-1]:  # the encoders end lines in LF alone
            data = event_data(event)
            if data is not None and data != b"[DONE]":
                kept.append(data)
                self._keep_bytes -= len(data)
        if self._keep_bytes < 0:
            self.kept = None
