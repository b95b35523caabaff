"""The egress proxy: ``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` read as ``urllib`` reads
them."""

from __future__ import annotations

import base64
import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.__main__ import main
from proxy.config import ConfigError, Provider, parse_config

SECRET = "pa:ss@wd"  # percent-encoded in the proxy's URL
USER = "alice"
PROXY_CREDENTIALS = f"{USER}:{SECRET}"


def provider(base_url: str, env: Mapping[str, str]) -> Provider:
    config = parse_config({"providers": [{"name": "up", "base_url": base_url, "api_key": "k"}],
                           "models": {"m": [{"provider": "up", "model": "m"}]}}, env)
    return config.providers["up"]


def shown(base_url: str, env: Mapping[str, str]) -> str | None:
    egress = provider(base_url, env).egress
    return None if egress is None else egress.shown


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
    assert shown(base_url, env) == expected


def test_credentials_become_basic_auth_and_are_never_shown() -> None:
    found = provider(OPENAI, {"HTTPS_PROXY": with_credentials("http://proxy.corp:3128")})
    assert found.egress is not None
    assert found.egress.authorization == "Basic " + base64.b64encode(
        PROXY_CREDENTIALS.encode()).decode()
    assert found.egress.shown == "http://proxy.corp:3128"
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
