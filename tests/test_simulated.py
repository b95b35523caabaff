"""The built-in simulated provider, the first thing a newcomer tries: bounded whatever a
client asks."""

from __future__ import annotations

import tracemalloc

import orjson

from proxy.core.provider import SimSettings, Timeouts
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
