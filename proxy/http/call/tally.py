"""Reading an SSE stream as it passes: cut into whole events only (CRLF, LF and CR line
ends), and what they say (usage, the stream's end, a Responses API stream's id) picked up
on the way. ``relay`` writes to the client what a tally lets through."""

from __future__ import annotations

import re
from typing import Any, Protocol

import orjson

from ...core.errors import UpstreamBadResponse
from ...core.formats import messages
from ...core.formats.events import Error
from ...core.formats.sse import frame

# An event ends at a blank line; lines end in CRLF, LF or CR (a CR last in a chunk waits
# for the next byte: it may be half of a CRLF).
_BOUNDARY = re.compile(rb"(?:\r\n|\n|\r(?=[^\n]))(?:\r\n|\n|\r(?=[^\n]))")
MAX_EVENT_BYTES = 8 << 20  # one SSE event held back whole; a larger one breaks the stream
# A Responses API stream ends with one of these instead of [DONE].
TERMINAL_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete",
                                      "response.failed"})
_RESPONSE_MARKS = re.compile(rb"response\.(?:created|completed|incomplete|failed)")
# What ``StreamTally._inspect`` reads an event for.
_MARKS = (b'"usage"', b"response.", b"[DONE]")
# One byte looked for as an int: ``bytes in bytes`` first tries its needle as an integer,
# and the TypeError it formats and clears costs as much as 8 of these tests.
CR, LF = ord("\r"), ord("\n")


class Tally(Protocol):
    """What ``relay`` reads a stream through: the events to write as they complete, and
    what the stream said (``StreamTally`` passes the upstream's own bytes;
    ``translate.Translating`` writes them in another format)."""

    done: bool
    events: int
    usage: dict[str, Any] | None
    response_id: str | None
    service_tier: object
    kept: list[bytes] | None
    failure: str | None  # the upstream's own error event, relayed in the client's format

    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    def error_event(self, message: str, code: str) -> bytes: ...


class StreamTally:
    """Relays whole SSE events only, counting content events and picking up ``usage`` as
    they pass, so a stream that breaks never leaves the client half an event.

    With ``strip_usage`` (the proxy added ``stream_options.include_usage`` the client did
    not ask for) the usage-only chunk is removed, so the client sees exactly what it asked
    for. Otherwise the bytes are the upstream's own, cut only at event boundaries.
    """

    def __init__(self, strip_usage: bool, keep_bytes: int = 0) -> None:
        """``keep_bytes``: keep the events' data (``kept``) up to that many bytes in all,
        for the response cache; past that none is kept (0: none at all)."""
        self.strip_usage = strip_usage
        self._keep_bytes = keep_bytes
        self.kept: list[bytes] | None = [] if keep_bytes else None
        self._kept_bytes = 0
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.service_tier: object = None  # the tier the provider says it served the call at
        self.done = False
        self.response_id: str | None = None
        self.failure: str | None = None
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """The whole events ``data`` completes; raises UpstreamBadResponse on an event
        past MAX_EVENT_BYTES."""
        buffer = self._pending + data if self._pending else data
        pos = len(self._pending) - 3  # what was pending was searched already
        if pos < 0:
            pos = 0
        relayed = self._cut(buffer, pos) if CR in buffer else self._split(buffer, pos)
        if len(self._pending) > MAX_EVENT_BYTES:
            raise UpstreamBadResponse(f"an SSE event is larger than {MAX_EVENT_BYTES} bytes")
        return relayed

    def _split(self, buffer: bytes, pos: int) -> bytes:
        """``feed`` for lines that end in LF alone (nearly every stream): cut by C's split."""
        first = buffer.find(b"\n\n", pos)
        if first < 0:
            self._pending = buffer
            return b""
        events = buffer[first + 2:].split(b"\n\n")
        self._pending = events.pop()
        events.insert(0, buffer[:first])
        whole = len(buffer) - len(self._pending)
        # Up to the first thing the proxy reads (usage, a Responses event, the end), events
        # whose data is an object are only counted, not inspected one by one.
        plain = -1
        if self.kept is None:
            plain = whole
            for mark in _MARKS:  # find, not a regex: an alternation scans at Python speed
                found = buffer.find(mark, 0, plain)
                if found >= 0:
                    plain = found
        dropped: list[int] = []  # where the events the client must not see start
        offset = 0
        for event in events:
            start, offset = offset, offset + len(event) + 2
            if offset - 2 <= plain and event.startswith(b"data: {"):
                self.events += 1
            elif not self._inspect(event):
                dropped += (start, offset)
        if not dropped:
            return buffer[:whole]
        edges = [0, *dropped, whole]
        return b"".join(buffer[edges[i]:edges[i + 1]] for i in range(0, len(edges), 2))

    def _cut(self, buffer: bytes, pos: int) -> bytes:
        start, dropped = 0, False
        kept: list[bytes] = []
        for end, after in boundaries(buffer, pos):
            if self._inspect(buffer[start:end]):
                kept.append(buffer[start:after])
            else:
                dropped = True
            start = after
        self._pending = buffer[start:]
        return b"".join(kept) if dropped else buffer[:start]

    def error_event(self, message: str, code: str) -> bytes:
        return error_event(message, code)

    def _keep(self, data: bytes) -> None:
        """An event's data for the cache, while all kept stays within ``keep_bytes``."""
        assert self.kept is not None
        self._kept_bytes += len(data)
        if self._kept_bytes <= self._keep_bytes:
            self.kept.append(data)
        else:
            self.kept = None

    def finish(self) -> bytes:
        """At a clean end of the stream: what is left, as a whole event (a CR last in the
        stream ends its line; an event the upstream left unterminated is terminated, as a
        reader dispatches it at the end of a stream too)."""
        rest, self._pending = self._pending, b""
        if not rest.strip(b"\r\n"):
            return rest
        match = _BOUNDARY.search(rest + b"-")
        complete = match is not None and match.end() == len(rest)
        if not self._inspect(rest[:match.start()] if complete and match else rest):
            return b""
        return rest if complete else rest + b"\n\n"

    def _inspect(self, event: bytes) -> bool:
        """Record what the event says; False if the client must not see it."""
        data = event_data(event)
        if data is None:  # a comment or an event without data
            return True
        if data == b"[DONE]":
            self.done = True
            return True
        self.events += 1
        if self.kept is not None:
            self._keep(data)
        if data.find(b'"usage"') < 0 and (data.find(b"response.") < 0
                                          or not _RESPONSE_MARKS.search(data)):
            return True
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(payload, dict):
            return True
        kind = payload.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            self._response_event(kind, payload.get("response"))
            return True
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage, self.service_tier = usage, payload.get("service_tier")
            if self.strip_usage and not payload.get("choices"):
                self.events -= 1
                return False
        return True

    def _response_event(self, kind: str, response: object) -> None:
        """A Responses API stream: its id comes first, its usage with its last event."""
        if not isinstance(response, dict):
            return
        if kind == "response.created" and isinstance(response.get("id"), str):
            self.response_id = response["id"]
        if kind in TERMINAL_RESPONSE_EVENTS:
            self.done = True
            usage = response.get("usage")
            if isinstance(usage, dict):
                self.usage, self.service_tier = usage, response.get("service_tier")


class MessagesTally(StreamTally):
    """An Anthropic Messages stream relayed as it is (a Messages call to a Messages
    provider): its usage from ``message_start`` and ``message_delta``, its end at
    ``message_stop``; an ``error`` event passes to the client, which reads it as the
    stream's end, and nothing is written after it."""

    def __init__(self, keep_bytes: int, request_id: str) -> None:
        super().__init__(False, keep_bytes)
        self._request_id = request_id

    def error_event(self, message: str, code: str) -> bytes:
        if self.failure is not None:  # the upstream's own error was the last event
            return b""
        return frame(messages.encode_error(Error(502, message, code), self._request_id),
                     b"error")

    def _inspect(self, event: bytes) -> bool:
        data = event_data(event)
        if data is None:
            return True
        self.events += 1
        if self.kept is not None:
            self._keep(data)
        if data.find(b'"message_') < 0 and data.find(b'"error"') < 0:
            return True
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return True
        kind = payload.get("type") if isinstance(payload, dict) else None
        if kind == "message_start":
            message = payload.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self.usage = usage
        elif kind == "message_delta":
            usage = payload.get("usage")
            if isinstance(usage, dict):
                self.usage = {**(self.usage or {}), **usage}
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            self.failure = messages.decode_error(502, data).message[:1000]
        return True


def boundaries(buffer: bytes, pos: int) -> list[tuple[int, int]]:
    """Where the events in ``buffer`` end, from ``pos`` on: (end of the event, start of the
    next). Streams whose lines end in LF alone (nearly all) are cut by ``bytes.find``."""
    if CR in buffer:
        return [match.span() for match in _BOUNDARY.finditer(buffer, pos)]
    found = []
    find = buffer.find
    while (end := find(b"\n\n", pos)) >= 0:
        pos = end + 2
        found.append((end, pos))
    return found


def event_data(event: bytes) -> bytes | None:
    """The event's data as the SSE spec defines it: the values of its ``data`` lines (one
    space after the colon dropped) joined by newlines; None without a ``data`` line."""
    if event.startswith(b"data: ") and LF not in event and CR not in event:
        return event[6:]  # the common case: one data line
    values = []
    for line in event.splitlines():
        if line == b"data":
            values.append(b"")
        elif line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(values) if values else None


def error_event(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + b"\n\n"
