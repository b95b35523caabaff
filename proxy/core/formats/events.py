"""The neutral answer: what an answer in any wire format says, as typed events, so a format
is a decoder (bytes → events) and an encoder (events → bytes) and translating is feeding one
into the other (h11's way: the I/O is the caller's).

A stream decodes to ``Start``, the content in the order it came (``TextDelta``,
``ThinkingDelta``, ``ToolCallStart``, ``ToolArgsDelta``), then ``Finish`` and ``Usage``, and
ends in exactly one ``End`` (it finished cleanly) or ``Error`` (it did not). A whole JSON
answer decodes to the same events, one delta per block.

- One choice: Anthropic answers with one, and a translated call never asks for more.
- A tool call's ``index`` is its place among the answer's tool calls (0, 1, …), whatever
  block index its format gave it.
- ``Usage`` counts are the answer's so far, not increments: a later one replaces an earlier.
  ``input`` is every prompt token, those read from or written to a cache included.
- ``Error.status`` is the HTTP status the error has or would have; each format names its
  own error types from it.
"""

from __future__ import annotations

from typing import Any, Literal

from ..errors import ProxyError
from ..value import value

# stop: a natural end (at a stop sequence when Finish names it); length: max_tokens or the
# context window; content_filter: a refusal; pause: Anthropic's pause_turn (a server tool's
# loop paused; the client sends the answer back to go on).
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "pause"]


@value
class Start:
    id: str
    model: str


@value
class TextDelta:
    text: str


@value
class ThinkingDelta:
    text: str
    signature: str = ""  # Anthropic's signature of the thinking block, sent after its text


@value
class ToolCallStart:
    index: int
    id: str
    name: str


@value
class ToolArgsDelta:
    index: int
    fragment: str  # a piece of the call's arguments, a JSON object once all are joined


@value
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None


@value
class Usage:
    input: int
    output: int
    cache_read: int = 0
    cache_write: int = 0


@value
class End:
    pass


@value
class Error:
    status: int
    message: str
    code: str | None = None
    param: str | None = None


Event = (Start | TextDelta | ThinkingDelta | ToolCallStart | ToolArgsDelta | Finish | Usage | End
         | Error)


@value
class Translation:
    """A request body in the other format, and the fields of the original it left out or
    could only approximate (``messages[].name``: that field of any message)."""

    body: dict[str, Any]
    dropped: tuple[str, ...] = ()
    approximated: tuple[str, ...] = ()


def error_of(exc: ProxyError) -> Error:
    """The proxy's own error, to be answered in a client's format."""
    return Error(exc.status, exc.message, exc.code, exc.param)
