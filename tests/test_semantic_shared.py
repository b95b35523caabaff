"""The semantic cache with the redis backend: an answer kept on one replica answers a
paraphrase on another, a replica that starts later reads the live entries, Redis holds at
most ``max_entries`` per model, and Redis gone leaves each replica its own cache. And the
real ``serve`` in a subprocess, which tells the cache where it listens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream
from .redis_server import URL, PrivateRedis, prefixed
from .semantic_fake import EmbeddingFake
from .serving import serving
from .test_semantic import ASK, OTHER, PARAPHRASE, user

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]


@pytest.fixture
def prefix() -> Any:
    with prefixed() as (client, name):
        yield client, name


async def replica(aiohttp_client: Factory, counter: TokenCounter, chat: str, embedder: str,
                  state: dict[str, Any], max_entries: int = 100) -> Client:
    candidates = [{"provider": "p", "model": "up"}]
    config = config_from(
        [{"name": "p", "base_url": chat, "api_key": "sk", "max_concurrency": 4},
         {"name": "e", "base_url": embedder, "api_key": "sk"}],
        {"m": {"candidates": candidates, "semantic_cache": {
            "embedding_model": "emb", "max_entries": max_entries}},
         "emb": [{"provider": "e", "model": "bow"}]},
        state=state)
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    client.app[SERVICE].semantic.listening(str(client.make_url("/")))
    return client


@pytest.fixture
async def upstreams(aiohttp_server: Factory) -> AsyncIterator[tuple[FakeUpstream, str, str]]:
    fake = FakeUpstream()
    chat = await aiohttp_server(fake.app())
    embedder = await aiohttp_server(EmbeddingFake().app())
    yield fake, str(chat.make_url("/v1")), str(embedder.make_url("/v1"))


async def ask(client: Client, text: str) -> str:
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
    raw = await api.chat.completions.with_raw_response.create(
        model="m", messages=user(text), temperature=0)
    return raw.headers["x-proxy-cache"]


async def holds(client: Client, entries: int) -> None:
    """Until the replica's index holds ``entries`` (at most 5 s)."""
    for _ in range(100):
        if client.app[SERVICE].semantic.size("m") == entries:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{client.app[SERVICE].semantic.size('m')} entries, not {entries}")


async def test_an_answer_kept_on_one_replica_answers_on_the_others(
        aiohttp_client: Factory, counter: TokenCounter, prefix: Any,
        upstreams: tuple[FakeUpstream, str, str]) -> None:
    redis, name = prefix
    fake, chat, embedder = upstreams
    state = {"backend": "redis", "url": URL, "prefix": name}
    one = await replica(aiohttp_client, counter, chat, embedder, state, max_entries=2)
    two = await replica(aiohttp_client, counter, chat, embedder, state, max_entries=2)
    assert await ask(one, ASK) == "miss"
    await holds(two, 1)
    assert await ask(two, PARAPHRASE) == "semantic"
    assert len(fake.seen) == 1
    # A replica that starts later reads what is live.
    three = await replica(aiohttp_client, counter, chat, embedder, state, max_entries=2)
    await holds(three, 1)
    assert await ask(three, PARAPHRASE) == "semantic" and len(fake.seen) == 1
    # Redis holds at most max_entries per model.
    for text in (OTHER, "How do I reset my password?", "What are your opening hours?"):
        assert await ask(two, text) == "miss"
    await holds(one, 2)
    assert redis.xlen(f"{name}:semantic:m") == 2


async def test_without_redis_each_replica_keeps_its_own(
        aiohttp_client: Factory, counter: TokenCounter,
        upstreams: tuple[FakeUpstream, str, str]) -> None:
    fake, chat, embedder = upstreams
    server = PrivateRedis()
    server.start()
    try:
        state = {"backend": "redis", "url": server.url, "on_error": "local"}
        one = await replica(aiohttp_client, counter, chat, embedder, state)
        two = await replica(aiohttp_client, counter, chat, embedder, state)
        server.stop()
        assert await ask(one, ASK) == "miss"
        assert await ask(one, PARAPHRASE) == "semantic"  # its own cache still answers
        assert await ask(two, PARAPHRASE) == "miss" and len(fake.seen) == 2
        assert one.app[SERVICE].semantic.size("m") == 1
        rendered = one.app[SERVICE].metrics.render().decode()
        assert 'proxy_semantic_cache_shared_errors_total{operation="store"} 1.0' in rendered
        server.start()
        assert await ask(one, OTHER) == "miss"
        await holds(two, 2)  # the tail came back; what was kept since is shared
    finally:
        server.stop()


async def test_the_real_serve_answers_a_paraphrase_from_the_cache(
        tmp_path: Path, upstreams: tuple[FakeUpstream, str, str]) -> None:
    fake, chat, embedder = upstreams
    config = tmp_path / "routing.yaml"
    config.write_text(f"""
providers:
  - {{name: p, base_url: "{chat}", api_key: sk}}
  - {{name: e, base_url: "{embedder}", api_key: sk}}
models:
  m:
    semantic_cache: {{embedding_model: emb}}
    candidates: [{{provider: p, model: up}}]
  emb: [{{provider: e, model: bow}}]
""")
    async with serving(config) as (base, _):
        api = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        outcomes = []
        for text in (ASK, PARAPHRASE):
            raw = await api.chat.completions.with_raw_response.create(
                model="m", messages=user(text), temperature=0)
            outcomes.append(raw.headers["x-proxy-cache"])
    assert outcomes == ["miss", "semantic"] and len(fake.seen) == 1
