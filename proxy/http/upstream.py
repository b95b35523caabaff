"""The seam between the proxy and a provider: one small Protocol.

``Upstream.send`` opens one call and returns once the response head is in; the body is
then read chunk by chunk. Real providers go through ``HttpUpstream`` (aiohttp); the
in-process ``simulated`` provider implements the same Protocol, and tests swap in their own.
Errors: implementations raise only ``proxy.errors.UpstreamConnectError`` /
``UpstreamTimeout`` / ``UpstreamBadResponse`` — aiohttp's own exceptions are translated in
exactly one place (``HttpUpstream``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from ..core.errors import UpstreamBadResponse, UpstreamConnectError, UpstreamTimeout
from ..core.provider import Timeouts


@dataclass(frozen=True)
class UpstreamRequest:
    path: str  # e.g. "/chat/completions", relative to the provider's base URL
    body: bytes  # JSON, already rewritten (upstream model name, stream options)
    model: str  # upstream model name
    stream: bool
    headers: Mapping[str, str]  # extra request headers to pass on (already filtered)


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises UpstreamTimeout if idle too long."""
        ...

    async def read(self) -> bytes:
        """The whole body (non-streaming)."""
        ...

    def close(self) -> None:
        """Abort the call and release the connection; safe to call twice."""
        ...


class Upstream(Protocol):
    async def send(self, request: UpstreamRequest, timeouts: Timeouts) -> UpstreamResponse: ...

    async def close(self) -> None: ...


class HttpUpstream:
    """An OpenAI-compatible provider over HTTP; the one place aiohttp errors become ours."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        auth_headers: Mapping[str, str],
        query: Mapping[str, str] | None = None,
        max_response_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self._session = session
        self._max_response_bytes = max_response_bytes
        self._base_url = base_url.rstrip("/")
        self._auth_headers = dict(auth_headers)
        self._query = dict(query or {})
        self._client_timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    async def send(self, request: UpstreamRequest, timeouts: Timeouts) -> HttpResponse:
        headers = {**request.headers, **self._auth_headers, "content-type": "application/json"}
        budget = timeouts.first_byte_s if request.stream else timeouts.response_s
        deadline = asyncio.get_running_loop().time() + budget
        try:
            async with asyncio.timeout_at(deadline):
                response = await self._session.post(
                    self._base_url + request.path,
                    data=request.body,
                    headers=headers,
                    params=self._query or None,
                    allow_redirects=False,
                    timeout=self._client_timeout(timeouts),
                )
        except aiohttp.ServerTimeoutError as exc:  # connect timed out
            raise UpstreamConnectError("connecting to the provider timed out") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no response within {budget:g}s") from exc
        except (aiohttp.ClientConnectionError, OSError) as exc:
            # The detail (the provider's address) stays in the chain for logs, not in the
            # message a client sees.
            raise UpstreamConnectError(
                f"connecting to the provider failed ({type(exc).__name__})"
            ) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamBadResponse(
                f"the provider's response was malformed ({type(exc).__name__})"
            ) from exc
        return HttpResponse(response, timeouts, deadline, self._max_response_bytes)

    def _client_timeout(self, timeouts: Timeouts) -> aiohttp.ClientTimeout:
        client_timeout = self._client_timeouts.get(timeouts)
        if client_timeout is None:
            client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect_s)
            self._client_timeouts[timeouts] = client_timeout
        return client_timeout

    async def close(self) -> None:
        return None


class HttpResponse:
    def __init__(
        self, response: aiohttp.ClientResponse, timeouts: Timeouts, deadline: float,
        max_bytes: int,
    ) -> None:
        self._response = response
        self._max_bytes = max_bytes
        self._timeouts = timeouts
        self._deadline = deadline
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._read_bounded()
        except TimeoutError as exc:
            raise UpstreamTimeout("response not complete in time") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamBadResponse(
                f"the provider's response broke ({type(exc).__name__})"
            ) from exc
        finally:
            self.close()

    async def _read_bounded(self) -> bytes:
        # Content-Length counts the bytes on the wire: past a compressed body's length the
        # answer can be any size, so only an uncompressed one is read in one go.
        length = self._response.content_length
        encoded = self._response.headers.get("content-encoding", "identity") != "identity"
        if length is not None and length <= self._max_bytes and not encoded:
            return await self._response.read()
        parts: list[bytes] = []
        size = 0
        async for part in self._response.content.iter_any():
            size += len(part)
            if size > self._max_bytes:
                raise UpstreamBadResponse(
                    f"the provider's response is larger than {self._max_bytes} bytes"
                )
            parts.append(part)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        deadline = self._deadline  # the first chunk counts against the first-byte budget
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await content.readany()
                except TimeoutError as exc:
                    raise UpstreamTimeout("upstream stream stalled") from exc
                except (aiohttp.ClientError, OSError) as exc:
                    raise UpstreamBadResponse(
                        f"the provider's stream broke ({type(exc).__name__})"
                    ) from exc
                if not data:  # end of the body
                    return
                yield data
                deadline = asyncio.get_running_loop().time() + self._timeouts.idle_s
        finally:
            self.close()

    def close(self) -> None:
        self._response.close()
