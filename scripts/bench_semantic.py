"""The semantic cache's hit rate on a paraphrase set, and the latency a miss adds.

    .venv/bin/python scripts/bench_semantic.py [--calls 200]

In one process, on 127.0.0.1: a fake chat upstream that answers at once, the tests'
bag-of-words embeddings upstream (``tests/semantic_fake.py``: deterministic, stop words left
out, so a paraphrase with the same content words has similarity 1 and one with a word more
about 0.8), and the proxy. The hit rate says what the proxy does with such vectors (the
threshold, the scope), not how well a real embedding model groups paraphrases. For each
threshold: each question of ``SET`` is asked once (a miss that fills the cache), then its
paraphrases (a hit is a paraphrase answered from the cache) and the unrelated questions
(a hit there is a wrong answer). Then ``--calls`` distinct questions, one at a time, to the
model with the cache and to the same model without: the difference is what a miss adds
(the embedding through the proxy's own queue, and the search). With ``--redis URL``, also
the lag of the entries shared through Redis: 200 adds on one replica, the time until the
other has each."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy.config import parse_config  # noqa: E402
from proxy.config.state import StateSettings  # noqa: E402
from proxy.http.call.service import SERVICE  # noqa: E402
from proxy.http.server.app import build_app  # noqa: E402
from tests.fakes import FakeUpstream  # noqa: E402
from tests.semantic_fake import EmbeddingFake  # noqa: E402

# (question, paraphrases, unrelated questions that share words with it)
SET: list[tuple[str, list[str], list[str]]] = [
    ("What is the capital of France?",
     ["what's the capital of france", "Tell me the capital of France, please.",
      "What is the capital city of France?"], ["What is the capital of Spain?"]),
    ("How do I reset my password?",
     ["how can I reset my password", "Reset password: how do I do it?",
      "How do I reset my account password?"], ["How do I change my email?"]),
    ("What are your opening hours?",
     ["opening hours?", "What are the opening hours", "When are you open?"],
     ["What are your prices?"]),
    ("How long does shipping to Germany take?",
     ["how long does shipping to germany take", "Shipping to Germany: how long does it take?",
      "How many days does shipping to Germany take?"],
     ["How long does shipping to Italy take?"]),
    ("Can I return a product after 30 days?",
     ["can i return a product after 30 days", "Return a product after 30 days: can I?",
      "Is it possible to return a product after 30 days?"],
     ["Can I return a product after 60 days?"]),
    ("Which payment methods do you accept?",
     ["payment methods accepted?", "Which payment methods are accepted",
      "What payment options do you accept?"], ["Which currencies do you accept?"]),
    ("How do I cancel my subscription?",
     ["how do i cancel my subscription", "Cancel subscription: how?",
      "How can I end my subscription?"], ["How do I upgrade my subscription?"]),
    ("What is the largest country in Europe?",
     ["the largest country in europe?", "Which is the biggest country in Europe?",
      "What is the largest nation in Europe?"], ["What is the largest country in Asia?"]),
]


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def proxy(chat_url: str, embed_url: str, threshold: float) -> tuple[web.AppRunner, str]:
    candidates = [{"provider": "p", "model": "up"}]
    config = parse_config({
        "providers": [{"name": "p", "base_url": chat_url + "/v1", "api_key": "sk",
                       "max_concurrency": 64},
                      {"name": "e", "base_url": embed_url + "/v1", "api_key": "sk",
                       "max_concurrency": 64}],
        "models": {"m": {"candidates": candidates, "semantic_cache": {
                       "embedding_model": "emb", "threshold": threshold}},
                   "plain": candidates, "emb": [{"provider": "e", "model": "bow"}]},
    }, {})
    app = build_app(config)
    runner, url = await serve(app)
    app[SERVICE].semantic.listening(url)
    return runner, url


async def ask(session: aiohttp.ClientSession, url: str, model: str, text: str) -> str:
    body: dict[str, Any] = {"model": model, "temperature": 0,
                            "messages": [{"role": "user", "content": text}]}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        await response.read()
        assert response.status == 200, response.status
        return response.headers.get("x-proxy-cache", "")


async def hit_rate(session: aiohttp.ClientSession, url: str) -> tuple[int, int, int, int]:
    hits = paraphrases = wrong = unrelated = 0
    for question, similar, others in SET:
        await ask(session, url, "m", question)
        for text in similar:
            paraphrases += 1
            hits += await ask(session, url, "m", text) == "semantic"
        for text in others:
            unrelated += 1
            wrong += await ask(session, url, "m", text) == "semantic"
    return hits, paraphrases, wrong, unrelated


async def latency(session: aiohttp.ClientSession, url: str, model: str, calls: int,
                  tag: str) -> list[float]:
    took = []
    for i in range(calls):
        started = time.perf_counter()
        await ask(session, url, model, f"question {tag} {i} about topic {i * 7919 % 1000}")
        took.append((time.perf_counter() - started) * 1000)
    return took


async def main(calls: int) -> None:
    fake, embeddings = FakeUpstream(), EmbeddingFake()
    chat_runner, chat_url = await serve(fake.app())
    embed_runner, embed_url = await serve(embeddings.app())
    async with aiohttp.ClientSession() as session:
        for threshold in (0.95, 0.85, 0.75):
            runner, url = await proxy(chat_url, embed_url, threshold)
            hits, paraphrases, wrong, unrelated = await hit_rate(session, url)
            print(f"threshold {threshold}: {hits}/{paraphrases} paraphrases answered from "
                  f"the cache ({hits / paraphrases:.0%}), {wrong}/{unrelated} unrelated "
                  f"questions answered wrongly")
            await runner.cleanup()
        runner, url = await proxy(chat_url, embed_url, 0.95)
        await latency(session, url, "m", 20, "warm")
        await latency(session, url, "plain", 20, "warm")
        cached, plain = [], []
        for round_ in range(4):  # interleaved, so a busy moment hits both alike
            cached += await latency(session, url, "m", calls // 4, f"c{round_}")
            plain += await latency(session, url, "plain", calls // 4, f"p{round_}")
        await runner.cleanup()

    def q(values: list[float], at: float) -> float:
        return statistics.quantiles(values, n=100)[int(at) - 1]

    print(f"a miss, {len(cached)} calls each: p50 {q(cached, 50):.2f} ms with the semantic "
          f"cache, {q(plain, 50):.2f} ms without (+{q(cached, 50) - q(plain, 50):.2f} ms); "
          f"p90 {q(cached, 90):.2f} vs {q(plain, 90):.2f} ms")
    await chat_runner.cleanup()
    await embed_runner.cleanup()


async def lag(url: str, adds: int = 200) -> None:
    from proxy.state.shared import RedisState
    from proxy.state.shared_semantic import Bounds, SharedSemantic
    settings = StateSettings(backend="redis", url=url, prefix=f"bench-{uuid.uuid4().hex[:8]}")
    one, two = RedisState(settings, "one"), RedisState(settings, "two")
    seen: dict[bytes, float] = {}
    sender = SharedSemantic(one, lambda model, shared: None)
    tailer = SharedSemantic(two, lambda model, shared: seen.setdefault(
        shared.answer, time.perf_counter()))
    for shared in (sender, tailer):
        shared.configure({"m": Bounds(1000, 60)})
    await asyncio.sleep(0.3)
    sent = {}
    for i in range(adds):
        answer = f'{{"i":{i}}}'.encode()
        sent[answer] = time.perf_counter()
        sender.add("m", b"s" * 32, [random.random() for _ in range(1536)], answer, "p/up", 1, 1)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    lags = [(seen[a] - sent[a]) * 1000 for a in sent if a in seen]
    cuts = statistics.quantiles(lags, n=100)
    print(f"shared through Redis: {len(lags)}/{adds} seen by the other replica, "
          f"p50 {cuts[49]:.2f} ms, p99 {cuts[98]:.2f} ms after the add")
    await sender.close()
    await tailer.close()
    await one.client.delete(settings.prefix + ":semantic:m")
    await one.client.aclose()
    await two.client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--redis", help="e.g. redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    asyncio.run(main(args.calls))
    if args.redis:
        asyncio.run(lag(args.redis))
