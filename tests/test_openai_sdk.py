"""End to end with the official openai SDK as the client, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.core.call.tokens import TokenCounter
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello"}]


async def servers(aiohttp_server: Factory, counter: TokenCounter, **sections: Any) -> tuple[
    str, str
]:
    upstream = await aiohttp_server(FakeUpstream(words=["Hel", "lo", "!"]).app())
    upstream_url = str(upstream.make_url("/v1"))
    config = config_from(
        [{"name": "up", "base_url": upstream_url, "api_key": "sk-up", "max_concurrency": 2}],
        {"gpt-test": [{"provider": "up", "model": "gpt-test"}]},
        **sections,
    )
    proxy: TestServer = await aiohttp_server(build_app(config, counter=counter))
    return upstream_url, str(proxy.make_url("/v1"))


def sync_calls(base_url: str) -> tuple[str, str, openai.types.chat.ChatCompletion]:
    client = openai.OpenAI(base_url=base_url, api_key="anything", max_retries=0)
    whole = client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    stream = client.chat.completions.create(model="gpt-test", messages=MESSAGES, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return whole.choices[0].message.content or "", streamed, whole


async def test_sync_sdk_sees_the_same_content_through_the_proxy(
    aiohttp_server: Factory, counter: TokenCounter
) -> None:
    upstream_url, proxy_url = await servers(aiohttp_server, counter)
    direct = await asyncio.to_thread(sync_calls, upstream_url)
    proxied = await asyncio.to_thread(sync_calls, proxy_url)
    assert proxied[:2] == direct[:2] == ("Hello there!", "Hello!")
    assert proxied[2].model_dump() == direct[2].model_dump()


async def test_async_sdk_streaming_and_priority_headers(
    aiohttp_server: Factory, counter: TokenCounter
) -> None:
    _, proxy_url = await servers(aiohttp_server, counter)
    client = openai.AsyncOpenAI(base_url=proxy_url, api_key="anything", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=MESSAGES, extra_headers={"X-Priority": "critical"}
    )
    assert raw.headers["x-proxy-tier"] == "critical"
    assert raw.parse().choices[0].message.content == "Hello there!"
    flex = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=MESSAGES, service_tier="flex"
    )
    assert flex.headers["x-proxy-tier"] == "low"
    stream = await client.chat.completions.create(
        model="gpt-test", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    await client.close()


async def test_proxy_errors_surface_as_sdk_exceptions_with_the_request_id(
    aiohttp_server: Factory, counter: TokenCounter
) -> None:
    _, proxy_url = await servers(
        aiohttp_server, counter,
        classify={"keys": [{"name": "app", "key": "good-key"}]},
    )
    client = openai.AsyncOpenAI(base_url=proxy_url, api_key="good-key", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    assert missing.value.request_id and missing.value.request_id.startswith("req_")
    bad_key = openai.AsyncOpenAI(base_url=proxy_url, api_key="bad-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        await bad_key.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert denied.value.code == "invalid_api_key"
    await client.close()
    await bad_key.close()


async def test_sdk_against_the_simulated_provider_chat_and_embeddings(
    aiohttp_server: Factory, counter: TokenCounter
) -> None:
    config = config_from(
        [{"name": "sim", "kind": "simulated", "max_concurrency": 2,
          "simulate": {"ttft_s": 0.01, "tokens_per_s": 500}}],
        {"small": [{"provider": "sim", "model": "sim-small"}]},
    )
    proxy: TestServer = await aiohttp_server(build_app(config, counter=counter))
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="x", max_retries=0)
    reply = await client.chat.completions.create(model="small", messages=MESSAGES, max_tokens=5)
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    stream = await client.chat.completions.create(
        model="small", messages=MESSAGES, max_tokens=5, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == reply.choices[0].message.content
    # The SDK asks for base64 by default (as the Node SDK does) and decodes it: the numbers
    # are the provider's, whichever encoding was asked for.
    vectors = await client.embeddings.create(model="small", input=["a", "b"])
    floats = await client.embeddings.create(model="small", input=["a", "b"],
                                            encoding_format="float")
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 8
    for decoded, given in zip(vectors.data, floats.data, strict=True):
        assert decoded.embedding == pytest.approx(given.embedding, abs=1e-6)
    assert vectors.data[0].embedding != vectors.data[1].embedding
    raw = await client.embeddings.with_raw_response.create(
        model="small", input="a", encoding_format="base64")
    assert isinstance(orjson.loads(raw.content)["data"][0]["embedding"], str)
    await client.close()
