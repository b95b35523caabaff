"""What the proxy decided about one call before sending it anywhere."""

from __future__ import annotations

from ..formats.request import Call
from ..value import value
from .budgets import Budget
from .route import ModelRoute


@value
class Plan:
    call: Call
    route: ModelRoute
    tier: int
    tier_name: str
    ceiling: int  # the most urgent tier the call may reach, aging included
    prompt_tokens: int
    output_tokens: int  # expected per choice, never above any candidate's max_output_tokens
    caller: str  # the principal's name
    arrived: float
    deadline: float  # arrival + the tier's max_wait_s: spans every pass through the queue
    caller_weight: float = 1.0  # its share of the tier beside the tier's other keys
    budget: Budget | None = None  # its key's spend budget, reserved at each dispatch

    @property
    def tokens(self) -> int:
        """What rate limits are charged for the call before its usage is known."""
        return self.prompt_tokens + self.output_tokens * self.call.choices
