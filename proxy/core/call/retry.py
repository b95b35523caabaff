"""Retry policy as pure functions of ``now`` and an injected ``random.Random``.

- ``RetryAllowance``: retries stay within a fraction of first attempts, per provider.
- ``backoff_s``: exponential backoff with full jitter that honours ``retry-after``.
- ``parse_retry_after``: ``retry-after-ms`` / ``retry-after`` as the upstream sent them.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

from ..health.limits import EPSILON, RollingCounts, lowercase_keys


@dataclass(frozen=True)
class RetrySettings:
    max_attempts: int = 3  # upstream attempts per call, the first one included
    budget: float = 0.2  # each provider's RetryAllowance: retries as a fraction of its calls
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0


class RetryAllowance:
    """Retries within ``ratio`` of first attempts over a rolling window.

    Call ``on_call`` for each first attempt only (not for retries), and ``try_retry`` before
    each retry. A retry is allowed while retries in the window stay within
    ``ratio * calls + min_per_s * window_s``; the second term lets a quiet provider retry once.
    """

    def __init__(self, ratio: float = 0.2, min_per_s: float = 0.1, window_s: float = 10.0) -> None:
        if ratio < 0 or min_per_s < 0:
            raise ValueError("ratio and min_per_s must not be negative")
        self.ratio = ratio
        self.min_retries = min_per_s * window_s
        self._counts = RollingCounts(window_s)

    def on_call(self, now: float) -> None:
        self._counts.add("calls", now)

    def available(self, now: float) -> float:
        """Retries that could be made now (may be fractional)."""
        allowed = self.ratio * self._counts.total("calls", now) + self.min_retries
        return max(0.0, allowed - self._counts.total("retries", now))

    def try_retry(self, now: float) -> bool:
        if self.available(now) < 1.0 - EPSILON:
            return False
        self._counts.add("retries", now)
        return True


def backoff_s(
    attempt: int,
    rng: random.Random,
    base: float = 0.25,
    cap: float = 8.0,
    retry_after_s: float | None = None,
    max_retry_after_s: float = 60.0,
) -> float:
    """Delay before retry number ``attempt`` (1 = first retry): full jitter, uniform in
    ``[0, min(cap, base * 2**(attempt-1))]``, but never shorter than the upstream's
    ``retry-after`` (itself capped at ``max_retry_after_s``)."""
    ceiling = min(cap, base * 2.0 ** min(max(attempt - 1, 0), 60))
    delay = rng.uniform(0.0, ceiling)
    if retry_after_s is not None:
        delay = max(delay, min(max(retry_after_s, 0.0), max_retry_after_s))
    return delay


def parse_retry_after(headers: Mapping[str, str], wall_now: float | None = None) -> float | None:
    """Seconds the upstream asks us to wait: ``retry-after-ms`` first, then ``retry-after``
    in seconds or as an HTTP date (needs ``wall_now``, epoch seconds). None if absent or
    unreadable."""
    lowered = lowercase_keys(headers)
    milliseconds = _non_negative(lowered.get("retry-after-ms"))
    if milliseconds is not None:
        return milliseconds / 1000.0
    text = lowered.get("retry-after")
    if text is None:
        return None
    seconds = _non_negative(text)
    if seconds is not None:
        return seconds
    if wall_now is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        # RFC 5322 "-0000": UTC with no claim about the sender's zone.
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - wall_now)


def _non_negative(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
