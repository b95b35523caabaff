"""The rest of the OpenAI surface through the same classification, scheduling and routing:
the Responses API (with ``previous_response_id`` affinity), legacy Completions and
``GET /v1/models/{id}``, end to end with the official SDK, streaming and not."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.config import parse_config
from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]


async def start(aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
                *fakes: FakeUpstream, **sections: Any) -> Client:
    servers = [await aiohttp_server(f.app()) for f in fakes]
    providers = [{"name": f"p{i}", "base_url": str(s.make_url("/v1")), "api_key": "sk",
                  "max_concurrency": 4} for i, s in enumerate(servers)]
    config = config_from(providers, {"m": [{"provider": p["name"], "model": f"up{i}"}
                                           for i, p in enumerate(providers)]}, **sections)
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    return client


def sdk(client: Client, key: str = "k") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key,
                              max_retries=0)


def tokens(client: Client) -> str:
    return client.app[SERVICE].metrics.render().decode()


async def simulated(aiohttp_client: Factory, counter: TokenCounter) -> Client:
    config = parse_config({
        "providers": [{"name": "sim", "kind": "simulated",
                       "simulate": {"ttft_s": 0.0, "tokens_per_s": 2000}}],
        "models": {"m": [{"provider": "sim", "model": "small"}]},
    }, {})
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    return client


@pytest.mark.parametrize("where", ["simulated", "fake"])
async def test_the_responses_api_works_unchanged_for_the_sdk(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, where: str
) -> None:
    client = (await simulated(aiohttp_client, counter) if where == "simulated" else
              await start(aiohttp_server, aiohttp_client, counter, FakeUpstream()))
    api = sdk(client)
    raw = await api.responses.with_raw_response.create(
        model="m", input="Say hello", max_output_tokens=3,
        extra_headers={"X-Priority": "high"})
    whole = raw.parse()
    assert raw.headers["x-proxy-tier"] == "high" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 3
    stream = await api.responses.create(model="m", input=[{"role": "user", "content": "Hi"}],
                                        instructions="Be brief.", max_output_tokens=3,
                                        stream=True)
    deltas, completed = [], None
    async for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and "".join(deltas) == completed.output_text
    metrics = tokens(client)
    provider = "sim" if where == "simulated" else "p0"
    assert f'proxy_tokens_total{{kind="completion",provider="{provider}"}} 6.0' in metrics
    assert 'proxy_requests_total{status="200",tier="normal"} 1.0' in metrics


@pytest.mark.parametrize("where", ["simulated", "fake"])
async def test_legacy_completions_work_unchanged_for_the_sdk(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter, where: str
) -> None:
    fake = FakeUpstream()
    client = (await simulated(aiohttp_client, counter) if where == "simulated" else
              await start(aiohttp_server, aiohttp_client, counter, fake))
    api = sdk(client)
    whole = await api.completions.create(model="m", prompt="Once upon", max_tokens=3)
    assert whole.choices[0].text and whole.usage is not None
    stream = await api.completions.create(model="m", prompt=["Once", "upon"], max_tokens=3,
                                          stream=True)
    chunks = [c async for c in stream]
    assert all(c.choices for c in chunks)  # the usage chunk the proxy asked for is hidden
    assert "".join(c.choices[0].text for c in chunks)
    if where == "fake":
        assert fake.seen[1].body["stream_options"] == {"include_usage": True}
    assert "completion" in tokens(client)


async def test_a_response_is_continued_where_it_lives(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    # p0 fails the first call, so p1 holds its response; p0 is first in the route again
    # afterwards, but the continuation can only be served by p1.
    first, second = FakeUpstream(script=deque(["500"])), FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, first, second)
    api = sdk(client)
    opened = await api.responses.create(model="m", input="Remember 7")
    assert opened.id in second.answers
    for stream in (False, True):
        follow = await api.responses.with_raw_response.create(
            model="m", input="What number?", previous_response_id=opened.id, stream=stream)
        assert follow.headers["x-proxy-upstream"] == "p1/up1"
        if stream:
            async for _ in follow.parse():
                pass
    assert [s.body.get("previous_response_id") for s in second.seen][1:] == [opened.id] * 2
    fresh = await api.responses.with_raw_response.create(model="m", input="New topic")
    assert fresh.headers["x-proxy-upstream"] == "p0/up0"
    streamed = await api.responses.create(model="m", input="x", stream=True)
    async for event in streamed:
        if event.type == "response.created":
            created = event.response.id
    continued = await api.responses.with_raw_response.create(
        model="m", input="y", previous_response_id=created)
    assert continued.headers["x-proxy-upstream"] == "p0/up0"  # learned from the stream


async def test_a_continuation_whose_home_is_down_takes_the_normal_route(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    first, second = FakeUpstream(script=deque(["500"])), FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, first, second)
    opened = await sdk(client).responses.create(model="m", input="x")
    service = client.app[SERVICE]
    breaker = service.engine.fleet.breakers["p1/up1"]
    for _ in range(5):  # the default consecutive_failures
        breaker.on_failure(service.clock.now())
    assert breaker.down(service.clock.now())
    follow = await sdk(client).responses.with_raw_response.create(
        model="m", input="y", previous_response_id=opened.id)
    assert follow.headers["x-proxy-upstream"] == "p0/up0"


async def test_a_responses_stream_cut_before_its_last_event_ends_with_an_error(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":' \
        b'"resp_1","object":"response","status":"in_progress"}}\n\n'
    client = await start(aiohttp_server, aiohttp_client, counter,
                         FakeUpstream(raw_stream=[created]))
    resp = await client.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})
    text = (await resp.read()).decode()
    last = [e for e in text.split("\n\n") if e][-1]
    assert orjson.loads(last.removeprefix("data: "))["error"]["code"] == "upstream_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "input": "x", "background": True, "stream": True}, "stream"),
    ({"model": "m", "input": 7}, "input"),
    ({"model": "m", "input": "x", "instructions": ["a"]}, "instructions"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "previous_response_id": 5}, "previous_response_id"),
])
async def test_bad_responses_bodies_are_400s(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
    body: dict[str, Any], param: str,
) -> None:
    fake = FakeUpstream()
    client = await start(aiohttp_server, aiohttp_client, counter, fake)
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": ""})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    assert fake.seen == []


async def test_a_model_can_be_retrieved_by_id(
    aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter
) -> None:
    client = await start(aiohttp_server, aiohttp_client, counter, FakeUpstream(),
                         classify={"keys": [{"name": "app", "key": "app-key"}]})
    model = await sdk(client, "app-key").models.retrieve("m")
    assert model.id == "m" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await sdk(client, "app-key").models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        await sdk(client, "wrong").models.retrieve("m")
