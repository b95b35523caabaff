"""Request bodies between Chat Completions and Anthropic Messages: the docs' requests both
ways, what is refused, and for any valid request (by its owner's spec) a translation valid
by the other's spec, or an InvalidRequest naming the field."""

from __future__ import annotations

import contextlib
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.errors import InvalidRequest
from proxy.core.formats.chat_to_messages import to_messages
from proxy.core.formats.events import Translation
from proxy.core.formats.messages_to_chat import to_chat

from .vendor_specs import problems

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+A8AAQUBAScY42YAAAAASUVORK5CYII="
IMAGE_URL = ("https://upload.wikimedia.org/wikipedia/commons/thumb/d/dd/"
             "Gfp-wisconsin-madison-the-nature-boardwalk.jpg/2560px-Gfp-wisconsin-madison-the-"
             "nature-boardwalk.jpg")
WEATHER = {"type": "object", "properties": {"location": {"type": "string"}},
           "required": ["location"]}

# Chat requests from https://platform.openai.com/docs/api-reference/chat/create (examples
# "Default", "Image input", "Functions") and the function calling guide's conversation
# (https://platform.openai.com/docs/guides/function-calling), each with its translation.
TO_MESSAGES: list[tuple[dict[str, Any], Translation]] = [
    ({"model": "gpt-5.4", "messages": [
        {"role": "developer", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"}]},
     Translation({"model": "gpt-5.4", "max_tokens": 4096, "system": "You are a helpful assistant.",
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]},
                 approximated=("max_tokens",))),
    ({"model": "gpt-5.4", "max_tokens": 300, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What's in this image?"},
        {"type": "image_url", "image_url": {"url": IMAGE_URL}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}",
                                            "detail": "low"}}]}]},
     Translation({"model": "gpt-5.4", "max_tokens": 300, "messages": [{"role": "user", "content": [
         {"type": "text", "text": "What's in this image?"},
         {"type": "image", "source": {"type": "url", "url": IMAGE_URL}},
         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                      "data": PNG}}]}]},
                 dropped=("messages[].content[].image_url.detail",))),
    ({"model": "gpt-4o-mini", "max_completion_tokens": 50, "temperature": 1.5, "top_p": 0.9,
      "stop": ["\n\n", "END"], "user": "user-1234", "stream": True,
      "stream_options": {"include_usage": True}, "seed": 7, "logprobs": True,
      "parallel_tool_calls": False, "tool_choice": "auto",
      "messages": [{"role": "user", "content": "What's the weather like in Boston today?"}],
      "tools": [{"type": "function", "function": {
          "name": "get_current_weather", "description": "Get the current weather",
          "parameters": WEATHER, "strict": True}}]},
     Translation({"model": "gpt-4o-mini", "max_tokens": 50, "temperature": 1, "top_p": 0.9,
                  "stop_sequences": ["END"], "metadata": {"user_id": "user-1234"},
                  "stream": True, "messages": [{"role": "user", "content": [
                      {"type": "text", "text": "What's the weather like in Boston today?"}]}],
                  "tools": [{"name": "get_current_weather", "input_schema": WEATHER,
                             "description": "Get the current weather"}],
                  "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
                 dropped=("logprobs", "seed", "tools[].function.strict"),
                 approximated=("stop", "temperature"))),
    ({"model": "gpt-4.1", "max_tokens": 100, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris and Bogotá?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_12345xyz", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location":"Paris, France"}'}},
            {"id": "call.67890", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location":"Bogotá"}'}}]},
        {"role": "tool", "tool_call_id": "call_12345xyz", "content": "16°C"},
        {"role": "tool", "tool_call_id": "call.67890",
         "content": [{"type": "text", "text": "24°C"}]},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Thanks!", "name": "ana"},
        {"role": "assistant", "content": "Les voici: "}],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
     Translation({"model": "gpt-4.1", "max_tokens": 100, "system": "Be brief.\nAnswer in French.",
                  "messages": [
                      {"role": "user", "content": [
                          {"type": "text", "text": "Weather in Paris and Bogotá?"}]},
                      {"role": "assistant", "content": [
                          {"type": "tool_use", "id": "call_12345xyz", "name": "get_weather",
                           "input": {"location": "Paris, France"}},
                          {"type": "tool_use", "id": "call_67890", "name": "get_weather",
                           "input": {"location": "Bogotá"}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "call_12345xyz",
                           "content": "16°C"},
                          {"type": "tool_result", "tool_use_id": "call_67890",
                           "content": [{"type": "text", "text": "24°C"}]},
                          {"type": "text", "text": "Thanks!"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Les voici:"}]}],
                  "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                  "tool_choice": {"type": "tool", "name": "get_weather"},
                  "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}},
                 dropped=("messages[].name",),
                 approximated=("messages[].content", "messages[].role",
                               "messages[].tool_calls[].id"))),
]

# Messages requests from https://docs.claude.com/en/api/messages (the request example), the
# tool use docs (https://docs.claude.com/en/docs/agents-and-tools/tool-use/implement-tool-use),
# prompt caching's system blocks and vision's base64 image, each with its translation.
TO_CHAT: list[tuple[dict[str, Any], Translation]] = [
    ({"model": "claude-opus-4-6", "max_tokens": 1024,
      "messages": [{"role": "user", "content": "Hello, world"}]},
     Translation({"model": "claude-opus-4-6", "max_completion_tokens": 1024,
                  "messages": [{"role": "user", "content": "Hello, world"}]})),
    ({"model": "claude-opus-4-6", "max_tokens": 1024, "stream": True, "top_k": 5,
      "stop_sequences": ["a", "b", "c", "d", "e"], "metadata": {"user_id": "u-1"},
      "thinking": {"type": "enabled", "budget_tokens": 2048},
      "system": [{"type": "text", "text": "You are a weather bot.",
                  "cache_control": {"type": "ephemeral"}}],
      "tools": [{"name": "get_weather", "description": "Get the current weather",
                 "input_schema": WEATHER, "cache_control": {"type": "ephemeral"}}],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
      "messages": [
          {"role": "user", "content": [
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": PNG}},
              {"type": "text", "text": "What's the weather in San Francisco?"}]},
          {"role": "assistant", "content": [
              {"type": "thinking", "thinking": "Let me check.", "signature": "sig"},
              {"type": "text", "text": "I'll check the current weather in San Francisco."},
              {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
               "input": {"location": "San Francisco, CA"}}]},
          {"role": "user", "content": [
              {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
               "content": [{"type": "text", "text": "15 degrees"}], "is_error": False},
              {"type": "text", "text": "And tomorrow?"}]}]},
     Translation({"model": "claude-opus-4-6", "max_completion_tokens": 1024, "stream": True,
                  "stream_options": {"include_usage": True}, "stop": ["a", "b", "c", "d"],
                  "user": "u-1",
                  "tools": [{"type": "function", "function": {
                      "name": "get_weather", "parameters": WEATHER,
                      "description": "Get the current weather"}}],
                  "tool_choice": "required", "parallel_tool_calls": False,
                  "messages": [
                      {"role": "system", "content": "You are a weather bot."},
                      {"role": "user", "content": [
                          {"type": "image_url",
                           "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                          {"type": "text", "text": "What's the weather in San Francisco?"}]},
                      {"role": "assistant",
                       "content": "I'll check the current weather in San Francisco.",
                       "tool_calls": [{"id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
                                       "function": {"name": "get_weather", "arguments":
                                                    '{"location":"San Francisco, CA"}'}}]},
                      {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9",
                       "content": "15 degrees"},
                      {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]},
                 dropped=("cache_control", "messages[].content[] (thinking)",
                          "messages[].content[].is_error", "thinking", "tools[].cache_control",
                          "top_k"),
                 approximated=("stop_sequences",))),
]


@pytest.mark.parametrize(("chat", "translation"), TO_MESSAGES,
                         ids=["default", "images", "tools", "conversation"])
def test_chat_requests_become_messages_requests(chat: dict[str, Any],
                                                translation: Translation) -> None:
    assert problems("openai", "CreateChatCompletionRequest", chat) == []
    assert to_messages(chat) == translation
    assert problems("anthropic", "CreateMessageParams", translation.body) == []


@pytest.mark.parametrize(("messages", "translation"), TO_CHAT, ids=["basic", "tools"])
def test_messages_requests_become_chat_requests(messages: dict[str, Any],
                                                translation: Translation) -> None:
    assert problems("anthropic", "CreateMessageParams", messages) == []
    assert to_chat(messages) == translation
    assert problems("openai", "CreateChatCompletionRequest", translation.body) == []


HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": HELLO, "n": 2}, "n"),
    ({"model": "m", "messages": HELLO, "functions": [{"name": "f"}]}, "functions"),
    ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AAAA"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"model": "m", "messages": HELLO, "tools": [{"type": "custom", "custom": {"name": "x"}}]},
     "tools[0]"),
    ({"model": "m", "messages": HELLO, "tools": [
        {"type": "function", "function": {"name": "a.b"}}]}, "tools[0].function.name"),
    ({"model": "m", "messages": [{"role": "system", "content": "only a system prompt"}]},
     "messages"),
])
def test_what_anthropic_cannot_take_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        to_messages(body)
    assert refused.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "max_tokens": 1, "messages": HELLO,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}, "messages[0].content[0]"),
    ({"model": "m", "max_tokens": 1.5, "messages": HELLO}, "max_tokens"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].role"),
])
def test_what_chat_cannot_take_is_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        to_chat(body)
    assert refused.value.param == param


# Generated requests: every feature the translators read, drawn within each owner's spec.
NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,20}", fullmatch=True)
IDS = st.from_regex(r"(call|toolu)_[a-zA-Z0-9]{1,12}", fullmatch=True)
TEXT = st.text(max_size=30)
SOME_TEXT = st.text(min_size=1, max_size=30)
SCHEMA = st.sampled_from([WEATHER, {"type": "object", "properties": {}},
                          {"properties": {"n": {"type": "integer"}}}])
ARGS = st.dictionaries(NAMES, st.integers(-(2**53), 2**53) | TEXT, max_size=3)
IMAGE = st.sampled_from([IMAGE_URL, f"data:image/png;base64,{PNG}",
                         f"data:image/jpeg;base64,{PNG}"])


def _chat_text(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return text | st.lists(st.builds(lambda t: {"type": "text", "text": t}, text),
                           min_size=1, max_size=2)


CHAT_TOOL_CALL = st.builds(
    lambda id_, name, args: {"id": id_, "type": "function",
                             "function": {"name": name, "arguments": args}},
    IDS, NAMES, ARGS.map(lambda a: orjson.dumps(a).decode()) | st.just(""))
CHAT_MESSAGE = st.one_of(
    st.builds(lambda role, content: {"role": role, "content": content},
              st.sampled_from(["system", "developer"]), _chat_text(TEXT)),
    st.builds(lambda content: {"role": "user", "content": content}, st.one_of(
        _chat_text(TEXT), st.lists(st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, TEXT),
            st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, IMAGE)),
            min_size=1, max_size=3))),
    st.builds(lambda content, calls: {"role": "assistant", "content": content,
                                      **({"tool_calls": calls} if calls else {})},
              st.none() | _chat_text(TEXT), st.lists(CHAT_TOOL_CALL, max_size=2)),
    st.builds(lambda id_, content: {"role": "tool", "tool_call_id": id_, "content": content},
              IDS, _chat_text(TEXT)),
)
CHAT_TOOL = st.builds(
    lambda name, schema, description: {"type": "function", "function": {
        "name": name, "parameters": schema, **({"description": description} if description
                                                else {})}},
    NAMES, SCHEMA, st.none() | TEXT)
CHAT_REQUEST = st.fixed_dictionaries(
    {"model": NAMES, "messages": st.lists(CHAT_MESSAGE, min_size=1, max_size=6)},
    optional={
        "max_tokens": st.integers(1, 10_000), "max_completion_tokens": st.integers(1, 10_000),
        "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "stream": st.booleans(),
        "stop": TEXT | st.lists(TEXT, min_size=1, max_size=4), "user": TEXT,
        "tools": st.lists(CHAT_TOOL, min_size=1, max_size=3),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | NAMES.map(
            lambda n: {"type": "function", "function": {"name": n}}),
        "parallel_tool_calls": st.booleans(), "seed": st.integers(0, 99),
        "presence_penalty": st.floats(-2, 2), "logprobs": st.booleans(),
        "response_format": st.sampled_from([
            {"type": "text"}, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}]),
    })

MESSAGES_TEXT = st.builds(lambda t: {"type": "text", "text": t}, SOME_TEXT)
MESSAGES_IMAGE = st.sampled_from([
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
    {"type": "image", "source": {"type": "url", "url": IMAGE_URL}}])
MESSAGES_MESSAGE = st.one_of(
    st.builds(lambda content: {"role": "user", "content": content}, SOME_TEXT | st.lists(
        st.one_of(MESSAGES_TEXT, MESSAGES_IMAGE, st.builds(
            lambda id_, content, error: {"type": "tool_result", "tool_use_id": id_,
                                         "content": content, "is_error": error},
            IDS, TEXT | st.lists(MESSAGES_TEXT | MESSAGES_IMAGE, max_size=2), st.booleans())),
        min_size=1, max_size=3)),
    st.builds(lambda content: {"role": "assistant", "content": content}, SOME_TEXT | st.lists(
        st.one_of(MESSAGES_TEXT, st.builds(
            lambda id_, name, args: {"type": "tool_use", "id": id_, "name": name, "input": args},
            IDS, NAMES, ARGS), st.builds(
            lambda t: {"type": "thinking", "thinking": t, "signature": "sig"}, TEXT)),
        min_size=1, max_size=3)),
)
MESSAGES_REQUEST = st.fixed_dictionaries(
    {"model": NAMES, "max_tokens": st.integers(1, 10_000),
     "messages": st.lists(MESSAGES_MESSAGE, min_size=1, max_size=6)},
    optional={
        "system": SOME_TEXT | st.lists(MESSAGES_TEXT, min_size=1, max_size=2),
        "temperature": st.floats(0, 1), "top_p": st.floats(0, 1), "top_k": st.integers(0, 50),
        "stream": st.booleans(), "stop_sequences": st.lists(SOME_TEXT, max_size=6),
        "metadata": st.builds(lambda u: {"user_id": u}, SOME_TEXT),
        "tools": st.lists(st.builds(
            lambda name, schema: {"name": name, "input_schema": {"type": "object", **schema}},
            NAMES, SCHEMA), min_size=1, max_size=3),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                        {"type": "auto", "disable_parallel_tool_use": True}])
        | NAMES.map(lambda n: {"type": "tool", "name": n}),
        "thinking": st.just({"type": "enabled", "budget_tokens": 2048}),
        "output_config": st.just({"format": {"type": "json_schema", "schema": WEATHER}}),
    })
PROPERTY = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(CHAT_REQUEST)
def test_any_valid_chat_request_becomes_a_valid_messages_request(chat: dict[str, Any]) -> None:
    assert problems("openai", "CreateChatCompletionRequest", chat) == []
    try:
        translation = to_messages(chat)
    except InvalidRequest as refused:
        # Only a conversation that is all system prompt and blank text has nothing to send.
        assert refused.param == "messages", refused
        return
    assert problems("anthropic", "CreateMessageParams", translation.body) == []


@PROPERTY
@given(MESSAGES_REQUEST)
def test_any_valid_messages_request_becomes_a_valid_chat_request(body: dict[str, Any]) -> None:
    assert problems("anthropic", "CreateMessageParams", body) == []
    try:
        translation = to_chat(body)
    except InvalidRequest as refused:
        # Only a conversation that is all thinking has nothing to send.
        assert refused.param == "messages", refused
        return
    assert problems("openai", "CreateChatCompletionRequest", translation.body) == []


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(
                        ["role", "content", "type", "text", "tool_calls", "function", "name",
                         "arguments", "id", "image_url", "url", "source", "input", "tool_use_id",
                         "tool_call_id", "input_schema", "parameters"]), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(
    ["model", "messages", "max_tokens", "stop", "stop_sequences", "tools", "tool_choice",
     "system", "temperature", "user", "metadata", "response_format", "n"]), JSON))
def test_any_body_translates_or_is_refused_as_a_bad_request(body: dict[str, Any]) -> None:
    for translate in (to_messages, to_chat):
        with contextlib.suppress(InvalidRequest):
            translate(body)


@pytest.mark.parametrize(("chat", "anthropic"), [
    ("auto", {"type": "auto"}), ("none", {"type": "none"}), ("required", {"type": "any"}),
    ({"type": "function", "function": {"name": "f"}}, {"type": "tool", "name": "f"})])
def test_tool_choice_both_ways(chat: Any, anthropic: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    sent = to_messages({"model": "m", "messages": HELLO, "tools": tools, "tool_choice": chat})
    assert sent.body["tool_choice"] == anthropic
    back = to_chat({"model": "m", "max_tokens": 1, "messages": HELLO, "tool_choice": anthropic,
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert back.body["tool_choice"] == chat
