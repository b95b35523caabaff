"""The lane runs only on an aiohttp that has everything it reads, and only for an app
whose hooks it runs; otherwise it says what is missing."""

from __future__ import annotations

import aiohttp.base_protocol
import aiohttp.http_writer
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.http.base.appkeys import LaneStatus
from proxy.http.call import forward
from proxy.http.call.middleware import errors_middleware
from proxy.http.lane.check import lane_off_because, what_aiohttp_lacks
from proxy.http.lane.front import FrontServer
from proxy.http.server.app import build_app


def proxy_app() -> web.Application:
    from .conftest import config_from

    return build_app(config_from([{"name": "s", "kind": "simulated"}],
                                 {"m": [{"provider": "s", "model": "x"}]}))


async def test_the_installed_aiohttp_has_all_the_lane_reads() -> None:
    assert what_aiohttp_lacks() == []
    assert lane_off_because(proxy_app()) is None


@pytest.mark.parametrize(("owner", "name", "shown"), [
    (aiohttp.http_writer, "_serialize_headers", "aiohttp.http_writer._serialize_headers"),
    (web.AppRunner, "_make_server", "AppRunner._make_server"),
    (web.StreamResponse, "_send_headers_immediately",
     "StreamResponse._send_headers_immediately"),
])
async def test_a_missing_name_is_named(monkeypatch: pytest.MonkeyPatch, owner: object,
                                       name: str, shown: str) -> None:
    monkeypatch.delattr(owner, name)
    assert shown in what_aiohttp_lacks()
    because = lane_off_because(proxy_app())
    assert because is not None and shown in because and aiohttp.__version__ in because


async def test_what_it_reads_of_objects_aiohttp_builds_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp 3.14.0 to 3.14.3 had no ``BaseProtocol._buffer_paused``: attributes are
    looked for on an object aiohttp builds, as names set in ``__init__`` are."""
    monkeypatch.delattr(aiohttp.base_protocol.BaseProtocol, "writing_paused")
    assert "BaseProtocol.writing_paused" in what_aiohttp_lacks()


async def test_a_constructor_parameter_it_shares_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def older(self: RequestHandler, manager: object, *, loop: object,
              keepalive_timeout: float = 75.0) -> None:
        raise NotImplementedError

    monkeypatch.setattr(RequestHandler, "__init__", older)
    lacking = what_aiohttp_lacks()
    assert "RequestHandler(lingering_time=)" in lacking
    assert "RequestHandler(keepalive_timeout=)" not in lacking


async def test_an_app_with_other_hooks_is_served_by_aiohttp_not_the_lane() -> None:
    async def other(request: web.Request, handler: object) -> web.StreamResponse:
        raise NotImplementedError

    for app in (web.Application(middlewares=[errors_middleware, other]),
                web.Application(middlewares=[])):
        assert lane_off_because(app) == ("the app has middleware or response hooks the lane "
                                         "does not run")
    hooked = web.Application(middlewares=[errors_middleware])
    hooked.on_response_prepare.append(other)  # type: ignore[arg-type]
    assert lane_off_because(hooked) is not None
    with pytest.raises(RuntimeError, match="cannot serve this app: the app has middleware"):
        FrontServer(web.Server(other), hooked, forward.HANDLERS)  # type: ignore[arg-type]


def test_the_status_says_why_the_lane_is_off() -> None:
    assert LaneStatus().status() == {"aiohttp": aiohttp.__version__, "fast_lane": False,
                                    "fast_lane_off_because": "not serving"}
    assert LaneStatus(on=True).status()["fast_lane_off_because"] is None
