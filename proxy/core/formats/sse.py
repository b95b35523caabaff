"""Server-sent events (pure): bytes in chunks split anywhere → each event's name and data as
its blank line arrives; and one event back to bytes.

Read as the WHATWG spec says: lines end in LF, CRLF or CR (a CR last in a chunk waits, it
may be half of a CRLF); ``data`` lines are joined by LF, one space after the colon is
dropped (``data:x`` and ``data: x`` are alike); ``event`` names the event; comments (``:
ping``), ``id`` and ``retry`` are read past; an event without data is not dispatched.
"""

from __future__ import annotations

from ..errors import UpstreamBadResponse

MAX_EVENT_BYTES = 8 << 20  # one event held back whole; a larger one breaks the stream
Frame = tuple[bytes, bytes]  # (event name, or b"" when the event has none; data)


class SseReader:
    """Whole events out of chunks: only the tail of an unfinished event is kept."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[Frame]:
        """The events ``chunk`` completes; raises UpstreamBadResponse on an event past
        MAX_EVENT_BYTES."""
        buffer = self._pending + chunk if self._pending else chunk
        if b"\r" in buffer:
            buffer = _lf_only(buffer)
        end = buffer.rfind(b"\n\n")
        if end < 0:
            if len(buffer) > MAX_EVENT_BYTES:
                raise UpstreamBadResponse(f"an SSE event is larger than {MAX_EVENT_BYTES} bytes")
            self._pending = buffer
            return []
        self._pending = buffer[end + 2:]
        return [found for block in buffer[:end].split(b"\n\n")
                if (found := _frame(block)) is not None]

    def close(self) -> list[Frame]:
        """At the end of the stream: an event whose last line ended but whose blank line
        never came is dispatched; a line cut short is not."""
        rest, self._pending = self._pending, b""
        if rest.endswith(b"\r"):  # the stream's end ends the line it held back
            rest = rest[:-1] + b"\n"
        if not rest.endswith(b"\n"):
            return []
        last = _frame(rest)
        return [] if last is None else [last]


def frame(data: bytes, event: bytes = b"") -> bytes:
    """One event: ``data`` must hold no line break (JSON from orjson holds none)."""
    if event:
        return b"event: " + event + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def _lf_only(buffer: bytes) -> bytes:
    """Every line end as LF, but a CR last in the buffer kept as it is."""
    held = buffer.endswith(b"\r")
    body = buffer[:-1] if held else buffer
    body = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return body + b"\r" if held else body


def _frame(block: bytes) -> Frame | None:
    # A block holds no blank line; an LF at either end is part of the blank line around it.
    # Nearly every event is one data line, or an event line and a data line.
    block = block.strip(b"\n")
    line_end = block.find(b"\n")
    if line_end < 0:
        if block.startswith(b"data: "):
            return b"", block[6:]
    elif (block.startswith(b"event: ") and block.startswith(b"data: ", line_end + 1)
          and block.find(b"\n", line_end + 1) < 0):
        return block[7:line_end], block[line_end + 7:]
    name, data = b"", []
    for line in block.split(b"\n"):
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value
    return (name, b"\n".join(data)) if data else None
