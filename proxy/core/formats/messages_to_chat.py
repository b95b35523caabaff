"""An Anthropic Messages request → a Chat Completions request (pure), and what was lost.

Translated, per field:

- ``model``, ``temperature``, ``top_p`` as they are; ``max_tokens`` →
  ``max_completion_tokens`` (``max_tokens`` is deprecated in Chat and refused by OpenAI's
  reasoning models); ``stop_sequences`` → ``stop`` (OpenAI takes at most 4: the first 4,
  approximated); ``stream`` → ``stream`` with ``stream_options.include_usage``, since an
  Anthropic stream always ends with its usage; ``metadata.user_id`` → ``user``.
- ``system`` (a string or text blocks) → a first ``system`` message; a ``system`` turn →
  a ``system`` message. User text and image blocks → parts (a base64 source → a data URL,
  a url source → its URL); user ``tool_result`` blocks → ``tool`` messages, put before the
  rest of their turn as Chat requires (their text; images in them dropped); assistant text
  → ``content``, ``tool_use`` blocks → ``tool_calls`` with their input as JSON arguments.
- ``tools`` (custom tools) → function tools (``input_schema`` → ``parameters``, ``strict``
  kept); ``tool_choice`` auto / any / tool / none → auto / required / a named function /
  none; ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``;
  ``output_config.format`` → ``response_format`` ``json_schema``.
- Dropped (listed): ``thinking``, ``top_k``, ``service_tier``, ``output_config.effort``,
  ``cache_control`` anywhere, ``is_error``, citations, ``thinking`` and
  ``redacted_thinking`` blocks, tools' ``input_examples`` and the like, and every other
  field (``container``, ``mcp_servers``, ``context_management``, ``inference_geo``, …).
- Refused (``InvalidRequest`` naming the field): server tools (web search, code
  execution, …) and their blocks, documents, search results, and anything not of the
  type Anthropic's spec says.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import InvalidRequest
from .events import Translation

MAX_STOP = 4  # OpenAI's limit on stop sequences
_HONOURED = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p",
    "stream", "tools", "tool_choice", "metadata", "output_config"})
_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "strict"})
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(body: dict[str, Any]) -> Translation:
    """The Chat request for a Messages request; raises InvalidRequest."""
    return _Translator().run(body)


class _Translator:
    def __init__(self) -> None:
        self.dropped: set[str] = set()
        self.approximated: set[str] = set()

    def run(self, body: dict[str, Any]) -> Translation:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("'model' must be a string.", param="model")
        out: dict[str, Any] = {"model": model, "messages": self._conversation(body)}
        if body.get("max_tokens") is not None:
            out["max_completion_tokens"] = _number(body, "max_tokens", int)
        for name in ("temperature", "top_p"):
            if body.get(name) is not None:
                out[name] = _number(body, name, float)
        self._stop(body.get("stop_sequences"), out)
        if body.get("stream") is True:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        metadata = body.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
            out["user"] = metadata["user_id"]
        self._tools(body, out)
        self._output(body.get("output_config"), out)
        self.dropped.update(name for name, found in body.items()
                            if name not in _HONOURED and found is not None)
        return Translation(out, tuple(sorted(self.dropped)), tuple(sorted(self.approximated)))

    def _stop(self, sequences: Any, out: dict[str, Any]) -> None:
        if sequences is None:
            return
        if not isinstance(sequences, list) or not all(isinstance(s, str) for s in sequences):
            raise InvalidRequest("'stop_sequences' must be an array of strings.",
                                 param="stop_sequences")
        if len(sequences) > MAX_STOP:
            self.approximated.add("stop_sequences")
        if sequences:
            out["stop"] = sequences[:MAX_STOP]

    def _conversation(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        system = body.get("system")
        if system:
            out.append({"role": "system", "content": self._text(system, "system")})
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise InvalidRequest(f"{where} must be an object.", param=where)
            role, content = message.get("role"), message.get("content")
            if role == "user":
                out += self._user(content, f"{where}.content")
            elif role == "assistant":
                out += self._assistant(content, f"{where}.content")
            elif role == "system":
                out.append({"role": "system", "content": self._text(content, where)})
            else:
                raise InvalidRequest(f"{where}.role must be user or assistant.",
                                     param=f"{where}.role")
        if not out:
            raise InvalidRequest("'messages' holds nothing a Chat upstream takes once thinking "
                                 "blocks are left out.", param="messages")
        return out

    def _blocks(self, content: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
        """(where, block) of a string or an array of blocks."""
        if isinstance(content, str):
            return [(where, {"type": "text", "text": content})]
        if not isinstance(content, list):
            raise InvalidRequest(f"{where} must be a string or an array.", param=where)
        found = []
        for j, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise InvalidRequest(f"{where}[{j}] must be a content block.",
                                     param=f"{where}[{j}]")
            if block.get("cache_control") is not None:
                self.dropped.add("cache_control")
            if block.get("citations") is not None:
                self.dropped.add("citations")
            found.append((f"{where}[{j}]", block))
        return found

    def _text(self, content: Any, where: str) -> str:
        """The text of a string or of text blocks (a system prompt, a system turn)."""
        texts = []
        for at, block in self._blocks(content, where):
            if block["type"] != "text" or not isinstance(block.get("text"), str):
                raise InvalidRequest(f"{at} must be a text block.", param=at)
            texts.append(block["text"])
        return "\n".join(texts)

    def _user(self, content: Any, where: str) -> list[dict[str, Any]]:
        if isinstance(content, str):
            return [{"role": "user", "content": content}]
        results: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        for at, block in self._blocks(content, where):
            kind = block["type"]
            if kind == "tool_result":
                results.append(self._tool_result(block, at))
            elif kind == "image":
                parts.append(self._image(block.get("source"), at))
            elif kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            else:
                raise InvalidRequest(f"{at}: a {kind!r} block cannot be sent to a Chat "
                                     "Completions upstream.", param=at)
        return results + ([{"role": "user", "content": parts}] if parts else [])

    def _image(self, source: Any, at: str) -> dict[str, Any]:
        kind = source.get("type") if isinstance(source, dict) else None
        if kind == "base64" and isinstance(source.get("media_type"), str) \
                and isinstance(source.get("data"), str):
            url = f"data:{source['media_type']};base64,{source['data']}"
        elif kind == "url" and isinstance(source.get("url"), str):
            url = source["url"]
        else:
            raise InvalidRequest(f"{at}.source must be a base64 or url image source.",
                                 param=f"{at}.source")
        return {"type": "image_url", "image_url": {"url": url}}

    def _tool_result(self, block: dict[str, Any], at: str) -> dict[str, Any]:
        tool_use_id = block.get("tool_use_id")
        if not isinstance(tool_use_id, str):
            raise InvalidRequest(f"{at}.tool_use_id must be a string.", param=f"{at}.tool_use_id")
        if block.get("is_error") is not None:
            self.dropped.add("messages[].content[].is_error")
        content = block.get("content", "")
        texts = []
        for inner, part in self._blocks(content, f"{at}.content"):
            if part["type"] == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif part["type"] == "image":
                self.dropped.add("messages[].content[].content[] (image)")
            else:
                raise InvalidRequest(f"{inner}: a {part['type']!r} block cannot be sent to a "
                                     "Chat Completions upstream.", param=inner)
        return {"role": "tool", "tool_call_id": tool_use_id, "content": "\n".join(texts)}

    def _assistant(self, content: Any, where: str) -> list[dict[str, Any]]:
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for at, block in self._blocks(content, where):
            kind = block["type"]
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use":
                calls.append(self._call(block, at))
            elif kind in ("thinking", "redacted_thinking"):
                self.dropped.add(f"messages[].content[] ({kind})")
            else:
                raise InvalidRequest(f"{at}: a {kind!r} block cannot be sent to a Chat "
                                     "Completions upstream.", param=at)
        if not texts and not calls:
            return []
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        return [message]

    def _call(self, block: dict[str, Any], at: str) -> dict[str, Any]:
        id_, name, arguments = block.get("id"), block.get("name"), block.get("input")
        if not (isinstance(id_, str) and isinstance(name, str) and isinstance(arguments, dict)):
            raise InvalidRequest(f"{at} must have a string id and name and an object input.",
                                 param=at)
        return {"id": id_, "type": "function",
                "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}

    def _tools(self, body: dict[str, Any], out: dict[str, Any]) -> None:
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise InvalidRequest("'tools' must be an array.", param="tools")
            out["tools"] = [self._tool(tool, f"tools[{k}]") for k, tool in enumerate(tools)]
        choice = body.get("tool_choice")
        if choice is None:
            return
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in _CHOICES:
            out["tool_choice"] = _CHOICES[kind]
        elif kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise InvalidRequest("'tool_choice' must be auto, any, tool or none.",
                                 param="tool_choice")
        if choice.get("disable_parallel_tool_use") is True and tools:
            out["parallel_tool_calls"] = False

    def _tool(self, tool: Any, at: str) -> dict[str, Any]:
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(f"{at}: the server tool {kind!r} cannot be sent to a Chat "
                                 "Completions upstream.", param=at)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise InvalidRequest(f"{at} must have a name and an input_schema.", param=at)
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        self.dropped.update(f"tools[].{field}" for field, found in tool.items()
                            if field not in _TOOL_FIELDS and found is not None)
        return {"type": "function", "function": function}

    def _output(self, config: Any, out: dict[str, Any]) -> None:
        if not isinstance(config, dict):
            return
        if config.get("effort") is not None:
            self.dropped.add("output_config.effort")
        found = config.get("format")
        if isinstance(found, dict) and isinstance(found.get("schema"), dict):
            out["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": found["schema"]}}


def _number(body: dict[str, Any], name: str, kind: type[int] | type[float]) -> int | float:
    found = body[name]
    if isinstance(found, bool) or not isinstance(found, int | float) \
            or (kind is int and not isinstance(found, int)):
        raise InvalidRequest(f"'{name}' must be a number{' (an integer)' * (kind is int)}.",
                             param=name)
    return found
