"""Upstream latency and time-to-first-token histograms per provider, deployment and public
model, and rejections counted by code (429s included)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]


def samples(client: Client, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = client.app[SERVICE].metrics.render().decode()
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


async def test_latency_and_ttft_are_observed_per_deployment_and_model(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.3, chunk_delay_s=0.2)
    server = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "p", "base_url": str(server.make_url("/v1")), "api_key": "sk"}],
        {"fast": [{"provider": "p", "model": "up"}], "other": [{"provider": "p",
                                                                 "model": "up"}]},
        classify={"keys": [{"name": "app", "key": "k", "rpm": 2}]})
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    headers = {"Authorization": "Bearer k"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert (await client.post("/v1/chat/completions", headers=headers,
                              json={**chat, "model": "fast"})).status == 200
    resp = await client.post("/v1/chat/completions", headers=headers,
                             json={**chat, "model": "other", "stream": True})
    await resp.read()
    labels = (("deployment", "p/up"), ("model", "fast"), ("provider", "p"))
    latency = samples(client, "proxy_upstream_latency_seconds_sum")
    assert 0.3 <= latency[labels] < 2.0
    other = (("deployment", "p/up"), ("model", "other"), ("provider", "p"))
    assert latency[other] >= 0.4  # the whole stream: its chunks come 0.2 s apart
    ttft = samples(client, "proxy_upstream_ttft_seconds_count")
    assert ttft == {other: 1.0}  # streams only
    assert samples(client, "proxy_upstream_ttft_seconds_sum")[other] < latency[other]
    # The key's rpm refuses the third call: a 429 counted as a rejection.
    assert (await client.post("/v1/chat/completions", headers=headers,
                              json={**chat, "model": "fast"})).status == 429
    assert samples(client, "proxy_rejections_total") == {
        (("code", "rate_limit_exceeded"), ("tier", "normal")): 1.0}
