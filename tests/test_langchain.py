"""langchain-openai, a second Python client, against the real ``serve``: ``ChatOpenAI``
invoked and streamed (sync and async, with tools bound) and ``OpenAIEmbeddings``.

Nothing may download at run time: each test refuses every name looked up that is not
loopback and fails if one was asked for. ``OpenAIEmbeddings`` would fetch tiktoken's
``cl100k_base`` to count tokens (the project ships its own copy under another name): with
``check_embedding_ctx_length=False`` it sends the text as it is, as it should to any server
that is not OpenAI's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from functools import reduce
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from .serving import serving

CONFIG = """
classify:
  keys: [{name: app, key: app-key}]
providers:
  - name: sim
    kind: simulated
    max_concurrency: 4
    simulate: {ttft_s: 0.01, tokens_per_s: 500}
models:
  m: [{provider: sim, model: sim-small}]
"""
FIVE_WORDS = "lorem ipsum dolor sit amet "  # what the simulated provider writes, a word a token
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TRACING = ("LANGSMITH_TRACING", "LANGSMITH_TRACING_V2", "LANGCHAIN_TRACING",
           "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One ``serve`` for the module (it takes a second and a half to start)."""
    config = tmp_path_factory.mktemp("langchain") / "routing.yaml"
    config.write_text(CONFIG)
    with asyncio.Runner() as runner:
        running = serving(config)
        base, _ = runner.run(running.__aenter__())
        try:
            yield base + "/v1"
        finally:
            runner.run(running.__aexit__(None, None, None))


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names looked up beyond loopback, each refused (LangSmith tracing off, too)."""
    asked: list[str] = []
    lookup = socket.getaddrinfo

    def loopback_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name not in LOOPBACK:
            asked.append(name)
            raise socket.gaierror(socket.EAI_NONAME, f"no network in this test: {name}")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    for variable in TRACING:
        monkeypatch.delenv(variable, raising=False)
    return asked


def chat(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="app-key", model="m",  # type: ignore[arg-type]
                      max_tokens=5, max_retries=0, timeout=20, stream_usage=True,
                      include_response_headers=True)


def merged(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    return reduce(lambda a, b: a + b, chunks)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def test_chat_invoke_and_stream(base_url: str, refused: list[str]) -> None:
    model = chat(base_url)
    reply = model.invoke("Say hello")
    assert reply.content == FIVE_WORDS
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.response_metadata["model_name"] == "sim-small"
    assert reply.response_metadata["headers"]["x-proxy-upstream"] == "sim/sim-small"
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] == 5
    chunks = list(model.stream("Say hello"))
    assert len(chunks) > 2
    whole = merged(chunks)
    assert whole.content == FIVE_WORDS
    # stream_usage: the proxy relays include_usage's last chunk, which LangChain reads.
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 5
    assert whole.usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert refused == []


async def test_chat_async_with_tools_bound_and_in_parallel(
        base_url: str, refused: list[str]) -> None:
    model = chat(base_url)
    with_tools = model.bind_tools([get_weather])
    reply = await with_tools.ainvoke("Weather in Paris?")
    assert reply.content == FIVE_WORDS and reply.tool_calls == []  # the sim only writes
    streamed = merged([chunk async for chunk in with_tools.astream("Weather in Paris?")])
    assert streamed.content == FIVE_WORDS and streamed.tool_call_chunks == []
    replies = await model.abatch([f"question {i}" for i in range(4)])
    assert [r.content for r in replies] == [FIVE_WORDS] * 4
    assert refused == []


async def test_embeddings_are_the_providers_numbers(base_url: str, refused: list[str]) -> None:
    embeddings = OpenAIEmbeddings(base_url=base_url, api_key="app-key",  # type: ignore[arg-type]
                                  model="m", check_embedding_ctx_length=False, max_retries=0)
    documents = await asyncio.to_thread(embeddings.embed_documents, ["a", "b"])
    query = await asyncio.to_thread(embeddings.embed_query, "a")
    awaited = await embeddings.aembed_documents(["a", "b"])
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="app-key", max_retries=0)
    given = await sdk.embeddings.create(model="m", input=["a", "b"], encoding_format="float")
    await sdk.close()
    assert len(documents) == 2 and all(len(vector) == 8 for vector in documents)
    for got, floats in zip(documents, given.data, strict=True):
        assert got == pytest.approx(floats.embedding, abs=1e-6)
    assert query == documents[0] and awaited == documents
    assert documents[0] != documents[1]
    assert refused == []
