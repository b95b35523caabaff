from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import pytest
import pytest_asyncio
import trustme
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer

from proxy.config import Config, parse_config
from proxy.core.call.tokens import TokenCounter
from proxy.http.base.appkeys import LIFECYCLE
from proxy.http.call import forward
from proxy.http.lane.front import FrontRunner
from proxy.http.upstream import upstream as upstream_module

from .markers import classify, fewer_examples, unit_stays_in_process  # noqa: F401 (autouse)


@pytest.fixture(scope="session")
def counter() -> TokenCounter:
    return TokenCounter.load()


@pytest.fixture(scope="session")
def authority() -> trustme.CA:
    """A certificate authority for TLS fake providers."""
    return trustme.CA()


@pytest.fixture
def trusting(authority: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The proxy's TLS client trusts ``authority`` (and nothing else)."""
    client = ssl.create_default_context()
    authority.configure_trust(client)
    monkeypatch.setattr(upstream_module, "_tls_context", lambda: client)
    yield


def config_from(
    providers: list[dict[str, Any]],
    models: dict[str, Any],
    **sections: Any,
) -> Config:
    data: dict[str, Any] = {"providers": providers, "models": models, **sections}
    return parse_config(data, {})


@pytest.fixture
def make_config() -> Callable[..., Config]:
    return config_from


class ProxyServer(TestServer):
    """The proxy's app served as ``serve`` serves it: proxied calls take the fast lane."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return FrontRunner(self.app, forward.HANDLERS, **kwargs)


def served(app: web.Application, **kwargs: Any) -> TestServer:
    """A test server for ``app``: the proxy's (``build_app``) with the fast lane, any other
    (a fake upstream) as aiohttp serves it."""
    return ProxyServer(app, **kwargs) if LIFECYCLE in app else TestServer(app, **kwargs)


@pytest_asyncio.fixture
async def aiohttp_server() -> AsyncIterator[Callable[..., Any]]:
    """pytest-aiohttp's fixture, serving the proxy's app with the fast lane."""
    servers: list[TestServer] = []

    async def go(app: web.Application, *, host: str = "127.0.0.1", port: int | None = None,
                 **kwargs: Any) -> TestServer:
        server = served(app, host=host, port=port)
        await server.start_server(**kwargs)
        servers.append(server)
        return server

    yield go
    while servers:
        await servers.pop().close()


@pytest_asyncio.fixture
async def aiohttp_client() -> AsyncIterator[Callable[..., Any]]:
    """pytest-aiohttp's fixture, serving the proxy's app with the fast lane."""
    clients: list[TestClient[Any, Any]] = []

    async def go(param: web.Application | BaseTestServer, *,
                 server_kwargs: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> TestClient[Any, Any]:
        server = served(param, **(server_kwargs or {})) if isinstance(
            param, web.Application) else param
        client: TestClient[Any, Any] = TestClient(server, **kwargs)
        await client.start_server()
        clients.append(client)
        return client

    yield go
    while clients:
        await clients.pop().close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    classify(items)  # unit or e2e, redis and browser: see tests/markers.py


def pytest_collection_finish(session: pytest.Session) -> None:
    fewer_examples(session.config, session.items)  # once -m has deselected
