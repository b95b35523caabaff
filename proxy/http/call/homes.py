"""Where each stored Responses API answer lives.

A call with ``previous_response_id`` may only go to the deployment holding that
response (``Engine.plan``, pure: it asks the engine's own map). With the redis backend a
replica that did not relay the response asks Redis for its home before the call is
planned, and teaches its engine what it hears; a response it relays is told to Redis as
well as to its engine.
"""

from __future__ import annotations

from ...core.call.route import Deployment
from ...core.formats.request import Call
from .service import Service


async def find_home(service: Service, call: Call) -> None:
    """A call continuing a response this replica knows no home for: the fleet's, if it
    knows one (redis backend; nothing is learnt if Redis is slow or away)."""
    response_id, answers = call.previous_response_id, service.shared.answers
    route = service.engine.models.get(call.model)
    if (response_id is None or answers is None or route is None
            or service.engine.home(response_id) is not None):
        return
    found = await answers.home(response_id)
    for deployment in route.candidates:
        if deployment.id == found:
            service.engine.remember_response(response_id, deployment)
            return


def remember_home(service: Service, call: Call, response_id: str | None,
                  deployment: Deployment) -> None:
    """A Responses API answer: calls that continue it go where it lives."""
    if call.kind == "responses" and response_id is not None:
        service.engine.remember_response(response_id, deployment)
        answers = service.shared.answers
        if answers is not None:
            answers.remember(response_id, deployment.id)
