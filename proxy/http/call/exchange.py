"""One call's state on the HTTP side (``Exchange``): what the call path's modules hand one
another while the call lasts."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ...core.call.attempts import Attempts
from ...core.call.plan import Plan
from ...core.formats.events import Translation
from ...state.base import Lease
from ..base.edge import Incoming
from .semantic_cache import Pending


@dataclass(slots=True)
class Exchange:
    """One call's state on the HTTP side, the driver's alone: what the client will get,
    once there is something, and what the attempt in flight holds."""

    request: Incoming
    plan: Plan
    attempts: Attempts
    answer: web.StreamResponse | None = None
    failure: web.Response | None = None  # the last upstream failure, kept to pass through
    fingerprint: bytes | None = None  # a cacheable call that missed: its answer is kept
    lease: Lease | None = None  # the provider slot held across replicas (redis backend)
    semantic: Pending | None = None  # a semantic cache miss: its answer is kept
    translation: Translation | None = None  # the attempt's request, in another format
    sent_priority: bool = False  # the attempt in flight carries the proxy's ``priority``
    withheld_priority: bool = False  # a 400 said the server does not schedule by it

    def tier(self, names: tuple[str, ...]) -> tuple[int, str]:
        """The call's tier now (index, name) among ``names``, the engine's: a reload may
        have moved it since it arrived."""
        ticket = self.attempts.ticket
        tier = self.plan.tier if ticket is None else ticket.tier
        return (tier, names[tier]) if tier < len(names) else (
            self.plan.tier, self.plan.tier_name)
