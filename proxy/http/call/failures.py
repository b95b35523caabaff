"""An upstream's failing answer (a 429, 529, 5xx, 401 or 403) as the verdict the attempt
policy reads, and what of it the client may get if every attempt fails."""

from __future__ import annotations

from aiohttp import web

from ...core.call.attempts import tier_declined
from ...core.call.commands import Result
from ...core.call.retry import parse_retry_after
from ...core.call.route import Deployment
from ...core.clock import Clock
from ...core.health.fleet import AUTH, DECLINED, FAILURE, OVERLOADED, THROTTLED
from ..base.appkeys import REQUEST_ID
from ..base.edge import upstream_headers
from ..upstream.upstream import UpstreamResponse
from . import translate
from .exchange import Exchange

OVERLOADED_STATUS = 529  # Anthropic's overloaded_error


async def upstream_failure(exchange: Exchange, response: UpstreamResponse,
                           deployment: Deployment, direction: str | None, clock: Clock,
                           tier_names: tuple[str, ...]) -> Result:
    """A 429, 529, 5xx, 401 or 403. A 5xx is kept, to be passed through (in the
    client's format) if every attempt fails; a 429 never reaches the client (the call
    waits for the pause instead) and an auth failure's body may quote the provider's
    key."""
    body = await response.read()
    status = response.status
    retry_after = parse_retry_after(response.headers, clock.wall())
    if status in (401, 403):
        return Result(AUTH, status=status)
    if tier_declined(exchange.attempts.service_tier, status, body):
        return Result(DECLINED, status=status)
    if status == 429:
        return Result(THROTTLED, status=status, retry_after_s=retry_after)
    headers = upstream_headers(response.headers, error=True)
    headers["x-proxy-upstream"] = deployment.id
    headers["x-proxy-tier"] = exchange.tier(tier_names)[1]
    if direction is not None:
        body = translate.answer(direction, body, status, 0,
                                exchange.request[REQUEST_ID])
        headers["content-type"] = "application/json"
    exchange.failure = web.Response(body=body, status=status, headers=headers)
    return Result(OVERLOADED if status == OVERLOADED_STATUS else FAILURE, status=status,
                  retry_after_s=retry_after)
