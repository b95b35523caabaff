"""Where each stored Responses API answer lives.

A call with ``previous_response_id`` may only go to the deployment holding that
response (``Engine.plan``, pure: it asks the engine's own map). With the redis backend a
replica that did not relay the response asks Redis for its home before the call is
planned, and teaches its engine what it hears; a response it relays is told to Redis as
well as to its engine.
"""

from __future__ import annotations

from ...core.call.route import Deployment
from ...core.engine import Engine
from ...core.formats.request import Call
from ...state.base import Answers


class Homes:
    """Where stored Responses API answers live (see the module)."""

    def __init__(self, engine: Engine, answers: Answers | None) -> None:
        self._engine, self._answers = engine, answers

    async def find(self, call: Call) -> None:
        """A call continuing a response this replica knows no home for: the fleet's, if it
        knows one (redis backend; nothing is learnt if Redis is slow or away)."""
        response_id, answers = call.previous_response_id, self._answers
        route = self._engine.models.get(call.model)
        if (response_id is None or answers is None or route is None
                or self._engine.home(response_id) is not None):
            return
        found = await answers.home(response_id)
        for deployment in route.candidates:
            if deployment.id == found:
                self._engine.remember_response(response_id, deployment)
                return

    def remember(self, call: Call, response_id: str | None, deployment: Deployment) -> None:
        """A Responses API answer: calls that continue it go where it lives."""
        if call.kind == "responses" and response_id is not None:
            self._engine.remember_response(response_id, deployment)
            if self._answers is not None:
                self._answers.remember(response_id, deployment.id)
