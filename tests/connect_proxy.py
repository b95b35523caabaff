"""A tiny egress proxy the tests start on 127.0.0.1: it reads ``CONNECT host:port``, checks
``Proxy-Authorization`` when told to, answers 200 and splices bytes to 127.0.0.1:port
(whatever the host: a provider's name need not resolve here), and records what it saw."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class Seen:
    line: str  # "CONNECT provider.test:8443 HTTP/1.1"
    headers: dict[str, str]  # names in lower case


@dataclass
class ConnectProxy:
    credentials: str | None = None  # "user:password" it insists on (407 otherwise)
    refuse: int | None = None  # answers every CONNECT with this status
    silent: bool = False  # reads CONNECT and never answers
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    tunnels: int = 0  # CONNECTs answered 200
    open: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def targets(self) -> list[str]:
        return [seen.line.split()[1] for seen in self.seen]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open.add(writer)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            line, *rest = head.rstrip("\r\n").split("\r\n")
            headers = {name.strip().lower(): value.strip()
                       for name, _, value in (h.partition(":") for h in rest)}
            self.seen.append(Seen(line, headers))
            method, target, _ = line.split(" ", 2)
            expected = None if self.credentials is None else "Basic " + base64.b64encode(
                self.credentials.encode()).decode()
            if self.silent:
                await reader.read()
                return
            if method != "CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
                return
            if self.refuse is not None or (expected is not None
                                           and headers.get("proxy-authorization") != expected):
                status = self.refuse or 407
                writer.write(f"HTTP/1.1 {status} No\r\nproxy-authenticate: Basic realm=\"t\"\r\n"
                             "content-length: 6\r\n\r\nrefuse".encode())
                await writer.drain()
                return
            _, _, port = target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(port))
            self.open.add(up_writer)
            self.tunnels += 1
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await asyncio.gather(splice(reader, up_writer), splice(up_reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.open.discard(writer)
            writer.close()


async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def connect_proxy(**settings: object) -> AsyncIterator[ConnectProxy]:
    proxy = ConnectProxy(**settings)  # type: ignore[arg-type]
    listener = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    proxy.url = f"http://127.0.0.1:{port}"
    async with listener:
        try:
            yield proxy
        finally:
            for writer in list(proxy.open):
                writer.close()
