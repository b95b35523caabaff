"""Work that can wait calls this proxy's own listener, as its owner, in the batch tier:
through the same client as provider calls (``upstream``), never through an egress proxy,
trying again while the proxy turns the call away."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from ...config import Config
from ...core.call.retry import parse_retry_after
from ...core.clock import Clock
from ...core.errors import UpstreamError
from ...core.health.provider import Timeouts
from ..call.auth import ON_BEHALF
from ..upstream.upstream import HttpUpstream, UpstreamRequest

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
CONNECT_S = 5.0


def batch_tier(config: Config) -> str:
    """The tier work runs in: ``batch.tier``, else the least urgent."""
    names = config.tier_names
    return config.batch.tier if config.batch.tier in names else names[-1]


class Loopback:
    def __init__(self, base_url: str, token: str, config: Config, clock: Clock) -> None:
        # Its answer is at most what a provider may answer.
        largest = max((p.max_response_bytes for p in config.providers.values()),
                      default=64 * 1024 * 1024)
        self._upstream = HttpUpstream(base_url, {"authorization": f"Bearer {token}"},
                                      max_response_bytes=largest)
        self._tier = batch_tier(config)
        self._clock = clock

    async def answer(self, owner: str, path: str, body: bytes, request_id: str,
                     until: float) -> tuple[int, bytes] | None:
        """The call's answer, trying again while the proxy turns it away; None if
        ``until`` (epoch seconds) comes first."""
        delay = RETRY_MIN_S
        while True:
            try:
                status, data, retry_after = await self._call(owner, path, body, request_id,
                                                             until)
            except UpstreamError:
                status, data, retry_after = 0, b"", None
            if status and status not in RETRY_STATUSES:
                return status, data
            wait = min(max(retry_after or delay, RETRY_MIN_S), RETRY_MAX_S)
            if self._clock.wall() + wait >= until:
                return None
            await asyncio.sleep(wait)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _call(self, owner: str, path: str, body: bytes, request_id: str,
                    until: float) -> tuple[int, bytes, float | None]:
        """(status, body, retry-after seconds) of ``path``, if it answers before ``until``."""
        headers: Mapping[str, str] = {ON_BEHALF: owner, "X-Priority": self._tier,
                                      "x-request-id": request_id}
        timeout_s = max(until - self._clock.wall(), RETRY_MIN_S)
        response = await self._upstream.send(
            UpstreamRequest(path, body, "", False, dict(headers)),
            Timeouts(CONNECT_S, timeout_s, timeout_s, timeout_s))
        return response.status, await response.read(), parse_retry_after(response.headers)

    async def close(self) -> None:
        await self._upstream.close()
