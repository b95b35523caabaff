"""What the simulated provider answers, in the shape of each OpenAI API: Chat Completions,
(legacy) Completions and Responses, whole or as SSE events."""

from __future__ import annotations

import time
from typing import Any

import orjson


def _sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


class Answer:
    """One answer of ``n_out`` tokens to a prompt of ``prompt_tokens``; ``text`` is the
    whole output (bounded by the provider's max_output_tokens). ``finish``: ``length`` where
    the output stopped at the call's own limit, else ``stop``."""

    object_name = "chat.completion"
    repeats_text = False  # the last event carries the whole text again (Responses only)

    def __init__(self, model: str, n_out: int, prompt_tokens: int,
                 finish: str = "length") -> None:
        self.model = model
        self.finish = finish
        self.n_out = n_out
        self.prompt_tokens = prompt_tokens
        self.id = f"chatcmpl-sim{time.monotonic_ns():x}"
        self.created = int(time.time())

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.n_out,
                "total_tokens": self.prompt_tokens + self.n_out}

    def whole(self, text: str) -> bytes:
        return orjson.dumps({
            "id": self.id, "object": self.object_name, "created": self.created,
            "model": self.model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": self.finish}],
            "usage": self.usage(),
        })

    def opening(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def pieces(self, words: list[str]) -> bytes:
        return b"".join(self._chunk({"content": w}, None) for w in words)

    def closing(self, text: str, include_usage: bool) -> bytes:
        tail = self._chunk({}, self.finish)
        if include_usage:
            tail += self._chunk(None, None, usage=self.usage())
        return tail + b"data: [DONE]\n\n"

    def _chunk(self, delta: dict[str, str] | None, finish: str | None,
               usage: dict[str, int] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [] if delta is None else [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if usage is not None:
            chunk["usage"] = usage
        return _sse(chunk)


class CompletionAnswer(Answer):
    object_name = "text_completion"

    def whole(self, text: str) -> bytes:
        return orjson.dumps({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": self.finish}],
            "usage": self.usage(),
        })

    def opening(self) -> bytes:
        return b""

    def pieces(self, words: list[str]) -> bytes:
        return b"".join(self._text(w, None) for w in words)

    def closing(self, text: str, include_usage: bool) -> bytes:
        tail = self._text("", self.finish)
        if include_usage:
            tail += _sse({"id": self.id, "object": "text_completion", "created": self.created,
                          "model": self.model, "choices": [], "usage": self.usage()})
        return tail + b"data: [DONE]\n\n"

    def _text(self, text: str, finish: str | None) -> bytes:
        return _sse({"id": self.id, "object": "text_completion", "created": self.created,
                     "model": self.model, "choices": [
                         {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})


class ResponseAnswer(Answer):
    """The Responses API: one assistant message with one output_text part."""

    repeats_text = True

    def __init__(self, model: str, n_out: int, prompt_tokens: int,
                 finish: str = "length") -> None:
        super().__init__(model, n_out, prompt_tokens, finish)
        self.id = f"resp_sim{time.monotonic_ns():x}"
        self.item_id = f"msg_sim{time.monotonic_ns():x}"
        self._sequence = 0

    def usage(self) -> dict[str, Any]:
        # OpenAI's spec requires cache_write_tokens beside cached_tokens (since 2026-07-15).
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": self.n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.n_out}

    def _response(self, status: str, text: str | None) -> dict[str, Any]:
        response = {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "error": None, "incomplete_details": None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True,
            "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "output": [] if text is None else [self._item(text)],
        }
        if text is not None:  # until then none: OpenAI's spec has usage optional, not null
            response["usage"] = self.usage()
        return response

    def _item(self, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self.item_id, "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed", "content": content}

    def whole(self, text: str) -> bytes:
        return orjson.dumps(self._response("completed", text))

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return _sse({"type": kind, "sequence_number": self._sequence, **fields}, kind)

    def opening(self) -> bytes:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._event("response.created", response=self._response("in_progress", None))
                + self._event("response.in_progress",
                              response=self._response("in_progress", None))
                + self._event("response.output_item.added", output_index=0,
                              item=self._item(None))
                + self._event("response.content_part.added", item_id=self.item_id,
                              output_index=0, content_index=0, part=part))

    def pieces(self, words: list[str]) -> bytes:
        return b"".join(
            self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                        content_index=0, delta=w, logprobs=[]) for w in words)

    def closing(self, text: str, include_usage: bool) -> bytes:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return (self._event("response.output_text.done", item_id=self.item_id,
                            output_index=0, content_index=0, text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=self.item_id,
                              output_index=0, content_index=0, part=part)
                + self._event("response.output_item.done", output_index=0,
                              item=self._item(text))
                + self._event("response.completed",
                              response=self._response("completed", text)))


ANSWERS: dict[str, type[Answer]] = {
    "/chat/completions": Answer, "/completions": CompletionAnswer, "/responses": ResponseAnswer,
}
