"""A concurrency limit learned from latency, for an upstream that never answers 429.

In the manner of Netflix's concurrency-limits (Gradient2) and Envoy's adaptive concurrency
filter: each answered call is a sample of the upstream's latency per token (seconds over
its output tokens plus ``OVERHEAD_TOKENS``, so short and long calls compare); a slow
*baseline* follows the fastest the upstream has been lately, a fast *recent* figure
follows what it is now. While recent stays within ``tolerance`` of the baseline the limit
grows (towards itself plus its square root, a sample); when it climbs past, the limit
shrinks by the ratio (towards at most half of itself); smoothed, between 1 and the cap. A
limit the proxy does not fill (fewer than half its calls in flight) does not grow: an idle
upstream proves nothing.

Pure: told its samples, never reads a clock.
"""

from __future__ import annotations

import math

OVERHEAD_TOKENS = 8  # a call's fixed cost (first token, prefill) counted as this many tokens
START = 8  # the limit before samples say more (at most the cap)
TOLERANCE = 1.5  # latency up to this multiple of the baseline is not load
SMOOTHING = 0.2  # how far one sample moves the limit towards what it implies
RECENT_WEIGHT = 0.2  # the recent figure's moving-average weight per sample
BASELINE_DRIFT = 0.005  # how fast the baseline follows a slower upstream, per sample


class LatencyLimit:
    def __init__(self, cap: int, start: int = START) -> None:
        if cap < 1:
            raise ValueError("cap must be at least 1")
        self.cap = cap
        self.value = float(min(max(start, 1), cap))
        self.baseline: float | None = None
        self.recent: float | None = None

    @property
    def limit(self) -> int:
        return max(1, int(self.value))

    def sample(self, seconds: float, tokens: int, inflight: int) -> int:
        """An answered call: ``seconds`` from send to its end, ``tokens`` it produced,
        ``inflight`` the proxy's calls there when it ended (itself included). The limit
        now."""
        if not (math.isfinite(seconds) and seconds > 0) or tokens < 0:
            return self.limit
        latency = seconds / (tokens + OVERHEAD_TOKENS)
        baseline, recent = self.baseline, self.recent
        if baseline is None or recent is None:
            self.baseline = self.recent = latency
            return self.limit
        recent += (latency - recent) * RECENT_WEIGHT
        baseline = latency if latency < baseline else baseline + (
            latency - baseline) * BASELINE_DRIFT
        self.baseline, self.recent = baseline, recent
        gradient = min(1.0, max(0.5, TOLERANCE * baseline / recent))
        value = self.value
        if gradient < 1.0:
            wanted = value * gradient
        elif inflight * 2 < value:
            return self.limit  # not using what it has: no evidence it can take more
        else:
            wanted = value + math.sqrt(value)
        self.value = min(float(self.cap), max(1.0, value + (wanted - value) * SMOOTHING))
        return self.limit

    def snapshot(self) -> dict[str, object]:
        return {"limit": self.limit,
                "baseline_s_per_token": None if self.baseline is None else round(
                    self.baseline, 6),
                "recent_s_per_token": None if self.recent is None else round(self.recent, 6)}
