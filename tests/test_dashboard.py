"""The dashboard: the live history behind it (bounded whatever the load), ``/admin/events``
(guarded, pushed once a second, ended by a drain) and the page itself in headless Chromium,
showing what the proxy did."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.core.call.tokens import TokenCounter
from proxy.core.quantile import percentile
from proxy.http.base.access import CallRecord
from proxy.http.base.appkeys import LIFECYCLE
from proxy.http.base.live import REJECTIONS, SAMPLES, LiveStats
from proxy.http.call.service import SERVICE
from proxy.http.server.app import build_app

from .browser import CHROMIUM, Browser
from .conftest import config_from
from .fakes import FakeUpstream

Factory = Callable[..., Awaitable[Any]]
Client = TestClient[web.Request, web.Application]
KEYS = [{"name": "app", "key": "app-key", "tier": "high", "max_tier": "critical"},
        {"name": "batch", "key": "batch-key", "tier": "low"}]


def record(tier: str | None = "high", queue_s: float | None = 0.5, key: str = "app",
           code: str | None = None) -> CallRecord:
    return CallRecord(arrived=1_700_000_000.0, key=key, tier=tier, model="m",
                      upstream="p/x" if queue_s is not None else None, queue_s=queue_s,
                      prompt_tokens=10, completion_tokens=5, cost_usd=0.001, code=code)


def test_percentiles_are_nearest_rank() -> None:
    assert percentile([1.0], 0.99) == 1.0
    ordered = [float(i) for i in range(1, 101)]
    assert percentile(ordered, 0.5) == 50.0 and percentile(ordered, 0.99) == 99.0
    assert percentile([1.0, 2.0], 0.0) == 1.0


def test_the_history_is_bounded_whatever_the_load() -> None:
    live = LiveStats(window_s=10, rng=random.Random(1))
    for second in range(100):
        for i in range(SAMPLES * 3):
            live.call_ended(200, record(queue_s=float(i)), 1000 + second + i / (SAMPLES * 3))
        live.call_ended(429, record(code="queue_full", queue_s=None), 1000 + second)
    slots = [s for s in live._ring if s is not None]
    assert len(slots) == 10
    assert all(len(w) == SAMPLES for s in slots for w in s.waits.values())
    assert len(live.rejections()) == REJECTIONS
    points = live.points(1100.0)
    assert [p["t"] for p in points] == list(range(1091, 1100))
    # The sample stands for the second: its median is near the true one (192 of 0..383).
    assert all(120 < p["p50"]["high"] < 260 and p["calls"] == {"2xx": 384, "4xx": 1}  # type: ignore[index]
               for p in points)
    assert len(live.usage()) == 1 and live.usage()[0]["calls"] == 100 * (SAMPLES * 3 + 1)


def test_points_fill_quiet_seconds_and_start_after_a_given_one() -> None:
    live = LiveStats(window_s=60)
    assert live.points(5.0) == []
    live.call_ended(200, record(queue_s=0.25), 10.2)
    live.sample(12.5, {"high": 3}, {"p": 1})
    live.call_ended(503, record(queue_s=None, code="queue_timeout"), 12.7)
    points = live.points(14.0)
    assert [p["t"] for p in points] == [10, 11, 12, 13]
    assert points[0]["p50"] == {"high": 0.25} and points[1] == {"t": 11}
    assert points[2]["depth"] == {"high": 3} and points[2]["calls"] == {"5xx": 1}
    assert [p["t"] for p in live.points(14.0, after=11)] == [12, 13]
    # Unknown key or tier (a call refused before classification) is "-", never dropped.
    live.call_ended(401, record(tier=None, key="-", queue_s=None, code="invalid_api_key"), 13)
    assert {(u["key"], u["tier"]) for u in live.usage()} == {("app", "high"), ("-", "-")}
    assert live.rejections()[0]["code"] == "invalid_api_key"


async def start(aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter,
                fake: FakeUpstream, admin: dict[str, str] | None = None) -> Client:
    server = await aiohttp_server(fake.app())
    config = config_from(
        [{"name": "p", "base_url": str(server.make_url("/v1")), "api_key": "sk",
          "max_concurrency": 2}],
        {"m": [{"provider": "p", "model": "up", "input_cost": 1.0, "output_cost": 2.0}]},
        classify={"keys": KEYS}, **({"admin": admin} if admin else {}))
    client: Client = await aiohttp_client(build_app(config, counter=counter))
    return client


async def call(client: Client, key: str, priority: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if priority:
        headers["X-Priority"] = priority
    resp = await client.post("/v1/chat/completions", headers=headers, json={
        "model": "m", "messages": [{"role": "user", "content": "hello"}]})
    await resp.read()
    return resp.status


async def snapshots(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """The ``snapshot`` events of an SSE answer, until it ends."""
    events, data = [], b""
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].rstrip(b"\r\n")
        elif line in (b"\n", b"\r\n") and data:
            events.append(orjson.loads(data))
            data = b""
    return events


async def test_events_are_pushed_every_second_and_end_at_drain(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.05)
    client = await start(aiohttp_server, aiohttp_client, counter, fake,
                         admin={"key": "adm1n"})
    assert (await client.get("/admin/events")).status == 401
    assert (await client.get("/admin/history", headers={"X-Admin-Key": "no"})).status == 401
    assert await call(client, "app-key") == 200
    resp = await client.get("/admin/events", headers={"X-Admin-Key": "adm1n"})
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
    reading = asyncio.ensure_future(snapshots(resp))
    await asyncio.sleep(2.2)
    assert await call(client, "nope") == 401
    await asyncio.sleep(1.1)
    client.app[LIFECYCLE].draining = True
    events = await asyncio.wait_for(reading, 3)
    assert len(events) >= 3
    first, last = events[0], events[-1]
    assert first["usage"][0]["key"] == "app" and first["usage"][0]["calls"] == 1
    assert first["status"]["providers"]["p"]["limit"] == 2
    assert last["rejections"][0]["code"] == "invalid_api_key"
    # After the first, each event carries only the seconds the client has not seen.
    seen = [p["t"] for e in events for p in e["points"]]
    assert seen == sorted(set(seen)) and all(len(e["points"]) <= 2 for e in events[1:])


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not found: install "
                    "Debian's chromium (.ci/run does)")
async def test_the_page_shows_what_the_proxy_did(
        aiohttp_server: Factory, aiohttp_client: Factory, counter: TokenCounter) -> None:
    fake = FakeUpstream(hold_s=0.15)
    client = await start(aiohttp_server, aiohttp_client, counter, fake,
                         admin={"key": "adm1n"})
    url = str(client.make_url("/dashboard"))

    async def traffic() -> list[int]:
        calls = [call(client, "app-key", "critical") for _ in range(4)]
        calls += [call(client, "app-key") for _ in range(6)]
        calls += [call(client, "batch-key") for _ in range(10)]
        calls += [call(client, "wrong-key")]
        return list(await asyncio.gather(*calls))

    async with Browser() as browser:
        await browser.goto(url)
        # No key yet: the page asks for one, and a wrong one is refused.
        await browser.wait_for("!document.getElementById('keyform').hidden")
        for key in ("wrong", "adm1n"):
            await browser.evaluate(f"""document.getElementById('adminkey').value = '{key}';
                document.getElementById('keyform').requestSubmit(); true""")
            if key == "wrong":
                await browser.wait_for("document.getElementById('keyerror').textContent"
                                       ".includes('refused')")
        await browser.wait_for("document.getElementById('conn').dataset.state === 'live'")
        statuses = await traffic()
        assert sorted(statuses) == [200] * 20 + [401]
        # It updates under load: the queue shows while the calls wait, then drains.
        second = asyncio.ensure_future(traffic())
        assert await browser.wait_for("+document.getElementById('queued').dataset.value") > 0
        await second
        ticks = int(await browser.evaluate("document.body.dataset.ticks"))
        await browser.wait_for(f"+document.body.dataset.ticks >= {ticks + 2}")
        assert await browser.evaluate("document.getElementById('queued').dataset.value") == "0"

        def cell(row: str, field: str) -> Awaitable[Any]:
            return browser.evaluate(
                f"document.querySelector('{row} [data-field={field}]').dataset.value")

        # The numbers /admin/status reports.
        resp = await client.get("/admin/status", headers={"X-Admin-Key": "adm1n"})
        status = await resp.json()
        for field in ("limit", "max_concurrency", "inflight", "retry_budget"):
            assert float(await cell("[data-provider=p]", field)) == status["providers"]["p"][field]
        assert await cell("[data-provider=p]", "breaker") == "closed"
        for tier in status["scheduler"]["tiers"]:
            row = f"[data-tier={tier['name']}]"
            assert float(await cell(row, "weight")) == tier["weight"]
            assert int(await cell(row, "depth")) == tier["depth"] == 0
        usage = await browser.evaluate("""[...document.querySelectorAll('#usage tr[data-key]')]
            .map(r => [r.dataset.key, r.dataset.tier,
                       +r.querySelector('[data-field=calls]').dataset.value,
                       +r.querySelector('[data-field=cost_usd]').dataset.value])""")
        by = {(key, tier): (calls, cost) for key, tier, calls, cost in usage}
        assert by[("app", "critical")][0] == 8 and by[("app", "high")][0] == 12
        assert by[("batch", "low")][0] == 20 and by[("batch", "low")][1] > 0
        codes = await browser.evaluate(
            "[...document.querySelectorAll('#rejections tr[data-code]')].map(r => r.dataset.code)")
        assert codes == ["invalid_api_key"] * 2
        assert await browser.evaluate("document.getElementById('refused').dataset.value") == "2"
        assert await browser.evaluate(  # no batch runs: the table says so
            "document.querySelector('#batches td.empty').textContent") == "none"
        # One line per tier in the depth and wait charts; the low tier queued behind the rest.
        series = await browser.evaluate(
            "[...document.querySelectorAll('#chart-p99 path')].map(p => p.dataset.series)")
        assert series == ["critical", "high", "normal", "low"]
        low = await browser.wait_for("+document.querySelector('#chart-p99 path"
                                     "[data-series=low]').dataset.last")
        critical = float(await browser.evaluate(
            "document.querySelector('#chart-p99 path[data-series=critical]').dataset.last"))
        assert low > critical
        assert int(await browser.evaluate("+document.getElementById('throttled').dataset.value")
                   ) == 0
        assert await browser.evaluate("document.getElementById('chart-depth')"
                                      ".querySelectorAll('path').length") == 4
        if shot := os.environ.get("DASHBOARD_SCREENSHOT"):
            await browser.screenshot(Path(shot))
        # A drain ends the stream; the page says so and tries again.
        client.app[LIFECYCLE].draining = True
        await browser.wait_for("document.getElementById('conn').dataset.state === 'error'")
    assert client.app[SERVICE].live.usage()
