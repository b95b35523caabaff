"""Anthropic's Messages API both ways, end to end over 127.0.0.1: the official ``anthropic``
SDK and the ``openai`` SDK each reach a Claude candidate (a fake of Anthropic's API) and an
OpenAI-style one, JSON, streams and tools; every request the proxy sends to the Claude
fake and every answer it writes on the Messages route is checked against Anthropic's own
spec (``vendor_specs``)."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import orjson
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from proxy.core.call.tokens import TokenCounter
from proxy.core.formats.sse import SseReader
from proxy.http.server.app import build_app

from .conftest import config_from
from .fake_anthropic import KEY, TOOL_USE, FakeAnthropic
from .fakes import TOOL_CALL, FakeUpstream
from .vendor_specs import problems

Factory = Callable[..., Awaitable[Any]]
ASK: list[Any] = [{"role": "user", "content": "Say hello"}]
WEATHER = {"name": "get_weather", "description": "The weather at a place",
           "input_schema": {"type": "object", "properties": {"location": {"type": "string"}},
                            "required": ["location"]}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place",
    "parameters": WEATHER["input_schema"]}}


@dataclass
class Rig:
    claude: FakeAnthropic
    gpt: FakeUpstream
    root: str  # the proxy's root URL (Anthropic's SDKs add /v1/messages)

    @property
    def v1(self) -> str:
        return self.root + "/v1"

    def anthropic(self, **options: Any) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.root, api_key="client-key",
                                        max_retries=0, **options)

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.v1, api_key="client-key", max_retries=0)


async def rig(aiohttp_server: Factory, counter: TokenCounter, *,
              claude: FakeAnthropic | None = None, gpt: FakeUpstream | None = None,
              slots: int = 2, **sections: Any) -> Rig:
    claude = claude or FakeAnthropic()
    gpt = gpt or FakeUpstream(words=["Hel", "lo", "!"])
    claude_server = await aiohttp_server(claude.app())
    gpt_server = await aiohttp_server(gpt.app())
    config = config_from(
        [{"name": "claude", "kind": "anthropic", "base_url": str(claude_server.make_url("")),
          "api_key": KEY, "max_concurrency": slots},
         {"name": "gpt", "base_url": str(gpt_server.make_url("/v1")), "api_key": "sk-up",
          "max_concurrency": 2}],
        {"claude-m": [{"provider": "claude", "model": "claude-sonnet-4-5"}],
         "gpt-m": [{"provider": "gpt", "model": "gpt-4o-mini"}],
         "either": [{"provider": "claude", "model": "claude-sonnet-4-5", "quality": 0.9},
                    {"provider": "gpt", "model": "gpt-4o-mini", "quality": 0.5}],
         **sections.pop("models", {})},
        **sections)
    proxy: TestServer = await aiohttp_server(build_app(config, counter=counter))
    return Rig(claude, gpt, str(proxy.make_url("")).rstrip("/"))


async def posted(url: str, body: dict[str, Any]) -> bytes:
    """What the proxy answers a POST of ``body``, as bytes (a stream whole)."""
    async with ClientSession() as session, session.post(url, json=body) as response:
        return await response.read()


def stream_problems(data: bytes) -> list[str]:
    """What breaks Anthropic's spec in a Messages stream's events."""
    reader = SseReader()
    found = []
    for event, payload in [*reader.feed(data), *reader.close()]:
        parsed = orjson.loads(payload)
        if parsed["type"] == "ping":  # in Anthropic's docs, not in its spec
            continue
        found += problems("anthropic", "MessageStreamEvent", parsed) if (
            parsed.get("type") != "error") else problems("anthropic", "ErrorResponse", parsed)
        assert event == parsed["type"].encode()
    return found


# --- the anthropic SDK to a Claude candidate: as sent ---------------------------------------

async def test_the_anthropic_sdk_reaches_claude_with_the_call_as_sent(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.anthropic(default_headers={"anthropic-beta": "prompt-caching-2024-07-31",
                                          "X-Priority": "high"})
    raw = await client.messages.with_raw_response.create(
        model="claude-m", max_tokens=64, messages=ASK, system="Be brief.",
        metadata={"user_id": "u-1"})
    message = await raw.parse()
    assert [b.text for b in message.content if b.type == "text"] == ["Hello!"]
    assert message.usage.input_tokens == 12 and message.usage.cache_read_input_tokens == 4
    assert raw.headers["x-proxy-tier"] == "high"
    assert raw.headers["request-id"] == raw.headers["x-request-id"]  # the proxy's, not the fake's
    assert raw.headers["x-upstream-request-id"] == "req_upstream"
    assert await raw.read() == r.claude.sent[0]  # the answer's bytes as they were
    seen = r.claude.seen[0]
    assert seen.body == {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": ASK,
                         "system": "Be brief.", "metadata": {"user_id": "u-1"}}
    assert seen.headers["x-api-key"] == KEY  # the provider's key, never the client's
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert "authorization" not in {k.lower() for k in seen.headers}
    assert r.claude.problems == []
    await client.close()


async def test_a_claude_stream_and_its_tool_call_pass_through_unchanged(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(script=deque(["ok", "tool"])))
    client = r.anthropic()
    async with client.messages.stream(model="claude-m", max_tokens=64, messages=ASK) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "Hello!" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3
    async with client.messages.stream(model="claude-m", max_tokens=64, messages=ASK,
                                      tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert [(c.id, c.name, c.input) for c in calls] == [
        (TOOL_USE["id"], "get_weather", {"location": "Paris"})]
    assert final.stop_reason == "tool_use"
    assert r.claude.problems == []
    await client.close()


async def test_claude_usage_counts_cache_reads_and_writes_as_prompt_tokens(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.anthropic()
    await client.messages.create(model="claude-m", max_tokens=64, messages=ASK)
    async with ClientSession() as session, session.get(r.root + "/metrics") as response:
        metrics = await response.text()
    # 12 uncached + 4 read from the cache + 2 written to it, twice: none left out of cost.
    assert 'proxy_tokens_total{kind="prompt",provider="claude"} 18.0' in metrics
    await client.close()


# --- the anthropic SDK to an OpenAI-style candidate: translated both ways -------------------

async def test_the_anthropic_sdk_reaches_an_openai_candidate_translated(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.anthropic()
    raw = await client.messages.with_raw_response.create(
        model="gpt-m", max_tokens=64, messages=ASK, system="Be brief.",
        stop_sequences=["END"])
    message = await raw.parse()
    assert [b.text for b in message.content if b.type == "text"] == ["Hello there!"]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3
    assert problems("anthropic", "Message", orjson.loads(await raw.read())) == []
    sent = r.gpt.seen[0].body
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Say hello"}]
    assert sent["max_completion_tokens"] == 64 and sent["stop"] == ["END"]
    assert problems("openai", "CreateChatCompletionRequest", sent) == []
    await client.close()


async def test_an_openai_stream_and_tool_call_come_back_as_a_messages_stream(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, gpt=FakeUpstream(words=["Hel", "lo", "!"],
                                                             script=deque(["ok", "tool"])))
    async with ClientSession() as session:
        for tools in ([], [WEATHER]):
            body = {"model": "gpt-m", "max_tokens": 64, "messages": ASK, "stream": True,
                    **({"tools": tools} if tools else {})}
            async with session.post(r.v1 + "/messages", json=body) as response:
                assert response.status == 200
                data = await response.read()
            assert stream_problems(data) == []
    client = r.anthropic()
    async with client.messages.stream(model="gpt-m", max_tokens=64, messages=ASK) as stream:
        text = "".join([piece async for piece in stream.text_stream])
    assert text == "Hello!"
    r.gpt.script.append("tool")
    async with client.messages.stream(model="gpt-m", max_tokens=64, messages=ASK,
                                      tools=[WEATHER]) as stream:
        final = await stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"location": "Paris"})]
    assert final.stop_reason == "tool_use"
    assert all(s.body.get("stream_options") == {"include_usage": True} for s in r.gpt.seen)
    assert r.gpt.seen[1].body["tools"] == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "The weather at a place",
                                          "parameters": WEATHER["input_schema"]}}]
    await client.close()


async def test_a_tool_result_turn_is_translated_for_an_openai_candidate(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.anthropic()
    await client.messages.create(model="gpt-m", max_tokens=64, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": TOOL_USE["id"],
                                      "content": "18 C and sunny"}]}])
    sent = r.gpt.seen[0].body["messages"]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {
        "location": "Paris"}
    assert sent[2] == {"role": "tool", "tool_call_id": TOOL_USE["id"],
                       "content": "18 C and sunny"}
    await client.close()


# --- the openai SDK to a Claude candidate: translated both ways -----------------------------

async def test_the_openai_sdk_reaches_claude_translated(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.openai()
    raw = await client.chat.completions.with_raw_response.create(
        model="claude-m", messages=[{"role": "system", "content": "Be brief."}, *ASK],
        stop=["END"], temperature=0.5)
    answer = raw.parse()
    assert answer.choices[0].message.content == "Hello!"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.prompt_tokens == 18  # 12 + 4 + 2
    assert answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 4
    assert problems("openai", "CreateChatCompletionResponse",
                    orjson.loads(raw.http_response.content)) == []
    assert raw.headers["x-proxy-approximated"] == "max_tokens"  # none sent: a default
    sent = r.claude.seen[0]
    assert sent.body["system"] == "Be brief." and sent.body["stop_sequences"] == ["END"]
    assert sent.body["max_tokens"] == 4096 and sent.body["model"] == "claude-sonnet-4-5"
    assert sent.headers["x-api-key"] == KEY
    assert r.claude.problems == []
    await client.close()


async def test_the_openai_sdk_streams_and_calls_tools_through_claude(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(script=deque(["ok", "tool",
                                                                             "tool"])))
    client = r.openai()
    stream = await client.chat.completions.create(
        model="claude-m", messages=ASK, max_tokens=50, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    answer = await client.chat.completions.create(
        model="claude-m", messages=ASK, tools=[CHAT_WEATHER], tool_choice="required")
    calls = answer.choices[0].message.tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in calls] == [(TOOL_USE["id"], "get_weather", {"location": "Paris"})]
    assert answer.choices[0].finish_reason == "tool_calls"
    assert r.claude.seen[1].body["tool_choice"] == {"type": "any"}
    stream = await client.chat.completions.create(
        model="claude-m", messages=[*ASK, {"role": "assistant", "tool_calls": [TOOL_CALL]},
                                    {"role": "tool", "tool_call_id": "call_abc123",
                                     "content": "18 C"}],
        tools=[CHAT_WEATHER], stream=True)
    chunks = [c async for c in stream]
    names = [t.function.name for c in chunks if c.choices
             for t in c.choices[0].delta.tool_calls or [] if t.function and t.function.name]
    assert names == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert r.claude.seen[2].body["messages"][2]["content"][0]["type"] == "tool_result"
    assert r.claude.problems == []
    await client.close()


# --- overload, throttling and failures ------------------------------------------------------

async def test_a_claude_529_falls_back_to_the_next_candidate_and_opens_no_breaker(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    claude = FakeAnthropic(default="529")
    r = await rig(aiohttp_server, counter, claude=claude)
    client = r.anthropic()
    for _ in range(6):  # more than the breaker's five failures in a row
        raw = await client.messages.with_raw_response.create(model="either", max_tokens=64,
                                                            messages=ASK)
        assert raw.headers["x-proxy-upstream"] == "gpt/gpt-4o-mini"
    assert len(claude.seen) >= 1
    async with ClientSession() as session, session.get(r.root + "/metrics") as response:
        metrics = await response.text()
    assert 'outcome="overloaded",provider="claude"' in metrics
    assert 'proxy_breaker_state{deployment="claude/claude-sonnet-4-5",provider="claude"} 0.0' in (
        metrics)
    await client.close()


async def test_every_candidate_overloaded_answers_in_the_clients_own_format(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(default="529"),
                  retry={"max_attempts": 1})
    with pytest.raises(anthropic.InternalServerError) as messages_error:
        await r.anthropic().messages.create(model="claude-m", max_tokens=64, messages=ASK)
    assert messages_error.value.status_code == 529
    assert messages_error.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(openai.APIStatusError) as chat_error:
        await r.openai().chat.completions.create(model="claude-m", messages=ASK)
    assert chat_error.value.status_code == 529
    assert chat_error.value.code == "overloaded_error"


async def test_a_claude_stream_error_reaches_each_client_as_its_own_error_event(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(default="stream_error"))
    body = {"model": "claude-m", "max_tokens": 64, "messages": ASK, "stream": True}
    passed = await posted(r.v1 + "/messages", body)
    translated = await posted(r.v1 + "/chat/completions", body)
    assert passed == r.claude.sent[0]  # Anthropic's own error event, nothing after it
    assert stream_problems(passed) == []
    events = [line for line in translated.split(b"\n\n") if line]
    assert orjson.loads(events[-1][6:])["error"]["code"] == "overloaded_error"
    assert b"[DONE]" not in translated


async def test_a_cut_claude_stream_ends_in_an_anthropic_error_event(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(default="cut"))
    data = await posted(r.v1 + "/messages", {"model": "claude-m", "max_tokens": 64,
                                             "messages": ASK, "stream": True})
    assert stream_problems(data) == []
    assert data.endswith(b"\n\n") and b"event: error" in data.rsplit(b"\n\n", 2)[-2]
    with pytest.raises(anthropic.APIStatusError):
        async with r.anthropic().messages.stream(model="claude-m", max_tokens=64,
                                                 messages=ASK) as stream:
            await stream.get_final_message()


async def test_anthropic_rate_limit_headers_pause_the_provider_until_their_reset(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    import datetime

    reset = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1.5)
    claude = FakeAnthropic(reply_headers={
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z")})
    r = await rig(aiohttp_server, counter, claude=claude)
    client = r.anthropic()
    await client.messages.create(model="claude-m", max_tokens=64, messages=ASK)
    claude.reply_headers.clear()
    raw = await client.messages.with_raw_response.create(model="claude-m", max_tokens=64,
                                                        messages=ASK)
    assert int(raw.headers["x-proxy-queue-ms"]) >= 900  # waited for the reset, then went
    await client.close()


async def test_a_claude_429_waits_for_its_retry_after_and_goes_again(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(script=deque(["429"])))
    raw = await r.anthropic().messages.with_raw_response.create(
        model="claude-m", max_tokens=64, messages=ASK)
    assert (await raw.parse()).content[0].text == "Hello!"
    assert int(raw.headers["x-proxy-queue-ms"]) >= 900 and len(r.claude.seen) == 2


# --- the Messages route: errors, count_tokens, tiers, the cache -----------------------------

async def test_errors_on_the_messages_route_are_in_anthropics_shape(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, classify={"keys": [{"name": "app",
                                                               "key": "app-key"}]})
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await r.anthropic().messages.create(model="claude-m", max_tokens=64, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"
    assert auth.value.request_id is not None
    client = anthropic.AsyncAnthropic(base_url=r.root, api_key="app-key", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="nope", max_tokens=64, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    async with ClientSession(headers={"x-api-key": "app-key"}) as session:
        for body, status in (({"model": "claude-m", "messages": ASK}, 400),
                             ({"model": "claude-m", "max_tokens": 5, "messages": []}, 400),
                             (b"{not json", 400)):
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with session.post(r.v1 + "/messages", **kwargs) as response:
                answer = await response.json()
                assert response.status == status
                assert response.headers["request-id"] == response.headers["x-request-id"]
            assert problems("anthropic", "ErrorResponse", answer) == []
            assert answer["error"]["type"] == "invalid_request_error"
        async with session.post(r.v1 + "/messages/batches", json={}) as response:
            assert response.status == 404
            assert (await response.json())["error"]["type"] == "not_found_error"
    await client.close()


async def test_count_tokens_answers_a_local_count_for_a_known_model(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    client = r.anthropic()
    short = await client.messages.count_tokens(model="claude-m", messages=ASK)
    longer = await client.messages.count_tokens(model="claude-m", messages=ASK,
                                                system="You are a careful assistant. " * 20,
                                                tools=[WEATHER])
    assert 0 < short.input_tokens < longer.input_tokens
    assert r.claude.seen == []  # answered by the proxy, never sent
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.count_tokens(model="claude-m", messages=[])
    await client.close()


async def test_messages_calls_are_ordered_by_tier_like_chat_calls(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    claude = FakeAnthropic(hold_s=0.2)
    r = await rig(aiohttp_server, counter, claude=claude, slots=1)
    client = r.anthropic()

    async def ask(priority: str, text: str) -> None:
        await client.messages.create(model="claude-m", max_tokens=8, messages=[
            {"role": "user", "content": text}], extra_headers={"X-Priority": priority})

    first = asyncio.create_task(ask("normal", "first"))  # holds the one slot a while
    await asyncio.sleep(0.05)
    waiting = [asyncio.create_task(ask(p, p)) for p in ("low", "normal", "critical", "high")]
    await asyncio.gather(first, *waiting)
    order = [s.body["messages"][0]["content"] for s in claude.seen]
    assert order == ["first", "critical", "high", "normal", "low"]
    await client.close()


async def test_a_deterministic_messages_call_is_served_from_the_cache_json_and_stream(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, models={
        "cached": {"cache": {"ttl_s": 60},
                   "candidates": [{"provider": "claude", "model": "claude-sonnet-4-5"}]}})
    client = r.anthropic()
    first = await client.messages.with_raw_response.create(
        model="cached", max_tokens=64, messages=ASK, extra_body={"temperature": 0})
    again = await client.messages.with_raw_response.create(
        model="cached", max_tokens=64, messages=ASK, extra_body={"temperature": 0})
    assert first.headers["x-proxy-cache"] == "miss" and again.headers["x-proxy-cache"] == "hit"
    assert await again.read() == await first.read()
    async with client.messages.stream(model="cached", max_tokens=64, messages=ASK,
                                      extra_body={"temperature": 0}) as stream:
        text = "".join([piece async for piece in stream.text_stream])
    assert text == "Hello!" and len(r.claude.seen) == 1
    await client.close()


async def test_calls_claude_cannot_take_go_only_where_they_can_or_are_refused(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter)
    async with ClientSession() as session:
        body = {"model": "claude-m", "input": "Say hello"}
        async with session.post(r.v1 + "/responses", json=body) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "model"
        async with session.post(r.v1 + "/responses", json={**body, "model": "either"}) as (
                response):
            assert response.status == 200  # the candidate that speaks it
            assert response.headers["x-proxy-upstream"] == "gpt/gpt-4o-mini"
        async with session.post(r.v1 + "/embeddings",
                                json={"model": "claude-m", "input": "x"}) as response:
            assert response.status == 400
    assert r.claude.seen == []


async def test_a_chat_stream_translated_from_claude_is_valid_by_openais_spec(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(script=deque(["ok", "tool"])))
    async with ClientSession() as session:
        for tools in ([], [CHAT_WEATHER]):
            body = {"model": "claude-m", "messages": ASK, "stream": True,
                    "stream_options": {"include_usage": True},
                    **({"tools": tools} if tools else {})}
            async with session.post(r.v1 + "/chat/completions", json=body) as response:
                data = await response.read()
            chunks = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
            assert chunks[-1] == b"[DONE]"
            for chunk in chunks[:-1]:
                assert problems("openai", "CreateChatCompletionStreamResponse",
                                orjson.loads(chunk)) == []


async def test_a_claude_4xx_reaches_a_chat_client_in_openais_shape_and_garbage_falls_back(
        aiohttp_server: Factory, counter: TokenCounter) -> None:
    r = await rig(aiohttp_server, counter, claude=FakeAnthropic(script=deque(["400",
                                                                             "garbage"])))
    client = r.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="claude-m", messages=ASK)
    assert "at least one message is required" in refused.value.message
    assert refused.value.code == "invalid_request_error"
    raw = await client.chat.completions.with_raw_response.create(model="either",
                                                                messages=ASK)
    assert raw.headers["x-proxy-upstream"] == "gpt/gpt-4o-mini"  # after the garbage
    assert "x-proxy-approximated" not in raw.headers  # the Claude attempt's, not this one's
    assert len(r.claude.seen) == 2
    await client.close()
