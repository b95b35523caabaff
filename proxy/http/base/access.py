"""One access-log line per call, JSON (the default) or text, on standard output.

The line is written when the call ends, however it ends: answered, refused, broken
mid-stream or left by its client (status 499). It carries names and numbers only: the
key's name, never the key; no header, no body.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import IO

import orjson

log = logging.getLogger("proxy.access")
_PLAIN = re.compile(r"[\w.:/+=@-]+")


@dataclass(slots=True)
class CallRecord:
    """What the request path learns about one call, filled in as it goes."""

    arrived: float  # wall clock, seconds since the epoch
    key: str | None = None
    tier: str | None = None
    model: str | None = None
    upstream: str | None = None
    code: str | None = None  # the error code, also of a stream broken after its head
    queue_s: float | None = None
    upstream_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None
    cache: str | None = None  # hit | miss (response cache), semantic | semantic_miss


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class _Lines(logging.StreamHandler[IO[str]]):
    """When the stream's reader goes away (``serve --access-log | head``), one warning and
    the proxy serves on, its lines dropped, instead of a traceback on stderr for each call
    from then on."""

    def handleError(self, record: logging.LogRecord) -> None:
        if not isinstance(sys.exc_info()[1], BrokenPipeError):
            super().handleError(record)
            return
        # Devnull under the stream's own descriptor, as the Python docs advise for stdout:
        # what its buffer still holds is written there, at the next line and at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)
        logging.getLogger(__name__).warning(
            "access log: its reader closed the pipe; the lines of later calls are dropped")


class AccessLog:
    def __init__(self, format: str = "json", stream: IO[str] | None = None) -> None:
        self.format = format
        handler = _Lines(stream or sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.handlers[:] = [handler]
        log.setLevel(logging.INFO)
        log.propagate = False  # pure lines, not inside another log format

    def emit(self, request_id: str, method: str, path: str, status: int, took_s: float,
             record: CallRecord) -> None:
        ts = datetime.datetime.fromtimestamp(record.arrived, datetime.UTC)
        fields = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": request_id, "method": method, "path": path, "status": status,
            "code": record.code, "key": record.key, "tier": record.tier, "model": record.model,
            "upstream": record.upstream, "duration_ms": _ms(took_s),
            "queue_ms": _ms(record.queue_s), "upstream_ms": _ms(record.upstream_s),
            "ttft_ms": _ms(record.ttft_s), "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cost_usd": None if record.cost_usd is None else round(record.cost_usd, 8),
            "cache": record.cache,
        }
        if self.format == "json":
            log.info("%s", orjson.dumps(fields).decode())
        else:
            log.info("%s", " ".join(f"{k}={_text(v)}" for k, v in fields.items()))


def _text(value: object) -> str:
    """A value for the text format: a string with anything but plain characters is quoted
    (a client's model name or path cannot start a line of its own)."""
    if value is None:
        return "-"
    if isinstance(value, str) and not _PLAIN.fullmatch(value):
        return orjson.dumps(value).decode()
    return str(value)
