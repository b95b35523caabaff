"""A Chat Completions request → an Anthropic Messages request (pure), and what was lost.

Translated, per field:

- ``model``, ``stream``, ``top_p`` as they are; ``temperature`` capped at 1 (Anthropic's
  range is 0 to 1; approximated when capped); ``max_completion_tokens`` or else ``max_tokens``
  → ``max_tokens``, which Anthropic requires: ``default_max_tokens`` when neither is sent
  (approximated); ``stop`` → ``stop_sequences`` (whitespace-only sequences, which Anthropic
  refuses, are left out: approximated); ``user`` (or else ``safety_identifier``) →
  ``metadata.user_id``; ``n`` of 1 is Anthropic's only answer.
- ``system`` and ``developer`` messages → ``system``, joined by newlines (one met after the
  conversation began is hoisted: approximated). ``user`` text and ``image_url`` parts (a
  data URL → a base64 source, an http(s) URL → a url source); ``assistant`` text, refusal
  parts and ``tool_calls`` → ``tool_use`` blocks, arguments parsed; ``tool`` messages →
  ``tool_result`` blocks in a user turn. Turns of one role in a row are merged, tool results
  first in their turn, as Anthropic requires; empty text is left out (Anthropic refuses
  it); the final assistant turn loses trailing whitespace (Anthropic refuses it); tool call
  ids are made of ``[A-Za-z0-9_-]`` (others become ``_``: approximated).
- ``tools`` (function tools) → ``name``, ``description``, ``input_schema``; ``tool_choice``
  auto / none / required / a named function → auto / none / any / tool;
  ``parallel_tool_calls: false`` → ``disable_parallel_tool_use``;
  ``response_format`` ``json_schema`` → ``output_config.format``.
- Dropped (listed): ``strict``, ``image_url.detail``, messages' ``name`` and ``audio``,
  ``response_format`` ``json_object``, and every other field (``logprobs``, ``seed``,
  ``logit_bias``, penalties, ``metadata``, ``service_tier``, ``reasoning_effort``, …):
  Anthropic refuses fields it does not know. ``stream_options`` is the encoder's to honour.
- Refused (``InvalidRequest`` naming the field): ``n`` > 1, audio and file parts,
  custom tools, ``allowed_tools``, the deprecated ``functions`` / ``function_call``, and
  anything not of the type OpenAI's spec says.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ..errors import InvalidRequest
from .events import Translation

DEFAULT_MAX_TOKENS = 4096
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
MAX_USER_ID = 512  # Anthropic's limit on metadata.user_id
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
_NOT_ID = re.compile(r"[^a-zA-Z0-9_-]")
_HONOURED = frozenset({  # read below, or the encoder's (stream_options)
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "stream", "stream_options", "stop", "tools", "tool_choice", "parallel_tool_calls",
    "user", "safety_identifier", "n", "response_format"})
_REFUSED = ("functions", "function_call")


def to_messages(body: dict[str, Any], *,
                default_max_tokens: int = DEFAULT_MAX_TOKENS) -> Translation:
    """The Messages request for a checked Chat request; raises InvalidRequest."""
    return _Translator().run(body, default_max_tokens)


class _Translator:
    def __init__(self) -> None:
        self.dropped: set[str] = set()
        self.approximated: set[str] = set()

    def run(self, body: dict[str, Any], default_max_tokens: int) -> Translation:
        for name in _REFUSED:
            if body.get(name) is not None:
                raise InvalidRequest(f"'{name}' is deprecated and cannot be sent to Anthropic; "
                                     "use 'tools'.", param=name)
        if body.get("n") not in (None, 1):
            raise InvalidRequest("Anthropic answers with one choice: 'n' must be 1.", param="n")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' must be a string.", param="model")
        system, turns = self._conversation(body.get("messages"))
        out: dict[str, Any] = {"model": model, "messages": turns,
                               "max_tokens": self._max_tokens(body, default_max_tokens)}
        if system:
            out["system"] = "\n".join(system)
        if body.get("stream") is not None:
            out["stream"] = body["stream"] is True
        self._sampling(body, out)
        self._tools(body, out)
        self._format(body.get("response_format"), out)
        self.dropped.update(name for name, found in body.items()
                            if name not in _HONOURED and found is not None)
        return Translation(out, tuple(sorted(self.dropped)), tuple(sorted(self.approximated)))

    def _max_tokens(self, body: dict[str, Any], default: int) -> int:
        for name in ("max_completion_tokens", "max_tokens"):
            found = body.get(name)
            if found is not None:
                if isinstance(found, bool) or not isinstance(found, int) or found < 0:
                    raise InvalidRequest(f"'{name}' must be a non-negative integer.", param=name)
                return found
        self.approximated.add("max_tokens")
        return default

    def _sampling(self, body: dict[str, Any], out: dict[str, Any]) -> None:
        for name in ("temperature", "top_p"):
            found = body.get(name)
            if found is None:
                continue
            if isinstance(found, bool) or not isinstance(found, int | float):
                raise InvalidRequest(f"'{name}' must be a number.", param=name)
            if found > 1:  # only temperature may be: OpenAI's range for it is 0-2
                self.approximated.add(name)
            out[name] = min(found, 1)
        stop = body.get("stop")
        if stop is not None:
            sequences = [stop] if isinstance(stop, str) else stop
            if not isinstance(sequences, list) or not all(isinstance(s, str) for s in sequences):
                raise InvalidRequest("'stop' must be a string or an array of strings.",
                                     param="stop")
            kept = [s for s in sequences if s.strip()]
            if len(kept) < len(sequences):
                self.approximated.add("stop")
            if kept:
                out["stop_sequences"] = kept
        user = body.get("user") or body.get("safety_identifier")
        if isinstance(user, str) and user:
            if len(user) > MAX_USER_ID:
                self.approximated.add("user")
            out["metadata"] = {"user_id": user[:MAX_USER_ID]}

    def _conversation(self, messages: Any) -> tuple[list[str], list[dict[str, Any]]]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
        system: list[str] = []
        turns: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise InvalidRequest(f"{where} must be an object.", param=where)
            role = message.get("role")
            if message.get("name") is not None:
                self.dropped.add("messages[].name")
            if role in ("system", "developer"):
                system += self._texts(message.get("content"), f"{where}.content")
                if turns:
                    self.approximated.add("messages[].role")
                continue
            if role == "user":
                blocks = self._user(message.get("content"), f"{where}.content")
            elif role == "assistant":
                blocks = self._assistant(message, where)
            elif role == "tool":
                blocks, role = [self._tool_result(message, where)], "user"
            else:
                raise InvalidRequest(f"{where}.role: {role!r} cannot be sent to Anthropic.",
                                     param=f"{where}.role")
            if not blocks:
                self.approximated.add("messages[].content")
            elif turns and turns[-1]["role"] == role:
                turns[-1]["content"] += blocks
            else:
                turns.append({"role": role, "content": blocks})
        if not turns:
            raise InvalidRequest("'messages' holds no user or assistant message with content.",
                                 param="messages")
        for turn in turns:  # tool results first in a turn, as Anthropic requires
            turn["content"].sort(key=lambda block: block["type"] != "tool_result")
        self._trim_final(turns)
        return [text for text in system if text], turns

    def _trim_final(self, turns: list[dict[str, Any]]) -> None:
        """A final assistant turn (the start of the answer) may not end in whitespace."""
        last = turns[-1]
        if last["role"] != "assistant" or last["content"][-1]["type"] != "text":
            return
        block = last["content"][-1]
        trimmed = block["text"].rstrip()
        if trimmed == block["text"]:
            return
        self.approximated.add("messages[].content")
        if trimmed:
            block["text"] = trimmed
        else:
            last["content"].pop()
            if not last["content"]:
                turns.pop()

    def _texts(self, content: Any, where: str, refusals: bool = False) -> list[str]:
        """The text of a string or of text parts (and refusal parts, with ``refusals``)."""
        if content is None:
            return []
        if isinstance(content, str):
            return [content]
        if not isinstance(content, list):
            raise InvalidRequest(f"{where} must be a string or an array.", param=where)
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            field = "refusal" if kind == "refusal" and refusals else "text"
            if kind != field or not isinstance(part.get(field), str):
                raise InvalidRequest(f"{where}[{j}] must be a text part.", param=f"{where}[{j}]")
            texts.append(part[field])
        return texts

    def _text_blocks(self, texts: list[str]) -> list[dict[str, Any]]:
        kept = [{"type": "text", "text": text} for text in texts if text.strip()]
        if len(kept) < len(texts):
            self.approximated.add("messages[].content")
        return kept

    def _user(self, content: Any, where: str) -> list[dict[str, Any]]:
        if not isinstance(content, list):
            return self._text_blocks(self._texts(content, where))
        blocks = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                blocks.append(self._image(part.get("image_url"), at))
            elif kind == "text" and isinstance(part.get("text"), str):
                blocks += self._text_blocks([part["text"]])
            else:
                raise InvalidRequest(f"{at}: a {kind!r} part cannot be sent to Anthropic's "
                                     "Messages API.", param=at)
        return blocks

    def _image(self, image: Any, at: str) -> dict[str, Any]:
        url = image.get("url") if isinstance(image, dict) else None
        if not isinstance(url, str):
            raise InvalidRequest(f"{at}.image_url.url must be a string.", param=f"{at}.image_url")
        if image.get("detail") is not None:
            self.dropped.add("messages[].content[].image_url.detail")
        if url.startswith("data:"):
            head, comma, data = url.partition(",")
            media = head[5:].removesuffix(";base64")
            if comma and head.endswith(";base64") and media in IMAGE_TYPES:
                return {"type": "image",
                        "source": {"type": "base64", "media_type": media, "data": data}}
        elif url.startswith(("https://", "http://")):
            return {"type": "image", "source": {"type": "url", "url": url}}
        raise InvalidRequest(f"{at}.image_url.url: Anthropic takes an http(s) URL or a base64 "
                             f"data URL of {', '.join(sorted(IMAGE_TYPES))}.",
                             param=f"{at}.image_url.url")

    def _assistant(self, message: dict[str, Any], where: str) -> list[dict[str, Any]]:
        blocks = self._text_blocks(self._texts(message.get("content"), f"{where}.content",
                                               refusals=True))
        for field in ("audio", "refusal"):
            if message.get(field) is not None:
                self.dropped.add(f"messages[].{field}")
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be an array.",
                                 param=f"{where}.tool_calls")
        for k, call in enumerate(calls):
            at = f"{where}.tool_calls[{k}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or call.get("type", "function") != "function":
                raise InvalidRequest(f"{at}: only function calls can be sent to Anthropic.",
                                     param=at)
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"{at}.function.name must be a string.",
                                     param=f"{at}.function.name")
            blocks.append({"type": "tool_use", "id": self._id(call.get("id"), f"{at}.id"),
                           "name": name, "input": _arguments(function.get("arguments"), at)})
        return blocks

    def _tool_result(self, message: dict[str, Any], where: str) -> dict[str, Any]:
        block: dict[str, Any] = {"type": "tool_result",
                                 "tool_use_id": self._id(message.get("tool_call_id"),
                                                         f"{where}.tool_call_id")}
        content = message.get("content")
        if isinstance(content, str):
            if content:
                block["content"] = content
        elif texts := self._text_blocks(self._texts(content, f"{where}.content")):
            block["content"] = texts
        return block

    def _id(self, found: Any, where: str) -> str:
        if not isinstance(found, str) or not found:
            raise InvalidRequest(f"{where} must be a non-empty string.", param=where)
        safe = _NOT_ID.sub("_", found)
        if safe != found:
            self.approximated.add("messages[].tool_calls[].id")
        return safe

    def _tools(self, body: dict[str, Any], out: dict[str, Any]) -> None:
        tools = body.get("tools")
        if not tools:
            if body.get("tool_choice") is not None:
                self.dropped.add("tool_choice")
            return
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array.", param="tools")
        out["tools"] = [self._tool(tool, f"tools[{k}]") for k, tool in enumerate(tools)]
        choice = _tool_choice(body.get("tool_choice"))
        if body.get("parallel_tool_calls") is False:
            choice = choice or {"type": "auto"}
            if choice["type"] != "none":
                choice["disable_parallel_tool_use"] = True
        if choice:
            out["tool_choice"] = choice

    def _tool(self, tool: Any, at: str) -> dict[str, Any]:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"{at}: only function tools can be sent to Anthropic.", param=at)
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"{at}.function.name must be 1 to 128 of [a-zA-Z0-9_-].",
                                 param=f"{at}.function.name")
        schema = function.get("parameters")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise InvalidRequest(f"{at}.function.parameters must be an object's JSON Schema.",
                                 param=f"{at}.function.parameters")
        entry: dict[str, Any] = {"name": name, "input_schema": {"type": "object", **schema}}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        if function.get("strict") is not None:
            self.dropped.add("tools[].function.strict")
        return entry

    def _format(self, found: Any, out: dict[str, Any]) -> None:
        kind = found.get("type") if isinstance(found, dict) else found
        if kind in (None, "text"):
            return
        if kind == "json_object":
            self.dropped.add("response_format")
            return
        schema = found.get("json_schema") if kind == "json_schema" else None
        if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
            raise InvalidRequest("'response_format' must be text, json_object or a json_schema "
                                 "with its schema.", param="response_format")
        out["output_config"] = {"format": {"type": "json_schema", "schema": schema["schema"]}}


def _tool_choice(choice: Any) -> dict[str, Any] | None:
    if choice is None:
        return None
    simple = {"auto": "auto", "none": "none", "required": "any"}.get(choice) \
        if isinstance(choice, str) else None
    if simple:
        return {"type": simple}
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and choice.get("type") == "function" \
            and isinstance(function.get("name"), str):
        return {"type": "tool", "name": function["name"]}
    raise InvalidRequest("'tool_choice' must be auto, none, required or a named function.",
                         param="tool_choice")


def _arguments(arguments: Any, at: str) -> dict[str, Any]:
    if arguments in (None, ""):
        return {}
    try:
        found = orjson.loads(arguments) if isinstance(arguments, str) else None
    except orjson.JSONDecodeError:
        found = None
    if not isinstance(found, dict):
        raise InvalidRequest(f"{at}.function.arguments must be a JSON object.",
                             param=f"{at}.function.arguments")
    return found
