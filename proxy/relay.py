"""Watching (and, when the proxy asked for usage itself, editing) a relayed SSE stream."""

from __future__ import annotations

import re
from typing import Any

import orjson

_BOUNDARY = re.compile(rb"\r?\n\r?\n")
_MAX_PENDING = 1 << 16  # an event larger than this is passed on as it is


class StreamTally:
    """Counts content events and picks up ``usage`` from SSE bytes as they pass.

    With ``strip_usage`` (the proxy added ``stream_options.include_usage`` the client did
    not ask for) the usage-only chunk is removed, so the client sees exactly what it asked
    for; only then are bytes held back, and never more than one partial event.
    """

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._pending + data if self._pending else data
        parts = _BOUNDARY.split(buffer)
        self._pending = parts.pop()
        if not self.strip_usage:
            for event in parts:
                self._inspect(event)
            if len(self._pending) > _MAX_PENDING:
                self._pending = b""
            return data
        out = b"".join(event + b"\n\n" for event in parts if self._inspect(event))
        if len(self._pending) > _MAX_PENDING:
            out, self._pending = out + self._pending, b""
        return out

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest if self.strip_usage else b""

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; False if the client must not see it."""
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return True
        if b'"usage"' not in event:
            self.events += 1
            return True
        payload = _data(event)
        if not isinstance(payload, dict):
            self.events += 1
            return True
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if self.strip_usage and not payload.get("choices"):
                return False
        self.events += 1
        return True


def _data(event: bytes) -> object:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                return orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
    return None


def error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + b"\n\n"
