"""The semantic cache: which calls it may answer and what must match exactly (pure), the
store's nearest neighbour, TTL and bound on a fake time, and over real sockets with the
openai SDK: a paraphrase answered without a slot (JSON and stream), another key, tools
and images bypassed, the threshold, the embedding model down."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.config import ConfigError
from proxy.core.caching.questions import Question, band, may_answer_from_past, question
from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app
from proxy.state import vectors
from proxy.state.vectors import VectorStore

from .conftest import config_from
from .fakes import FakeUpstream
from .redis_server import free_port
from .semantic_fake import EmbeddingFake, embed

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
ASK = "What is the capital of France?"
PARAPHRASE = "Please tell me: what's the capital of france"
NEAR = "What is the capital city of France?"  # one content word more: similarity 0.82
OTHER = "What is the capital of Spain?"


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


# -- which calls, and what must match exactly -------------------------------------------

@pytest.mark.parametrize(("body", "headers", "expected"), [
    ({"temperature": 0}, {}, True), ({"seed": 3}, {}, True), ({"temperature": 0.7}, {}, False),
    ({}, {"x-proxy-cache": "semantic"}, True), ({}, {"x-proxy-cache": "exact"}, False),
])
def test_only_calls_that_may_be_answered_from_the_past(
        body: dict[str, Any], headers: dict[str, str], expected: bool) -> None:
    assert may_answer_from_past(body, headers) is expected


def scope(text: str, key: str = "app", **body: Any) -> bytes:
    found = question("chat", key, "m", {"messages": user(text), "temperature": 0, **body})
    assert isinstance(found, Question)
    return found.scope


def test_only_the_last_user_message_is_compared_the_rest_must_match() -> None:
    assert scope(ASK) == scope(OTHER)  # the question is not in the scope
    assert scope(ASK, stream=True, user="u") == scope(ASK)  # what never changes the answer
    assert scope(ASK, key="other") != scope(ASK)
    assert scope(ASK, max_tokens=5) != scope(ASK)
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    longer = question("chat", "app", "m", {"messages": [*earlier, *user(ASK)]})
    assert isinstance(longer, Question) and longer.text == ASK and longer.scope != scope(ASK)
    parts = question("chat", "app", "m", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": ASK}]}]})
    assert isinstance(parts, Question) and parts.text == ASK
    prompt = question("completions", "app", "m", {"prompt": ASK})
    assert isinstance(prompt, Question) and prompt.text == ASK


@pytest.mark.parametrize(("body", "reason"), [
    ({"messages": user(ASK), "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [*user(ASK), {"role": "assistant", "tool_calls": [{"id": "1"}]},
                   {"role": "tool", "content": "x"}, {"role": "user", "content": ASK}]},
     "tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": ASK},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}, "media"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]}, "media"),
    ({"messages": [*user(ASK), {"role": "assistant", "content": "Paris"}]}, "shape"),
    ({"messages": user("   ")}, "shape"),
    ({"messages": []}, "shape"),
])
def test_what_is_bypassed(body: dict[str, Any], reason: str) -> None:
    assert question("chat", "app", "m", body) == reason


def test_similarity_bands_are_fixed() -> None:
    assert [band(s) for s in (0.1, 0.5, 0.84, 0.949, 0.96, 0.99, 1.0)] == [
        "<0.5", "0.5-0.7", "0.8-0.85", "0.9-0.95", "0.95-0.98", "0.98-1", "0.98-1"]


# -- the store ----------------------------------------------------------------------------

def test_the_store_finds_the_nearest_in_the_scope_only() -> None:
    store: VectorStore[str] = VectorStore(max_entries=10, ttl_s=60)
    store.add(b"a", embed(ASK), "paris", 0.0)
    store.add(b"a", embed(OTHER), "madrid", 0.0)
    found = store.nearest(b"a", embed(PARAPHRASE), 1.0)
    assert found is not None and found[1] == "paris" and found[0] == pytest.approx(1.0, abs=1e-3)
    near = store.nearest(b"a", embed(NEAR), 1.0)
    assert near is not None and 0.8 < near[0] < 0.85
    assert store.nearest(b"b", embed(ASK), 1.0) is None  # another scope has nothing
    assert store.nearest(b"a", [0.0] * 256, 1.0) is None  # not a usable vector
    assert store.nearest(b"a", [1.0] * 8, 1.0) is None  # another dimension


def test_entries_expire_and_the_store_is_bounded_least_recently_used_first() -> None:
    store: VectorStore[str] = VectorStore(max_entries=2, ttl_s=10)
    store.add(b"s", embed("alpha"), "a", 0.0)
    store.add(b"s", embed("beta"), "b", 1.0)
    assert store.nearest(b"s", embed("beta"), 2.0, threshold=0.9) is not None  # a miss
    assert store.nearest(b"s", embed("alpha"), 2.0, threshold=0.9) is not None  # a hit
    store.add(b"s", embed("gamma"), "c", 3.0)  # full: beta, least recently used, goes
    assert len(store) == 2
    hit = store.nearest(b"s", embed("beta"), 3.0)
    assert hit is None or hit[0] < 0.5
    assert store.nearest(b"s", embed("alpha"), 9.0) is not None
    store.expire(10.0)  # alpha was added at 0: gone at 10, gamma stays until 13
    assert len(store) == 1 and store.nearest(b"s", embed("alpha"), 10.0) != (1.0, "a")
    assert store.nearest(b"s", embed("gamma"), 13.0) is None and len(store) == 0


def test_a_large_scope_is_searched_in_an_hnsw_index_and_entries_can_be_removed() -> None:
    rng = np.random.default_rng(5)
    count = vectors.SMALL + 50
    points = rng.standard_normal((count, 64)).astype(np.float32)
    store: VectorStore[int] = VectorStore(max_entries=10_000, ttl_s=60)
    ids = [store.add(b"s", points[i], i, 0.0) for i in range(count)]
    for i in (0, 7, vectors.SMALL + 10):
        found = store.nearest(b"s", points[i] + 0.01 * rng.standard_normal(64), 1.0)
        assert found is not None and found[1] == i and found[0] > 0.99
    first = ids[0]
    assert first is not None
    store.remove(first)
    found = store.nearest(b"s", points[0], 1.0)
    assert len(store) == count - 1 and found is not None and found[1] != 0


def test_bad_settings_are_config_errors() -> None:
    def parse(semantic: dict[str, Any]) -> None:
        config_from([{"name": "p", "kind": "simulated"}],
                    {"m": {"candidates": [{"provider": "p", "model": "x"}],
                           "semantic_cache": semantic},
                     "emb": [{"provider": "p", "model": "e"}]})

    parse({"embedding_model": "emb"})
    for semantic, message in [
        ({}, "semantic_cache.embedding_model: is required"),
        ({"embedding_model": "nope"}, "'nope' is not a model of this routing table"),
        ({"embedding_model": "emb", "threshold": 1.5}, "threshold: must be <= 1"),
        ({"embedding_model": "emb", "ttl_s": 0}, "ttl_s: must be a positive number"),
        ({"embedding_model": "emb", "max_entries": 0}, "max_entries: must be"),
        ({"embedding_model": "emb", "size": 1}, "semantic_cache.size: unknown key"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse(semantic)
        assert message in str(info.value)


# -- over real sockets ------------------------------------------------------------------

async def start(aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
                fake: FakeUpstream, embeddings: EmbeddingFake, exact: bool = False,
                slots: int = 1, tiers: list[dict[str, Any]] | None = None,
                **semantic: Any) -> Client:
    chat = await aiohttp_server(fake.app())
    embedder = await aiohttp_server(embeddings.app())
    candidates = [{"provider": "p", "model": "up", "input_cost": 1, "output_cost": 1}]
    config = config_from(
        [{"name": "p", "base_url": str(chat.make_url("/v1")), "api_key": "sk",
          "max_concurrency": slots},
         {"name": "e", "base_url": str(embedder.make_url("/v1")), "api_key": "sk"}],
        {"m": {"candidates": candidates, **({"cache": {"ttl_s": 60}} if exact else {}),
               "semantic_cache": {"embedding_model": "emb", **semantic}},
         "plain": candidates, "emb": [{"provider": "e", "model": "bow"}]},
        classify={"keys": [{"name": "app", "key": "app-key"},
                           {"name": "other", "key": "other-key"}]},
        **({"tiers": tiers} if tiers else {}))
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    client.app[SERVICE].semantic.listening(str(client.make_url("/")))
    return client


def sdk(client: Client, key: str = "app-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key,
                              max_retries=0)


def metric(client: Client, text: str) -> bool:
    return text in client.app[SERVICE].metrics.render().decode()


async def test_a_paraphrase_is_answered_from_the_cache_without_a_slot(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings)
    api = sdk(client)
    first = await api.chat.completions.with_raw_response.create(
        model="m", messages=user(ASK), temperature=0)
    assert first.headers.get("x-proxy-cache") == "miss" and len(fake.seen) == 1
    fake.hold_s = 2.0
    busy = asyncio.ensure_future(api.chat.completions.create(model="plain", messages=user(ASK)))
    await asyncio.sleep(0.2)
    assert client.app[SERVICE].scheduler.inflight("p") == 1  # the only slot is taken
    second = await api.chat.completions.with_raw_response.create(
        model="m", messages=user(PARAPHRASE), temperature=0)
    assert second.headers["x-proxy-cache"] == "semantic"
    assert float(second.headers["x-proxy-cache-similarity"]) >= 0.95
    assert second.parse().choices[0].message.content == "Hello there!"
    # Answered while the slot's 2 s call still holds it; the chat upstream saw one call.
    assert not busy.done() and len([s for s in fake.seen if s.body["model"] == "up"]) == 2
    stream = await api.chat.completions.create(
        model="m", messages=user(PARAPHRASE.upper()), temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert stream.response.headers["x-proxy-cache"] == "semantic"
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello there!")
    assert chunks[-1].usage is not None and not busy.done()
    await busy
    assert len(fake.seen) == 2 and embeddings.calls == 3
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="hit"} 2.0')
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="miss"} 1.0')
    assert metric(client, 'proxy_semantic_cache_nearest_total{band="0.98-1",model="m"} 2.0')
    assert metric(client, 'proxy_semantic_cache_entries{model="m"} 1.0')


async def test_another_key_a_far_question_or_a_near_miss_go_upstream(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         threshold=0.9)
    api = sdk(client)
    await api.chat.completions.create(model="m", messages=user(ASK), temperature=0)
    raw = await sdk(client, "other-key").chat.completions.with_raw_response.create(
        model="m", messages=user(PARAPHRASE), temperature=0)
    assert raw.headers["x-proxy-cache"] == "miss" and len(fake.seen) == 2
    for text in (OTHER, NEAR):  # 0.5 and 0.82: under the threshold
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=user(text), temperature=0)
        assert raw.headers["x-proxy-cache"] == "miss"
    assert len(fake.seen) == 4
    assert metric(client, 'proxy_semantic_cache_nearest_total{band="0.8-0.85",model="m"} 1.0')
    # Sampled calls are not looked up, unless the header asks.
    await api.chat.completions.create(model="m", messages=user(PARAPHRASE), temperature=0.7)
    assert len(fake.seen) == 5 and embeddings.calls == 4
    asking = {"x-proxy-cache": "semantic"}
    for text, outcome in ((PARAPHRASE, "miss"), (ASK, "semantic")):
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=user(text), temperature=0.7, extra_headers=asking)
        assert raw.headers["x-proxy-cache"] == outcome
    assert len(fake.seen) == 6 and embeddings.calls == 6


async def test_tools_and_images_bypass_the_cache(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings)
    api = sdk(client)
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    image: Any = [{"role": "user", "content": [
        {"type": "text", "text": ASK},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    for _ in range(2):
        await api.chat.completions.create(model="m", messages=user(ASK), temperature=0,
                                          tools=tools)
        await api.chat.completions.create(model="m", messages=image, temperature=0)
    assert len(fake.seen) == 4 and embeddings.calls == 0
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="bypass"} 4.0')
    assert metric(client, 'proxy_semantic_cache_entries{model="m"} 0.0')


async def test_the_embedding_model_down_is_a_plain_miss(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake(status=400)
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings)
    api = sdk(client)
    for _ in range(2):
        answer = await api.chat.completions.create(model="m", messages=user(ASK),
                                                   temperature=0)
        assert answer.choices[0].message.content == "Hello there!"
    assert len(fake.seen) == 2 and embeddings.calls == 2
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="error"} 2.0')
    embeddings.status = 200
    await api.chat.completions.create(model="m", messages=user(ASK), temperature=0)
    raw = await api.chat.completions.with_raw_response.create(
        model="m", messages=user(PARAPHRASE), temperature=0)
    assert raw.headers["x-proxy-cache"] == "semantic" and len(fake.seen) == 3


async def test_entries_expire_and_are_bounded_over_http(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         ttl_s=0.5, max_entries=2)
    api = sdk(client)

    async def ask(text: str) -> str:
        raw = await api.chat.completions.with_raw_response.create(
            model="m", messages=user(text), temperature=0)
        return raw.headers["x-proxy-cache"]

    assert [await ask(t) for t in ("alpha", "beta", "gamma", "gamma", "alpha")] == [
        "miss", "miss", "miss", "semantic", "miss"]
    assert metric(client, 'proxy_semantic_cache_entries{model="m"} 2.0')
    await asyncio.sleep(0.6)
    assert await ask("alpha") == "miss"


async def test_beside_the_response_cache(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         exact=True)
    api = sdk(client)

    async def ask(text: str) -> str:
        raw = await asyncio.wait_for(api.chat.completions.with_raw_response.create(
            model="m", messages=user(text), temperature=0), 5)
        return raw.headers["x-proxy-cache"]

    # The same question again is an exact hit (no embedding); a paraphrase a semantic one,
    # and asked again it does not wait for an exact-cache fetch that never went upstream.
    assert [await ask(t) for t in (ASK, ASK, PARAPHRASE, PARAPHRASE)] == [
        "miss", "hit", "semantic", "semantic"]
    assert len(fake.seen) == 1 and embeddings.calls == 3


async def test_two_identical_calls_at_once_go_upstream_once(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         exact=True, slots=4)
    api = sdk(client)
    fake.hold_s = 0.5  # both look up by meaning while neither has gone upstream yet
    answers = await asyncio.wait_for(asyncio.gather(*(
        api.chat.completions.with_raw_response.create(model="m", messages=user(ASK),
                                                      temperature=0) for _ in range(2))), 5)
    assert sorted(a.headers["x-proxy-cache"] for a in answers) == ["hit", "miss"]
    assert len(fake.seen) == 1
    assert {a.parse().choices[0].message.content for a in answers} == {"Hello there!"}


async def test_a_lower_threshold_answers_the_near_question(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         threshold=0.8)
    api = sdk(client)
    await api.chat.completions.create(model="m", messages=user(ASK), temperature=0)
    raw = await api.chat.completions.with_raw_response.create(
        model="m", messages=user(NEAR), temperature=0)
    assert raw.headers["x-proxy-cache"] == "semantic" and len(fake.seen) == 1
    assert 0.8 <= float(raw.headers["x-proxy-cache-similarity"]) < 0.85


async def test_a_slow_embedding_model_leaves_the_call_most_of_its_wait(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake(hold_s=30.0)
    tiers = [{"name": "critical", "max_wait_s": 8}, {"name": "normal", "max_wait_s": 8}]
    client = await start(aiohttp_server, aiohttp_client, counter, fake, embeddings,
                         tiers=tiers)
    started = asyncio.get_running_loop().time()
    raw = await sdk(client).chat.completions.with_raw_response.create(
        model="m", messages=user(ASK), temperature=0)
    took = asyncio.get_running_loop().time() - started
    # The call waits at most 8 s: the lookup gives up after a quarter of it (not 10 s).
    assert raw.parse().choices[0].message.content == "Hello there!" and 1.9 < took < 4.0
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="error"} 1.0')


async def test_an_unreachable_embedding_model_is_a_plain_miss(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream()
    chat = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "p", "base_url": str(chat.make_url("/v1")), "api_key": "sk"},
         {"name": "e", "base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key": "sk"}],
        {"m": {"candidates": [{"provider": "p", "model": "up"}],
               "semantic_cache": {"embedding_model": "emb"}},
         "emb": [{"provider": "e", "model": "bow"}]})
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    client.app[SERVICE].semantic.listening(str(client.make_url("/")))
    started = asyncio.get_running_loop().time()
    for _ in range(3):
        answer = await sdk(client).chat.completions.create(
            model="m", messages=user(ASK), temperature=0)
        assert answer.choices[0].message.content == "Hello there!"
    assert len(fake.seen) == 3 and asyncio.get_running_loop().time() - started < 8
    assert metric(client, 'proxy_semantic_cache_lookups_total{model="m",result="error"} 3.0')
