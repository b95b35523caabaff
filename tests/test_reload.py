"""Hot reload over real sockets: ``POST /admin/reload`` while calls stream and wait (none
fails), an invalid file refused with where it is wrong, state kept for what survives, and
SIGHUP on the real ``serve`` process."""

from __future__ import annotations

import asyncio
import hashlib
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.config import Provider, load_config
from proxy.core.call.tokens import TokenCounter
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app, default_upstream
from proxy.http.upstream.upstream import Upstream

from .fakes import FakeUpstream
from .serving import serving

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
ADMIN = {"X-Admin-Key": "adm1n"}


def table(upstream: str, **changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "admin": {"key": "adm1n"},
        "tiers": [{"name": "critical"}, {"name": "high"}, {"name": "normal"},
                  {"name": "low"}],
        "classify": {"default_tier": "normal", "keys": [
            {"name": "app", "key": "app-key", "tier": "high", "max_tier": "critical"},
            {"name": "batch", "key": "batch-key", "tier": "low"}]},
        "providers": [{"name": "p", "base_url": upstream, "api_key": "sk",
                       "max_concurrency": 1}],
        "models": {"m": [{"provider": "p", "model": "up"}]},
    }
    data.update(changes)
    return data


def write(path: Path, data: dict[str, Any] | str) -> str:
    text = data if isinstance(data, str) else yaml.safe_dump(data)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


async def failing_and_healthy(aiohttp_server: Factory, failures: int) -> tuple[
        FakeUpstream, list[str], list[dict[str, Any]]]:
    """Provider a answers 500 (its breaker opens after ``failures``), provider b answers:
    the failing fake, both URLs, both providers' config."""
    fakes = (FakeUpstream(default="500"), FakeUpstream())
    servers = [await aiohttp_server(f.app()) for f in fakes]
    urls = [str(s.make_url("/v1")) for s in servers]
    providers = [{"name": name, "base_url": url, "api_key": "sk",
                  "breaker": {"consecutive_failures": failures, "cooldown_s": 60}}
                 for name, url in zip(("a", "b"), urls, strict=True)]
    return fakes[0], urls, providers


async def start(aiohttp_client: Factory, counter: TokenCounter, path: Path) -> Client:
    client: Client = await aiohttp_client(build_app(load_config(path), counter=counter,
                                                    config_path=path))
    return client


async def chat(client: Client, key: str, model: str = "m", stream: bool = False,
               priority: str | None = None) -> tuple[int, bytes, str | None]:
    headers = {"Authorization": f"Bearer {key}"}
    if priority:
        headers["X-Priority"] = priority
    resp = await client.post("/v1/chat/completions", headers=headers, json={
        "model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    return resp.status, await resp.read(), resp.headers.get("x-proxy-tier")


async def reload(client: Client) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/admin/reload", headers=ADMIN)
    return resp.status, await resp.json()


async def status(client: Client) -> dict[str, Any]:
    resp = await client.get("/admin/status", headers=ADMIN)
    data: dict[str, Any] = await resp.json()
    return data


async def test_a_reload_fails_no_call_queued_or_in_flight(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    fake = FakeUpstream(chunk_delay_s=0.1, hold_s=0.3, words=["a", "b", "c", "d", "e"])
    server = await aiohttp_server(fake.app())
    upstream = str(server.make_url("/v1"))
    path = tmp_path / "routing.yaml"
    first = write(path, table(upstream))
    client = await start(aiohttp_client, counter, path)
    assert (await status(client))["config"]["version"] == first
    # One stream holds the only slot; calls of every tier wait behind it.
    calls = [asyncio.ensure_future(chat(client, "app-key", stream=True))]
    await asyncio.sleep(0.1)
    calls += [asyncio.ensure_future(chat(client, key, priority=priority))
              for key, priority in [("app-key", None), ("app-key", "critical"),
                                    ("batch-key", None), ("app-key", None)]]
    await asyncio.sleep(0.1)
    assert (await status(client))["scheduler"]["queued"] == 4
    # The new table drops the "high" tier and renames the model; the provider gets a slot
    # more, and a key more.
    keys = table(upstream)["classify"]["keys"] + [{"name": "new", "key": "new-key"}]
    second = write(path, table(
        upstream,
        tiers=[{"name": "critical"}, {"name": "normal"}, {"name": "low"}],
        classify={"default_tier": "normal", "keys": [
            {**k, "tier": "normal"} if k["name"] == "app" else k for k in keys]},
        providers=[{"name": "p", "base_url": upstream, "api_key": "sk", "max_concurrency": 2}],
        models={"m2": [{"provider": "p", "model": "up"}]}))
    code, answer = await reload(client)
    assert (code, answer["status"], answer["version"]) == (200, "reloaded", second)
    results = await asyncio.gather(*calls)
    assert [status for status, _, _ in results] == [200] * 5, results
    assert results[0][1].rstrip().endswith(b"data: [DONE]")  # the stream was not cut
    # "high" calls went to the default tier and are reported there.
    assert [tier for _, _, tier in results] == ["high", "normal", "critical", "low", "normal"]
    # The calls that waited kept their old route (model "m" is gone for new calls).
    assert fake.completed == 5 and all(s.body["model"] == "up" for s in fake.seen)
    after = await status(client)
    assert after["config"]["version"] == second and after["config"]["last_error"] is None
    assert [t["name"] for t in after["scheduler"]["tiers"]] == ["critical", "normal", "low"]
    assert after["providers"]["p"]["max_concurrency"] == 2
    assert (await chat(client, "app-key", model="m"))[0] == 404
    assert (await chat(client, "new-key", model="m2"))[:3:2] == (200, "normal")
    assert (await chat(client, "app-key", model="m2"))[2] == "normal"
    metrics = client.app[SERVICE].metrics.render().decode()
    assert 'proxy_config_reloads_total{result="ok"} 1.0' in metrics
    assert 'proxy_queue_depth{tier="high"}' not in metrics
    assert 'proxy_queue_depth{tier="low"} 0.0' in metrics


@pytest.mark.parametrize(("text", "where"), [
    ("providers: [", "not valid YAML"),
    ({"tiers": []}, "tiers"),
    ({"providers": [{"name": "p", "base_url": "http://x/v1", "max_concurrency": -1}]},
     "providers[0].max_concurrency"),
    ({"models": {"m": [{"provider": "nope", "model": "x"}]}}, "models.m[0].provider"),
])
async def test_an_invalid_file_is_refused_and_the_old_config_keeps_serving(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path, text: dict[str, Any] | str, where: str) -> None:
    fake = FakeUpstream()
    server = await aiohttp_server(fake.app())
    upstream = str(server.make_url("/v1"))
    path = tmp_path / "routing.yaml"
    first = write(path, table(upstream))
    client = await start(aiohttp_client, counter, path)
    write(path, text if isinstance(text, str) else table(upstream, **text))
    code, answer = await reload(client)
    assert code == 400 and answer["error"]["code"] == "invalid_config"
    assert where in answer["error"]["message"] and str(path) in answer["error"]["message"]
    config = (await status(client))["config"]
    assert config["version"] == first and where in config["last_error"]
    assert (await chat(client, "app-key"))[0] == 200
    assert 'proxy_config_reloads_total{result="error"} 1.0' in client.app[
        SERVICE].metrics.render().decode()
    # Fixed, it loads, and the error is cleared.
    write(path, table(upstream, drain_timeout_s=5))
    assert (await reload(client))[0] == 200
    assert (await status(client))["config"]["last_error"] is None


async def test_state_survives_for_what_still_exists(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    broken, urls, providers = await failing_and_healthy(aiohttp_server, failures=2)
    providers = [{**p, "max_concurrency": 4} for p in providers]
    path = tmp_path / "routing.yaml"
    write(path, table(urls[0], providers=providers, models={
        "m": [{"provider": "a", "model": "up"}, {"provider": "b", "model": "up"}]}))
    client = await start(aiohttp_client, counter, path)
    for _ in range(3):
        assert (await chat(client, "app-key"))[0] == 200  # a fails, b answers
    assert (await status(client))["breakers"]["a/up"]["state"] == "open"
    service = client.app[SERVICE]
    latency = service.engine.latency
    # b gets a new limit and a (still open) a keeps its breaker; the estimators stay.
    providers[1]["max_concurrency"] = 8
    write(path, table(urls[0], providers=providers, models={
        "m": [{"provider": "a", "model": "up"}, {"provider": "b", "model": "up"}]}))
    assert (await reload(client))[0] == 200
    after = await status(client)
    assert after["breakers"]["a/up"]["state"] == "open"
    assert after["providers"]["b"]["limit"] == 8
    assert service.engine.latency is latency
    served = len(broken.seen)
    assert (await chat(client, "app-key"))[0] == 200 and len(broken.seen) == served


async def test_a_changed_provider_gets_a_new_upstream_for_new_calls(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    old, new = FakeUpstream(), FakeUpstream()
    servers = [await aiohttp_server(f.app()) for f in (old, new)]
    path = tmp_path / "routing.yaml"
    write(path, table(str(servers[0].make_url("/v1"))))
    client = await start(aiohttp_client, counter, path)
    assert (await chat(client, "app-key"))[0] == 200
    write(path, table(str(servers[1].make_url("/v1"))))
    assert (await reload(client))[0] == 200
    assert (await chat(client, "app-key"))[0] == 200
    assert (len(old.seen), len(new.seen)) == (1, 1)


async def test_a_replaced_upstream_closes_its_connections_once_its_calls_are_done(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    fake = FakeUpstream(hold_s=0.3)
    upstream = await aiohttp_server(fake.app())
    url = str(upstream.make_url("/v1"))
    path = tmp_path / "routing.yaml"
    write(path, table(url))
    client = await start(aiohttp_client, counter, path)
    assert (await chat(client, "app-key"))[0] == 200  # its connection waits in the pool
    running = asyncio.ensure_future(chat(client, "app-key"))
    await asyncio.sleep(0.1)
    write(path, table(url, providers=[{"name": "p", "base_url": url, "api_key": "sk-2",
                                       "max_concurrency": 1}]))
    assert (await reload(client))[0] == 200
    assert (await running)[0] == 200  # the call on the old upstream finished
    for _ in range(50):  # and the old upstream's connections are gone, none kept idle
        if not upstream.handler.connections:
            break
        await asyncio.sleep(0.02)
    assert not upstream.handler.connections
    assert (await chat(client, "app-key"))[0] == 200


async def test_a_reload_that_fails_leaves_the_old_upstreams_open(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    def factory(provider: Provider) -> Upstream:
        if provider.api_key == "unbuildable":
            raise ValueError("this upstream cannot be built")
        return default_upstream(provider)

    upstream = await aiohttp_server(FakeUpstream().app())
    url = str(upstream.make_url("/v1"))
    path = tmp_path / "routing.yaml"
    write(path, table(url))
    client: Client = await aiohttp_client(build_app(
        load_config(path), counter=counter, config_path=path, upstream_factory=factory))
    assert (await chat(client, "app-key"))[0] == 200
    write(path, table(url, providers=[{"name": "p", "base_url": url,
                                       "api_key": "unbuildable", "max_concurrency": 1}]))
    assert (await reload(client))[0] == 500
    for _ in range(3):  # the old config serves on, its connection kept alive between calls
        assert (await chat(client, "app-key"))[0] == 200
        await asyncio.sleep(0.05)
        assert len(upstream.handler.connections) == 1


async def test_reload_needs_the_admin_key_and_a_file(
        aiohttp_client: Factory, counter: TokenCounter, tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    write(path, table("http://127.0.0.1:9/v1", listen={"host": "127.0.0.1", "port": 1}))
    client = await start(aiohttp_client, counter, path)
    assert (await client.post("/admin/reload")).status == 401
    write(path, table("http://127.0.0.1:9/v1", listen={"host": "0.0.0.0", "port": 2}))
    code, answer = await reload(client)
    assert code == 200 and answer["restart_needed"] == ["listen"]
    write(path, table("http://127.0.0.1:9/v1", listen={"host": "0.0.0.0", "port": 2},
                      state={"backend": "redis"}, server={"fast_lane": False}))
    code, answer = await reload(client)
    assert code == 200 and answer["restart_needed"] == ["listen", "server", "state"]
    status = await (await client.get("/admin/status", headers=ADMIN)).json()
    assert status["state"]["backend"] == "memory"  # kept until the restart
    bare: Client = await aiohttp_client(build_app(load_config(path), counter=counter))
    resp = await bare.post("/admin/reload", headers=ADMIN)
    assert resp.status == 400 and "without a config file" in (await resp.json())[
        "error"]["message"]


@pytest.mark.e2e  # `serve` in a subprocess
async def test_sighup_reloads_the_real_server(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    sim = [{"name": "sim", "kind": "simulated", "max_concurrency": 2,
            "simulate": {"ttft_s": 0.01, "tokens_per_s": 1000}}]
    data = table("unused", providers=sim, models={"m": [{"provider": "sim", "model": "s"}]})
    write(path, data)
    async with serving(path) as (base, process):
        async with aiohttp.ClientSession(headers=ADMIN) as session:

            async def config() -> dict[str, Any]:
                async with session.get(f"{base}/admin/status") as resp:
                    return (await resp.json())["config"]  # type: ignore[no-any-return]

            async def becomes(check: Callable[[dict[str, Any]], bool]) -> None:
                async with asyncio.timeout(10):
                    while not check(await config()):
                        await asyncio.sleep(0.05)

            version = write(path, {**data, "models": {"m2": data["models"]["m"]}})
            process.send_signal(signal.SIGHUP)
            await becomes(lambda c: c["version"] == version)
            write(path, "tiers: [")
            process.send_signal(signal.SIGHUP)
            await becomes(lambda c: c["last_error"] is not None)
            assert (await config())["version"] == version
            async with session.post(f"{base}/v1/chat/completions", headers={
                    "Authorization": "Bearer app-key"}, json={
                    "model": "m2", "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0


async def test_a_refused_reload_never_writes_a_secret(
        aiohttp_client: Factory, counter: TokenCounter, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "routing.yaml"
    write(path, table("http://127.0.0.1:9/v1"))
    client = await start(aiohttp_client, counter, path)
    broken = [
        'admin: {key: "adm1n-secret-x\nproviders: []\n',
        yaml.safe_dump(table("http://127.0.0.1:9/v1", providers=[
            {"name": "p", "base_url": "http://x/v1", "api_key": "sk-secret-y",
             "max_concurrency": "sk-secret-z"}])),
    ]
    with caplog.at_level("DEBUG"):
        for text in broken:
            write(path, text)
            code, answer = await reload(client)
            assert code == 400
            written = str(answer) + str(await status(client)) + caplog.text
            for secret in ("adm1n-secret-x", "sk-secret-y", "sk-secret-z"):
                assert secret not in written, (secret, written)


async def test_what_a_reload_removes_leaves_the_metrics_and_status(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
        tmp_path: Path) -> None:
    _, urls, providers = await failing_and_healthy(aiohttp_server, failures=1)
    path = tmp_path / "routing.yaml"
    write(path, table(urls[0], providers=providers, models={
        "m": [{"provider": "a", "model": "up"}, {"provider": "b", "model": "up"}]}))
    client = await start(aiohttp_client, counter, path)
    assert (await chat(client, "app-key"))[0] == 200
    metrics = client.app[SERVICE].metrics
    assert 'proxy_breaker_state{deployment="a/up",provider="a"} 2.0' in metrics.render().decode()
    events = await client.get("/admin/events", headers=ADMIN)
    assert events.status == 200
    write(path, table(urls[1], admin={"key": "n3w-admin"}, providers=providers[1:],
                      models={"m": [{"provider": "b", "model": "up"}]}))
    assert (await reload(client))[0] == 200
    text = metrics.render().decode()
    # Gauges forget it (counters keep their history).
    for gauge in ("proxy_breaker_state", "proxy_upstream_inflight", "proxy_upstream_limit"):
        assert f'{gauge}{{deployment="a/up"' not in text and f'{gauge}{{provider="a"}}' not in text
    assert 'proxy_breaker_state{deployment="b/up",provider="b"} 0.0' in text
    resp = await client.get("/admin/status", headers={"X-Admin-Key": "n3w-admin"})
    state = await resp.json()
    assert set(state["breakers"]) == {"b/up"} and set(state["scheduler"]["providers"]) == {"b"}
    # The feed opened with the old admin key ends.
    async with asyncio.timeout(5):
        await events.read()
