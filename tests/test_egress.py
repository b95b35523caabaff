"""The egress proxy: ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` read as ``urllib`` reads
them, and provider calls through a CONNECT tunnel of a real proxy on 127.0.0.1 (TLS to the
provider's name over it, credentials, refusals, reuse of the tunnelled connection)."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import ssl
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest
import trustme

from proxy.__main__ import main
from proxy.config import ConfigError, Provider, parse_config
from proxy.core.errors import UpstreamConnectError
from proxy.http.server.app import default_upstream
from proxy.http.upstream.upstream import HttpUpstream

from .connect_proxy import connect_proxy
from .test_wire import OK, answering, call, raw_server, read_request

SECRET = "pa:ss@wd"  # percent-encoded in the proxy's URL
USER = "alice"
PROXY_CREDENTIALS = f"{USER}:{SECRET}"


def provider(base_url: str, env: Mapping[str, str]) -> Provider:
    config = parse_config({"providers": [{"name": "up", "base_url": base_url, "api_key": "k"}],
                           "models": {"m": [{"provider": "up", "model": "m"}]}}, env)
    return config.providers["up"]


def upstream_of(found: Provider) -> HttpUpstream:
    """The upstream the proxy builds for ``found``."""
    upstream = default_upstream(found)
    assert isinstance(upstream, HttpUpstream)
    return upstream


def display_url(base_url: str, env: Mapping[str, str]) -> str | None:
    egress = provider(base_url, env).egress
    return None if egress is None else egress.display_url


def with_credentials(proxy_url: str, password: str = SECRET) -> str:
    quoted = password.replace("%", "%25").replace(":", "%3A").replace("@", "%40")
    return proxy_url.replace("http://", f"http://{USER}:{quoted}@")


@pytest.mark.parametrize("env", [
    {"HTTPS_PROXY": "http://upper:1", "NO_PROXY": "a,.b"},
    {"https_proxy": "http://lower:2", "HTTPS_PROXY": "http://upper:1", "no_proxy": "*"},
    {"HTTPS_PROXY": "http://upper:1", "https_proxy": ""},
    {"HTTP_PROXY": "http://h:3", "http_proxy": "http://l:4", "NO_PROXY": ""},
])
def test_the_environment_is_read_as_urllib_reads_it(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.config.egress import environment_proxies
    for name in list(os.environ):
        if name.lower().endswith("_proxy") or name == "REQUEST_METHOD":
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert environment_proxies(os.environ) == urllib.request.getproxies_environment()


OPENAI = "https://api.openai.com/v1"
VLLM = "http://vllm.internal:8000/v1"
P = {"HTTPS_PROXY": "http://proxy.corp:3128"}


@pytest.mark.parametrize(("base_url", "env", "expected"), [
    (OPENAI, P, "http://proxy.corp:3128"),
    (OPENAI, {}, None),
    (VLLM, P, None),  # HTTPS_PROXY is for https:// providers only
    (VLLM, {"http_proxy": "proxy.corp:8080"}, "http://proxy.corp:8080"),  # no scheme: http
    (OPENAI, {"HTTPS_PROXY": "http://proxy.corp"}, "http://proxy.corp:80"),
    (OPENAI, {"HTTPS_PROXY": "http://up:1", "https_proxy": "http://low:2"}, "http://low:2"),
    (OPENAI, {**P, "https_proxy": ""}, None),  # set but empty: off
    (OPENAI, {**P, "NO_PROXY": "openai.com"}, None),  # a domain suffix
    (OPENAI, {**P, "NO_PROXY": "localhost, .openai.com"}, None),
    (OPENAI, {**P, "no_proxy": "*"}, None),
    (OPENAI, {**P, "NO_PROXY": "ai.com,example.org"}, "http://proxy.corp:3128"),
    ("https://h.corp:8443/v1", {**P, "NO_PROXY": "h.corp:8443"}, None),  # host:port
    ("https://h.corp/v1", {**P, "NO_PROXY": "h.corp:8443"}, "http://proxy.corp:3128"),
    ("https://[2001:db8::1]/v1", {"HTTPS_PROXY": "http://[2001:db8::2]:3128"},
     "http://[2001:db8::2]:3128"),
])
def test_which_providers_go_through_the_egress_proxy(
        base_url: str, env: dict[str, str], expected: str | None) -> None:
    assert display_url(base_url, env) == expected


def test_credentials_become_basic_auth_and_are_never_shown() -> None:
    found = provider(OPENAI, {"HTTPS_PROXY": with_credentials("http://proxy.corp:3128")})
    assert found.egress is not None
    assert found.egress.authorization == "Basic " + base64.b64encode(
        PROXY_CREDENTIALS.encode()).decode()
    assert found.egress.display_url == "http://proxy.corp:3128"
    assert SECRET not in repr(found) and found.egress.authorization not in repr(found)


@pytest.mark.parametrize(("url", "problem"), [
    (f"socks5://{USER}:secret@proxy.corp:1080", "must be an http:// URL, not socks5://"),
    (f"http://{USER}:secret@proxy.corp:99999", "port is not a number"),
    ("http://:3128", "names no host"),
])
def test_an_unusable_proxy_url_is_a_config_error_that_hides_it(url: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        provider(OPENAI, {"HTTPS_PROXY": url})
    assert str(caught.value).startswith("https_proxy (environment): ")
    assert problem in str(caught.value) and "secret" not in str(caught.value)



def test_check_reads_the_environment_and_shows_the_proxy_without_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text("providers: [{name: up, base_url: 'https://api.openai.com/v1'}, "
                      "{name: near, base_url: 'https://near.corp/v1'}]\n"
                      "models: {m: [{provider: up, model: m}, {provider: near, model: m}]}\n")
    monkeypatch.setenv("HTTPS_PROXY", with_credentials("http://proxy.corp:3128"))
    monkeypatch.setenv("NO_PROXY", ".corp")
    assert main(["check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert ("providers: up (openai, max_concurrency 10, via http://proxy.corp:3128), "
            "near (openai, max_concurrency 10)") in out
    assert USER not in out and SECRET not in out and "pa%3Ass" not in out

# --- calls through a tunnel ---------------------------------------------------------------

def tls_for(authority: trustme.CA, name: str, sni: list[str]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert(name).configure_cert(context)
    context.sni_callback = lambda _, server_name, __: sni.append(server_name or "")
    return context


def port_of(url: str) -> int:
    return int(url.split("/")[2].rsplit(":", 1)[1])


async def test_a_call_reaches_a_tls_provider_through_the_tunnel_and_reuses_it(
        authority: trustme.CA, trusting: None) -> None:
    sni: list[str] = []
    heads: list[bytes] = []

    async def provider_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            heads.append(await read_request(reader))
            writer.write(OK)

    async with raw_server(provider_side, tls=tls_for(authority, "provider.test", sni)) as up, \
            connect_proxy(credentials=PROXY_CREDENTIALS) as proxy:
        # provider.test resolves nowhere but at the proxy: only the tunnel can reach it.
        target = f"provider.test:{port_of(up.url)}"
        found = provider(f"https://{target}/v1", {"HTTPS_PROXY": with_credentials(proxy.url)})
        upstream = upstream_of(found)
        for _ in range(3):
            assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert proxy.targets == [target] and proxy.tunnels == 1 and up.connections == 1
    assert proxy.seen[0].line == f"CONNECT {target} HTTP/1.1"
    assert proxy.seen[0].headers["host"] == target
    assert proxy.seen[0].headers["proxy-authorization"] == "Basic " + base64.b64encode(
        PROXY_CREDENTIALS.encode()).decode()
    assert sni == ["provider.test"]  # and its certificate was checked for that name
    assert len(heads) == 3
    for head in heads:
        lines = head.decode().lower().split("\r\n")
        assert f"host: {target}" in lines
        assert not any(line.startswith("proxy-authorization") for line in lines)


async def test_the_providers_certificate_is_checked_through_the_tunnel(
        authority: trustme.CA, trusting: None) -> None:
    sni: list[str] = []
    async with raw_server(answering(OK), tls=tls_for(authority, "other.test", sni)) as up, \
            connect_proxy() as proxy:
        target = f"provider.test:{port_of(up.url)}"
        upstream = upstream_of(provider(f"https://{target}/v1", {"HTTPS_PROXY": proxy.url}))
        with pytest.raises(UpstreamConnectError, match="SSL"):
            await call(upstream)
        await upstream.close()
    assert proxy.targets == [target] and sni == ["provider.test"]


async def test_an_http_provider_goes_through_a_connect_tunnel_too() -> None:
    async with raw_server(answering(OK)) as up, connect_proxy() as proxy:
        target = f"provider.test:{port_of(up.url)}"
        upstream = upstream_of(provider(f"http://{target}/v1", {"http_proxy": proxy.url}))
        assert await call(upstream) == (200, b"{}")
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert proxy.targets == [target] and up.connections == 1


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "*", "localhost,127.0.0.1"])
async def test_no_proxy_calls_go_directly(no_proxy: str) -> None:
    async with raw_server(answering(OK)) as up, connect_proxy() as proxy:
        found = provider(up.url, {"HTTP_PROXY": proxy.url, "NO_PROXY": no_proxy})
        assert found.egress is None
        upstream = upstream_of(found)
        assert await call(upstream) == (200, b"{}")
        await upstream.close()
    assert proxy.seen == [] and up.connections == 1


@pytest.mark.parametrize(("settings", "password", "status"), [
    ({"credentials": PROXY_CREDENTIALS}, "wrong:pw", 407),
    ({"credentials": PROXY_CREDENTIALS}, None, 407),
    ({"refuse": 403}, SECRET, 403),
])
async def test_a_refusing_proxy_is_a_connect_error_that_names_it(
        settings: dict[str, object], password: str | None, status: int) -> None:
    async with raw_server(answering(OK)) as up, connect_proxy(**settings) as proxy:
        url = proxy.url if password is None else with_credentials(proxy.url, password)
        upstream = upstream_of(provider(up.url.replace("127.0.0.1", "provider.test"),
                                             {"HTTP_PROXY": url}))
        with pytest.raises(UpstreamConnectError) as caught:
            await call(upstream)
        await upstream.close()
    message = str(caught.value)
    assert message == (f"the egress proxy {proxy.url} refused the tunnel to the provider "
                       f"({status})")
    assert caught.value.status == 502 and up.connections == 0


async def test_an_unreachable_or_silent_proxy_is_a_connect_error_that_names_it() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{unused.getsockname()[1]}"
    upstream = upstream_of(provider("https://provider.test/v1",
                                         {"HTTPS_PROXY": with_credentials(gone)}))
    with pytest.raises(UpstreamConnectError) as caught:
        await call(upstream)
    assert str(caught.value) == (f"connecting to the provider through the egress proxy {gone} "
                                 "failed (ConnectionRefusedError)")
    async with connect_proxy(silent=True) as proxy:
        upstream = upstream_of(provider("https://provider.test/v1",
                                             {"HTTPS_PROXY": proxy.url}))
        with pytest.raises(UpstreamConnectError, match=f"egress proxy {proxy.url} timed out"):
            await call(upstream)
    assert proxy.targets == ["provider.test:443"]


async def test_a_proxy_answering_garbage_is_a_connect_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await reader.read()

    async with raw_server(garbage) as fake:
        origin = fake.url.removesuffix("/v1")
        upstream = upstream_of(provider("https://provider.test/v1",
                                             {"HTTPS_PROXY": origin}))
        with pytest.raises(UpstreamConnectError, match=r"failed \(ConnectionError\)"):
            await call(upstream)

