"""The call's tier as ``priority`` to a self-hosted server that schedules by it (vLLM,
SGLang: docs/self-hosted.md), and a server started without priority scheduling found out
from its 400 and sent its calls without the field from then on."""

from __future__ import annotations

import logging

from ...core.call.route import Deployment
from ...core.engine import Engine
from .exchange import Exchange

log = logging.getLogger("proxy.http.call.forward")  # the name log filters know it by

# What vLLM says (lower-cased) to a ``priority`` when started without priority scheduling.
PRIORITY_REFUSED = b"priority scheduling"


def prioritise(engine: Engine, body: dict[str, object], exchange: Exchange,
               deployment: Deployment, order: str) -> None:
    """The call's tier as ``priority``, for a server that schedules by it; none (the
    client's own neither) where it refused the field, or for this call's attempt after
    a 400 about it (``refused_priority``)."""
    body.pop("priority", None)
    if (deployment.provider in engine.fleet.priority_refused
            or exchange.withheld_priority):
        return
    index, name = exchange.tier(engine.tier_names)
    body["priority"] = deployment.priority(name, index, len(engine.tier_names), order)
    exchange.sent_priority = True


def refused_priority(exchange: Exchange, status: int, data: bytes) -> bool:
    """A 400 that says the server does not schedule by priority (vLLM: "Priority
    scheduling is not enabled"), to an attempt that sent the field: the call goes again
    without it. Only when that attempt is not refused the same way is the server held
    to refuse the field (a client's own bad request may quote the words)."""
    if (status != 400 or not exchange.sent_priority
            or PRIORITY_REFUSED not in data.lower()):
        return False
    exchange.withheld_priority = True
    return True


def confirm_refusal(engine: Engine, exchange: Exchange, deployment: Deployment,
                    status: int) -> None:
    """The attempt sent without ``priority`` after a 400 about it: answered otherwise,
    the field was the fault; not sent to that server again, said once."""
    if (exchange.withheld_priority and status != 400
            and engine.fleet.refuse_priority(deployment.provider)):
        log.warning("provider %s refused the priority field (started without priority "
                    "scheduling): sending its calls without it from now",
                    deployment.provider)
