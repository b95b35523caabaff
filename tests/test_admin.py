"""Admin auth: ``admin.key`` guards ``/admin/*``; without one, only loopback clients get
in (by the socket's peer, never a forwarded-for header)."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, make_mocked_request

from proxy.config import ConfigError, parse_config
from proxy.core.call.tokens import TokenCounter
from proxy.core.errors import AdminLoopbackOnly, InvalidAdminKey
from proxy.http.base.edge import is_loopback
from proxy.http.call.service import SERVICE
from proxy.http.ops.admin import check_admin
from proxy.http.server.app import build_app

Factory = Callable[..., Awaitable[Any]]
BASE: dict[str, Any] = {
    "providers": [{"name": "sim", "kind": "simulated", "simulate": {"ttft_s": 0.0}}],
    "models": {"m": [{"provider": "sim", "model": "x"}]},
}


def config(**sections: Any) -> Any:
    return parse_config({**BASE, **sections}, {"ADMIN_KEY": "adm1n"})


@pytest.mark.parametrize(("admin", "digest"), [
    ({"key": "${ADMIN_KEY}"}, hashlib.sha256(b"adm1n").hexdigest()),
    ({"key_sha256": hashlib.sha256(b"x").hexdigest().upper()}, hashlib.sha256(b"x").hexdigest()),
    ({"key": "${UNSET_ADMIN_KEY}"}, None),
    ({}, None),
])
def test_the_admin_key_is_read_as_a_digest(admin: dict[str, str], digest: str | None) -> None:
    parsed = config(admin=admin)
    assert parsed.admin_sha256 == digest
    if "UNSET" in str(admin):
        assert any("admin.key" in w and "loopback" in w for w in parsed.warnings)


@pytest.mark.parametrize(("admin", "message"), [
    ({"key": ""}, "admin.key: must not be empty"),
    ({"key": "a", "key_sha256": "b" * 64}, "admin: needs at most one"),
    ({"key_sha256": "nothex"}, "admin.key_sha256: must be 64 hex digits"),
    ({"key": "app-key"}, "admin: the admin key must differ from every client key"),
    ({"keys": "x"}, "admin.keys: unknown key"),
])
def test_bad_admin_sections_are_config_errors(admin: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(admin=admin, classify={"keys": [{"name": "app", "key": "app-key"}]})
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("10.0.0.1", False), ("::ffff:10.0.0.1", False), ("0.0.0.0", False),
    ("192.168.1.2", False), ("", False), ("example.com", False),
])
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def request_from(peer: str, headers: dict[str, str], admin: dict[str, str]) -> web.Request:
    app = web.Application()
    service = mock.Mock()
    service.config = config(admin=admin)
    app[SERVICE] = service
    transport = mock.Mock()
    transport.get_extra_info.return_value = (peer, 40000)
    return make_mocked_request("GET", "/admin/status", headers=headers, app=app,
                               transport=transport)


def test_without_an_admin_key_only_loopback_peers_get_in() -> None:
    check_admin(request_from("127.0.0.1", {}, {}))
    with pytest.raises(AdminLoopbackOnly):
        check_admin(request_from("10.1.2.3", {"X-Forwarded-For": "127.0.0.1"}, {}))
    with pytest.raises(AdminLoopbackOnly):
        check_admin(request_from("10.1.2.3", {"Authorization": "Bearer anything"}, {}))


def test_with_an_admin_key_the_peer_does_not_matter() -> None:
    key = {"key": "${ADMIN_KEY}"}
    check_admin(request_from("10.1.2.3", {"Authorization": "Bearer adm1n"}, key))
    check_admin(request_from("10.1.2.3", {"X-Admin-Key": "adm1n"}, key))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Admin-Key": "adm1n "}):
        with pytest.raises(InvalidAdminKey):
            check_admin(request_from("127.0.0.1", headers, key))


async def test_admin_endpoints_over_sockets(aiohttp_client: Factory,
                                            counter: TokenCounter) -> None:
    parsed = config(admin={"key": "${ADMIN_KEY}"},
                    classify={"keys": [{"name": "app", "key": "app-key"}]})
    client: TestClient[web.Request, web.Application] = await aiohttp_client(
        build_app(parsed, counter=counter))
    for headers in ({}, {"Authorization": "Bearer app-key"}, {"Authorization": "Bearer no"},
                    {"X-Admin-Key": "app-key"}):
        resp = await client.get("/admin/status", headers=headers)
        assert resp.status == 401
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_admin_key" and "adm1n" not in str(error)
    for headers in ({"Authorization": "Bearer adm1n"}, {"X-Admin-Key": "adm1n"}):
        resp = await client.get("/admin/status", headers=headers)
        assert resp.status == 200 and "providers" in await resp.json()
    # The admin key is not a client key, and the page itself holds no data.
    resp = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer adm1n"},
                             json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status == 401
    assert (await client.get("/dashboard")).status == 200
