"""The egress proxy end to end: the official SDK calls the proxy, which reaches a TLS
provider only through a CONNECT proxy on 127.0.0.1; a refusal is a clean 502 that names the
egress proxy and never its credentials; ``/admin/status`` shows it; and ``serve`` reads the
variables from its environment, while its work runner's loopback calls never go through it."""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import trustme
from aiohttp.test_utils import TestServer

from proxy.config import parse_config
from proxy.core.call.tokens import TokenCounter
from proxy.http.server.app import build_app

from .connect_proxy import connect_proxy
from .fakes import FakeUpstream
from .serving import serving
from .test_egress import PROXY_CREDENTIALS, SECRET, with_credentials

Factory = Callable[..., Awaitable[Any]]
MESSAGES: list[Any] = [{"role": "user", "content": "Say hello"}]
ENCODED = base64.b64encode(PROXY_CREDENTIALS.encode()).decode()


async def tls_provider(aiohttp_server: Factory, authority: trustme.CA,
                       upstream: FakeUpstream) -> str:
    """The fake provider over TLS with a certificate for ``provider.test``: that name and
    its port (the name resolves nowhere but at the egress proxy)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("provider.test").configure_cert(context)
    server: TestServer = await aiohttp_server(upstream.app(), ssl=context)
    return f"provider.test:{server.port}"


def routing(target: str, **sections: Any) -> dict[str, Any]:
    return {"providers": [{"name": "up", "base_url": f"https://{target}/v1",
                           "api_key": "sk-up", "max_concurrency": 2}],
            "models": {"gpt-test": [{"provider": "up", "model": "gpt-test"}]}, **sections}


async def status_of(base: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(
            f"{base}/admin/status") as response:
        assert response.status == 200
        return await response.text()


async def test_the_sdk_reaches_a_tls_provider_through_the_egress_proxy(
        aiohttp_server: Factory, counter: TokenCounter, authority: trustme.CA,
        trusting: None) -> None:
    upstream = FakeUpstream(words=["Hel", "lo", "!"])
    target = await tls_provider(aiohttp_server, authority, upstream)
    async with connect_proxy(credentials=PROXY_CREDENTIALS) as egress:
        config = parse_config(routing(target), {"HTTPS_PROXY": with_credentials(egress.url)})
        server = await aiohttp_server(build_app(config, counter=counter))
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="any",
                                    max_retries=0)
        whole = await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        stream = await client.chat.completions.create(model="gpt-test", messages=MESSAGES,
                                                      stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        assert (whole.choices[0].message.content, streamed) == ("Hello there!", "Hello!")
        assert egress.targets == [target] and egress.tunnels == 1  # one tunnel, reused
        assert egress.seen[0].headers["proxy-authorization"] == f"Basic {ENCODED}"
        assert upstream.seen[0].headers["Host"] == target
        status = await status_of(str(server.make_url("")).rstrip("/"))
        assert orjson.loads(status)["providers"]["up"]["egress"] == egress.url
        assert SECRET not in status and ENCODED not in status and "alice" not in status


async def test_a_407_from_the_egress_proxy_is_a_clean_502_without_credentials(
        aiohttp_server: Factory, counter: TokenCounter, authority: trustme.CA,
        trusting: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    upstream = FakeUpstream()
    target = await tls_provider(aiohttp_server, authority, upstream)
    async with connect_proxy(credentials="alice:another") as egress:
        config = parse_config(routing(target, retry={"max_attempts": 1}),
                              {"HTTPS_PROXY": with_credentials(egress.url)})
        server = await aiohttp_server(build_app(config, counter=counter))
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="any",
                                    max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
        status = await status_of(str(server.make_url("")).rstrip("/"))
    error = caught.value.response.json()["error"]
    assert caught.value.status_code == 502 and error["code"] == "upstream_connect_error"
    assert f"the egress proxy {egress.url} refused the tunnel" in error["message"]
    assert "407" in error["message"] and upstream.seen == []
    assert egress.seen[0].headers["proxy-authorization"] == f"Basic {ENCODED}"
    for text in (caught.value.response.text, caplog.text, status):
        assert SECRET not in text and ENCODED not in text and "alice" not in text


async def test_serve_reads_the_environment_and_its_own_loopback_bypasses_the_proxy(
        aiohttp_server: Factory, authority: trustme.CA, tmp_path: Path) -> None:
    upstream = FakeUpstream()
    target = await tls_provider(aiohttp_server, authority, upstream)
    authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    config = tmp_path / "routing.yaml"
    config.write_text(orjson.dumps(routing(target, storage={"path": "work.db"})).decode())
    async with connect_proxy(credentials=PROXY_CREDENTIALS) as egress:
        proxy_url = with_credentials(egress.url)
        # Every variable set, none excepting loopback: the runner must bypass it anyway.
        env = {"HTTPS_PROXY": proxy_url, "http_proxy": proxy_url, "HTTP_PROXY": proxy_url,
               "NO_PROXY": "", "no_proxy": "", "SSL_CERT_FILE": str(tmp_path / "ca.pem")}
        async with serving(config, env=env) as (base, _):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="any", max_retries=0)
            raw = await client.chat.completions.with_raw_response.create(
                model="gpt-test", messages=MESSAGES, extra_body={"background": True})
            queued = raw.headers["x-proxy-background-id"]
            async with asyncio.timeout(20):
                while not (got := await client.chat.completions.retrieve(queued)).choices:
                    await asyncio.sleep(0.05)
            assert got.choices[0].message.content == "Hello there!"
            status = await status_of(base)
    assert egress.targets and set(egress.targets) == {target}  # never the proxy itself
    assert len(upstream.seen) == 1 and upstream.seen[0].headers["Host"] == target
    assert orjson.loads(status)["providers"]["up"]["egress"] == egress.url
    assert SECRET not in status and ENCODED not in status
