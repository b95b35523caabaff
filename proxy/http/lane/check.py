"""Whether the fast lane can run on the aiohttp installed, checked before it is imported.

The lane (``front``, ``head``, ``request``, ``events``) reads parts of aiohttp
that carry no promise: private names, a constructor's parameters, the fields of a parsed
head. Each one it reads is listed here, and the lane is used only when every one is there;
else the proxy serves through aiohttp's own handling and says why (``/admin/status``,
``server.fast_lane_off_because``). CI runs the lane's tests on the lowest and the newest aiohttp
that ``pyproject.toml`` admits.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

# Names the lane imports, by module.
IMPORTS = {
    "aiohttp.base_protocol": ("BaseProtocol",),
    "aiohttp.client_exceptions": ("ClientConnectionResetError",),
    "aiohttp.helpers": ("rfc822_formatted_time",),
    "aiohttp.http": ("SERVER_SOFTWARE",),
    "aiohttp.http_parser": ("RawRequestMessage", "SINGLETON_HEADERS"),
    "aiohttp.http_writer": ("HttpVersion11", "StreamWriter", "_serialize_headers"),
    "aiohttp.streams": ("EMPTY_PAYLOAD",),
    "aiohttp.tcp_helpers": ("tcp_keepalive",),
    "aiohttp.web_protocol": ("RequestHandler",),
}
# Attributes the lane reads or sets on aiohttp's objects, by how one is made.
PROTOCOL_ATTRS = ("_loop", "transport", "writing_paused", "_drain_helper", "pause_writing")
RESPONSE_ATTRS = ("_eof_sent", "_payload_writer", "_status", "_reason", "_cookies",
                  "_compression", "_chunked", "_keep_alive", "_headers",
                  "_send_headers_immediately")
SERVER_ATTRS = ("request_handler", "_kwargs", "handler_cancellation", "pre_shutdown")
APP_ATTRS = ("_client_max_size",)
RUNNER_ATTRS = ("_make_server",)
# Parameters of constructors the lane calls or whose defaults it shares.
HANDLER_SETTINGS = ("keepalive_timeout", "lingering_time", "tcp_keepalive", "max_field_size",
                    "max_headers")
REQUEST_PARAMETERS = ("message", "payload", "protocol", "payload_writer", "task", "loop",
                      "client_max_size", "state")
HEAD_FIELDS = ("method", "path", "version", "headers", "raw_headers", "should_close",
               "compression", "upgrade", "chunked", "url")


def lane_off_because(app: web.Application) -> str | None:
    """Why the lane cannot serve ``app`` on this aiohttp, or None if it can. Called with
    the event loop running (aiohttp's server takes it at construction)."""
    from ..call.middleware import errors_middleware  # the lane runs this and no other hook

    if tuple(app.middlewares) != (errors_middleware,) or app.on_response_prepare:
        return "the app has middleware or response hooks the lane does not run"
    lacking = what_aiohttp_lacks()
    if lacking:
        return f"aiohttp {aiohttp.__version__} lacks {', '.join(lacking)}"
    return None


def what_aiohttp_lacks() -> list[str]:
    """Each thing the lane reads that this aiohttp does not have, by its dotted name."""
    lacking: list[str] = []
    for module_name, names in IMPORTS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            lacking.append(module_name)
            continue
        lacking += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    if lacking:
        return lacking
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.http_parser import RawRequestMessage
    from aiohttp.web_protocol import RequestHandler

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        raise NotImplementedError

    made: dict[str, Callable[[], object]] = {
        "BaseProtocol": lambda: BaseProtocol(asyncio.get_running_loop()),
        "StreamResponse": web.StreamResponse,
        "Server": lambda: web.Server(handler),
        "Application": web.Application,
    }
    wanted = {"BaseProtocol": PROTOCOL_ATTRS, "StreamResponse": RESPONSE_ATTRS,
              "Server": SERVER_ATTRS, "Application": APP_ATTRS}
    for kind, attrs in wanted.items():
        try:
            instance = made[kind]()
        except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
            lacking.append(f"{kind}() ({type(exc).__name__})")
            continue
        lacking += [f"{kind}.{name}" for name in attrs if not hasattr(instance, name)]
    lacking += [f"AppRunner.{name}" for name in RUNNER_ATTRS  # its own, not the abstract
                if name not in vars(web.AppRunner)]
    lacking += _parameters("RequestHandler", RequestHandler.__init__, HANDLER_SETTINGS)
    lacking += _parameters("BaseRequest", web.BaseRequest.__init__, REQUEST_PARAMETERS)
    from aiohttp.http_writer import HttpVersion11
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    values: tuple[Any, ...] = ("POST", "/v1/x", HttpVersion11,
                               CIMultiDictProxy(CIMultiDict[str]()), (), False, None, False,
                               False, URL("/v1/x"))
    try:  # the C parser's class has no _fields: build one, as the lane does
        head = RawRequestMessage(*values)
    except TypeError:
        return [*lacking, f"RawRequestMessage({', '.join(HEAD_FIELDS)})"]
    lacking += [f"RawRequestMessage.{name}" for name, value in zip(HEAD_FIELDS, values,
                                                                    strict=True)
                if getattr(head, name, None) is not value]
    return lacking


def _parameters(shown_as: str, function: Callable[..., object],
                wanted: tuple[str, ...]) -> list[str]:
    present = inspect.signature(function).parameters
    return [f"{shown_as}({name}=)" for name in wanted if name not in present]

