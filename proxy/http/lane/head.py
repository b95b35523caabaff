"""Bytes in and out of the fast lane (``proxy.http.lane.front``): which request heads it takes,
read as aiohttp would read them, and plain answers written as aiohttp would write them.

The lane is stricter than aiohttp, never looser: whatever it is not sure of is ``OTHER``,
for aiohttp's parser to accept or refuse. Nothing here backtracks: one pattern checks the
whole head, then plain string operations split it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_parser import SINGLETON_HEADERS
from aiohttp.http_writer import _serialize_headers
from multidict import CIMultiDict, CIMultiDictProxy

from ...core.value import value

MAX_HEAD = 16 * 1024  # longer heads go to aiohttp, which answers 400 or 431
MAX_NAME = 64  # longer header names go to aiohttp

_PREFIX = b"POST /v1/"
_LINE = re.compile(rb"POST (/v1/[a-z/]+) HTTP/1\.1\r\n")
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
# What no head aiohttp accepts has, even before it ends: a control byte, a bare LF or CR.
_REFUSED = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|(?<!\r)\n|\r(?=[^\n])")
# Headers that need aiohttp's handling: chunked or compressed bodies, 100-continue, upgrades
# (and the old WebSocket handshake aiohttp refuses).
_AIOHTTPS = ("transfer-encoding", "content-encoding", "expect", "upgrade",
             "sec-websocket-key1")


@value
class Head:
    """A request head the lane serves: its route, headers and framing."""

    path: str
    headers: CIMultiDictProxy[str]
    size: int  # bytes of the head, blank line included
    length: int  # bytes of the body that follows
    keep_alive: bool


class Other:
    """The verdict on a head the lane leaves to aiohttp."""


OTHER = Other()


class HeadReader:
    """Reads heads within aiohttp's limits for the server (``max_field_size``,
    ``max_headers``) and the body limit of the app."""

    def __init__(self, paths: Mapping[str, object], max_body: int, max_field_size: int,
                 max_headers: int) -> None:
        self.paths = paths
        self.max_body = max_body
        self.max_headers = max_headers
        value = max(max_field_size - MAX_NAME - 1, 0)
        self._fields = re.compile(
            rb"(?:" + _TOKEN + b"{1,%d}:[\\t\\x20-\\x7e\\x80-\\xff]{0,%d}\\r\\n)*"
            % (MAX_NAME, value))

    def _line(self, data: bytes | bytearray) -> re.Match[bytes] | None:
        """The request line, if it names a proxied route."""
        line = _LINE.match(data)
        return line if line is not None and line[1].decode() in self.paths else None

    def read(self, data: bytes | bytearray) -> Head | Other | None:
        """The head at the start of ``data``: a ``Head``, ``OTHER`` for aiohttp, or None
        while it is not whole yet."""
        if not _PREFIX.startswith(data[:len(_PREFIX)]):
            return OTHER
        end = data.find(b"\r\n\r\n", 0, MAX_HEAD)
        if end < 0:  # not whole yet: refused now if it cannot be a head the lane takes
            if (len(data) >= MAX_HEAD or _REFUSED.search(data) is not None
                    or (b"\r\n" in data and self._line(data) is None)):
                return OTHER
            return None
        line = self._line(data)
        if line is None:
            return OTHER
        block = data[line.end():end + 2]
        if self._fields.fullmatch(block) is None:
            return OTHER
        lines = block.decode("utf-8", "surrogateescape").split("\r\n")
        if len(lines) > self.max_headers + 1:
            return OTHER
        pairs = []
        for field in lines[:-1]:  # each a token, a colon and a value (checked above)
            name, _, value = field.partition(":")
            pairs.append((name, value.strip(" \t")))
        headers = CIMultiDictProxy(CIMultiDict(pairs))
        if "host" not in headers:
            return OTHER
        for name in _AIOHTTPS:
            if name in headers:
                return OTHER
        if len(pairs) != len({name.lower() for name, _ in pairs}) and any(
                len(headers.getall(name, ())) > 1 for name in SINGLETON_HEADERS):
            return OTHER
        given = headers.get("content-length", "0")
        if not (given.isascii() and given.isdigit() and len(given) <= 15):
            return OTHER
        length = int(given)
        if length > self.max_body:
            return OTHER
        # Proxy-Connection counts as Connection, as in aiohttp's parser.
        connection = [*headers.getall("connection", ()), *headers.getall("proxy-connection", ())]
        keep_alive = True
        if connection and (len(connection) > 1 or connection[0].lower() != "keep-alive"):
            tokens = {token.strip() for token in ",".join(connection).lower().split(",")}
            if "upgrade" in tokens:
                return OTHER
            keep_alive = "close" not in tokens
        return Head(line[1].decode(), headers, end + 4, length, keep_alive)


def whole_answer(response: web.StreamResponse, keep_alive: bool) -> tuple[bytes, bytes] | None:
    """A plain answer (a ``web.Response`` with a bytes body) as aiohttp would write it: the
    head and the body. None for anything else, which aiohttp's writer sends."""
    if (type(response) is not web.Response or response.prepared or response.chunked
            or response.compression or response.cookies):
        return None
    body, status = response.body, response.status
    if not isinstance(body, bytes) or status < 200 or status in (204, 304):
        return None
    headers = response.headers
    if "content-length" in headers:
        return None  # aiohttp's writer holds the body to it
    # Added to the answer's own headers, as aiohttp's writer does; then aiohttp's own
    # serializer, which refuses what aiohttp would refuse.
    added = {"Content-Length": str(len(body)),
             **writer_defaults(headers, keep_alive, has_body=bool(body))}
    headers.extend(added)
    try:
        head: bytes = _serialize_headers(f"HTTP/1.1 {status} {response.reason}", headers)
    except ValueError:  # a CR, LF or other control byte: left as it was, for aiohttp
        for name in added:
            del headers[name]
        return None
    return head, body


def writer_defaults(headers: Mapping[str, str], keep_alive: bool,
                    has_body: bool) -> dict[str, str]:
    """The headers aiohttp's response adds to an HTTP/1.1 answer that lacks them, in its
    order (after Content-Length or Transfer-Encoding)."""
    added = {}
    if has_body and "content-type" not in headers:
        added["Content-Type"] = "application/octet-stream"
    if "date" not in headers:
        added["Date"] = rfc822_formatted_time()
    if "server" not in headers:
        added["Server"] = SERVER_SOFTWARE
    if not keep_alive and "connection" not in headers:
        added["Connection"] = "close"
    return added
