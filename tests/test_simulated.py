"""The built-in simulated provider, the first thing a newcomer tries: bounded whatever a
client asks."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import orjson

from proxy.core.health.provider import SimSettings, Timeouts
from proxy.http.upstream.simulated import SimulatedUpstream
from proxy.http.upstream.upstream import UpstreamRequest

FAST = SimSettings(ttft_s=0.0, tokens_per_s=1e9, max_output_tokens=3000)


def request(max_tokens: int, stream: bool) -> UpstreamRequest:
    body = {"model": "x", "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}
    return UpstreamRequest("/chat/completions", orjson.dumps(body), "x", stream, {})


async def test_an_absurd_max_tokens_stops_at_the_models_own_limit() -> None:
    sim = SimulatedUpstream("sim", FAST)
    answer = orjson.loads(await (await sim.send(request(2**62, False), Timeouts())).read())
    assert answer["usage"]["completion_tokens"] == 3000
    assert sim.active == 0


async def test_a_stream_is_generated_as_it_goes() -> None:
    """Even a model allowed 10 million output tokens starts at once, in bounded memory."""
    sim = SimulatedUpstream("sim", SimSettings(ttft_s=0.0, tokens_per_s=1e6,
                                               max_output_tokens=10**7))
    response = await sim.send(request(2**62, True), Timeouts())
    tracemalloc.start()
    chunks = response.chunks()
    for _ in range(50):
        assert (await anext(chunks)).startswith(b"data: ")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    await chunks.aclose()
    assert peak < 4 * 1024 * 1024 and sim.active == 0


async def test_an_answer_takes_ttft_and_a_token_time_per_token_streamed_or_whole() -> None:
    """What the simulator counts a call to take: a stream's first token after ttft, one
    every 1 / tokens_per_s, its end one token after the last (it ended a token early), and
    timers' slack not added up over the tokens."""
    loop = asyncio.get_running_loop()
    for settings, tokens in ((SimSettings(ttft_s=0.05, tokens_per_s=10), 5),
                             (SimSettings(ttft_s=0.0, tokens_per_s=1000), 300)):
        expected = settings.ttft_s + tokens / settings.tokens_per_s
        sim = SimulatedUpstream("sim", settings)
        for stream in (True, False):
            begun = loop.time()
            response = await sim.send(request(tokens, stream), Timeouts())
            if stream:
                chunks = response.chunks()
                await anext(chunks)
                assert loop.time() - begun < settings.ttft_s + 0.02
                async for _ in chunks:
                    pass
            else:
                await response.read()
            assert expected - 0.005 <= loop.time() - begun <= expected + 0.05, stream


async def test_embeddings_take_text_or_tokens_one_input_or_several() -> None:
    """As OpenAI's API reads ``input``: a list of integers is one input given as tokens
    (what LangChain's OpenAIEmbeddings sends when it counts tokens itself)."""
    sim = SimulatedUpstream("sim", FAST)

    async def embed(given: object) -> dict[str, Any]:
        body = orjson.dumps({"model": "x", "input": given})
        answer = await sim.send(UpstreamRequest("/embeddings", body, "x", False, {}), Timeouts())
        return dict(orjson.loads(await answer.read()))

    tokens = await embed([64, 65, 66])
    assert len(tokens["data"]) == 1 and tokens["usage"]["prompt_tokens"] == 3
    several = await embed([[64, 65, 66], [1, 2]])
    assert len(several["data"]) == 2 and several["usage"]["prompt_tokens"] == 5
    assert several["data"][0]["embedding"] == tokens["data"][0]["embedding"]
    assert len((await embed(["a", "b"]))["data"]) == 2
    assert len((await embed("a"))["data"]) == 1
    assert (await embed([]))["data"] == []
