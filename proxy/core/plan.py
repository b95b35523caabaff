"""What the proxy decided about one call before forwarding it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Call
from .route import ModelRoute


@dataclass
class Plan:
    call: Call
    route: ModelRoute
    tier: int
    tier_name: str
    prompt_tokens: int
    output_tokens: int
    caller: str  # the principal's name
    deadline: float  # arrival + the tier's max_wait_s: spans every pass through the queue
    queue_s: float = 0.0
    tried: set[str] = field(default_factory=set)
