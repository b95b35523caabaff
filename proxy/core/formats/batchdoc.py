"""The OpenAI shapes of work that can wait: batch objects, output and error lines, file
objects, background response objects. Pure: times are passed in (epoch seconds)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from .endpoints import PATH_OF

WINDOW = re.compile(r"^([1-9][0-9]{0,3})(h|m)$")
MAX_WINDOW_S = 7 * 24 * 3600
FINISHED = ("completed", "failed", "expired", "cancelled")  # a batch's or a response's end


def window_s(text: str) -> int:
    """``completion_window`` in seconds: ``24h`` (OpenAI's only value), or any ``Nh``/``Nm``
    up to 7 days. Raises ValueError."""
    match = WINDOW.match(text)
    if match is None:
        raise ValueError("completion_window: must be like 24h (hours) or 30m (minutes)")
    seconds = int(match.group(1)) * (3600 if match.group(2) == "h" else 60)
    if seconds > MAX_WINDOW_S:
        raise ValueError("completion_window: at most 7 days (168h)")
    return seconds


def file_doc(row: dict[str, Any]) -> dict[str, Any]:
    # No expires_at or status_details: OpenAI's spec has them optional, and not null.
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed"}


def batch_doc(batch_id: str, endpoint: str, input_file_id: str, window: str, now: int,
              expires_at: int, total: int, metadata: dict[str, str] | None) -> dict[str, Any]:
    return {
        "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
        "input_file_id": input_file_id, "completion_window": window,
        "status": "in_progress", "output_file_id": None, "error_file_id": None,
        "created_at": now, "in_progress_at": now, "expires_at": expires_at,
        "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def batch_view(doc: dict[str, Any]) -> dict[str, Any]:
    """A stored batch as the API shows it: the fields still unset (null in the store) left
    out, since OpenAI's spec has them optional and not null; only metadata may be null."""
    return {name: value for name, value in doc.items() if value is not None or name == "metadata"}


def request_counts(total: int, by_status: dict[str, int]) -> dict[str, int]:
    """Lines answered 2xx are completed; refused, failed, expired or cancelled ones failed."""
    return {"total": total, "completed": by_status.get("done", 0),
            "failed": sum(by_status.get(s, 0) for s in ("failed", "expired", "cancelled"))}


def output_line(line_id: str, custom_id: str, status: int, request_id: str,
                body: object) -> bytes:
    return orjson.dumps({"id": line_id, "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": request_id,
                                      "body": body},
                         "error": None})


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> bytes:
    return orjson.dumps({"id": line_id, "custom_id": custom_id, "response": None,
                         "error": {"code": code, "message": message}})


CHAT_PREFIX = "chatcmpl-bg-"  # a background chat completion's id (the rest: responses)


def background_path(response_id: str) -> str:
    """The endpoint a background call runs on, from its id."""
    return PATH_OF["chat" if response_id.startswith(CHAT_PREFIX) else "responses"]


def response_doc(response_id: str, now: int, status: str, request: Mapping[str, Any],
                 answer: dict[str, Any] | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
    """A background response (or chat completion) as ``GET`` by its id shows it: the
    upstream's answer under this id once there is one, else a shell with the status and
    every field OpenAI's Response object requires, as the request set them (no usage yet:
    the spec has it optional, and not null)."""
    model = request.get("model")
    if answer is not None:
        return {**answer, "id": response_id, "background": True, "status": status}
    if response_id.startswith(CHAT_PREFIX):
        return {"id": response_id, "object": "chat.completion", "created": now,
                "status": status, "background": True, "model": model, "choices": [],
                "error": error}
    return {"id": response_id, "object": "response", "created_at": now, "status": status,
            "background": True, "model": model, "output": [], "error": error,
            "incomplete_details": None,
            **{name: default if request.get(name) is None else request[name]
               for name, default in _RESPONSE_ECHOED}}


# What a Response echoes of its request, and OpenAI's defaults for what it left out or sent
# as null (OpenAI's spec allows a request's parallel_tool_calls to be null, not a Response's).
_RESPONSE_ECHOED: tuple[tuple[str, Any], ...] = (
    ("instructions", None), ("tools", []), ("tool_choice", "auto"),
    ("parallel_tool_calls", True), ("metadata", {}), ("temperature", None), ("top_p", None),
    ("max_output_tokens", None), ("previous_response_id", None))
