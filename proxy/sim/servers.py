"""The simulated providers a replay sends calls to: how long one serves a call, and what
each is doing meanwhile.

A call is served for its provider's ``simulate:`` timing (``ttft_s`` + prompt /
``prefill_tokens_per_s`` + output / ``tokens_per_s``; the ``estimate:`` priors for
providers without one). A ``simulate:`` block's faults apply too: 429 past ``capacity``
calls at once, 500 at ``error_rate`` (seeded: the same every run). A self-hosted server's
too: past ``slots`` running, calls wait inside it, first come first served; past
``slows_past`` running, a call starting is slower in proportion; its engine reads as the
live simulated provider's figures.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from ..config import Config
from ..core.call.commands import Result
from ..core.call.route import Deployment
from ..core.health.engines import Figures
from ..core.health.fleet import Verdict
from ..core.health.provider import SimSettings


def service_s(config: Config, deployment: Deployment, prompt: int, output: int) -> tuple[
        float, float]:
    """(time to first token, whole service time) of a call on ``deployment``."""
    sim = config.providers[deployment.provider].timing
    if sim is None:
        priors = config.estimate
        ttft = priors.ttft_s + prompt * priors.prefill_seconds_per_token
        return ttft, ttft + output * priors.seconds_per_token
    ttft = sim.ttft_s + (prompt / sim.prefill_tokens_per_s if sim.prefill_tokens_per_s else 0)
    return ttft, ttft + output / sim.tokens_per_s


class Servers:
    """The calls each provider accepted and, of those, the calls running (the rest wait
    inside a self-hosted server for one of its slots)."""

    def __init__(self, config: Config) -> None:
        self._providers = config.providers
        self._rng = random.Random(0)  # the same faults on every run
        self.serving = dict.fromkeys(config.providers, 0)  # calls a provider accepted
        self.running = dict.fromkeys(config.providers, 0)  # of those, running (not inside)
        self.inside: dict[str, deque[Callable[[float], None]]] = {
            name: deque() for name in config.providers}

    def refusal(self, timing: SimSettings, provider: str) -> Result | None:
        """A 429 past the provider's ``capacity`` (the calls it is serving; one it refused
        is not among them), or a 500 at its ``error_rate``; None: it answers."""
        if timing.capacity is not None and self.serving[provider] >= timing.capacity:
            return Result(Verdict.THROTTLED, status=429)
        if timing.error_rate and self._rng.random() < timing.error_rate:
            return Result(Verdict.FAILURE, status=500)
        return None

    def full(self, provider: str) -> bool:
        """Every one of the server's ``slots`` is running a call: the next waits inside."""
        timing = self._providers[provider].timing
        slots = timing.slots if timing is not None else None
        return slots is not None and self.running[provider] >= slots

    def slower(self, provider: str) -> float:
        """How many times its time a call starting now takes (past ``slows_past``)."""
        timing = self._providers[provider].timing
        return 1.0 if timing is None else timing.pace(self.running[provider])

    def ended(self, provider: str, end: float) -> None:
        """A call on ``provider`` ended at ``end``: the first waiting inside starts."""
        self.serving[provider] -= 1
        self.running[provider] -= 1
        inside = self.inside[provider]
        if inside:
            inside.popleft()(end)

    def figures(self, provider: str) -> Figures:
        """The server's engine figures, as the live simulated provider gives them."""
        settings = self._providers[provider]
        running, waiting = self.running[provider], len(self.inside[provider])
        if settings.timing is None:
            return Figures(running, waiting)
        return settings.timing.figures(settings.engine, running, waiting)
