"""Rate limits (rpm/tpm), as pure state driven by ``now`` (monotonic seconds).

- ``RollingCounts``: counters over a rolling window in a fixed ring of buckets.
- ``TokenBucket`` / ``RateLimits``: rpm and tpm buckets per provider (and per key), plus
  the upstream's own ``x-ratelimit-*`` view, so a call waits instead of drawing a 429.

Adaptive concurrency lives with the provider's slots, in ``proxy.core.scheduling.capacity``.
Retry policy (allowance, backoff, ``retry-after``) is in ``proxy.core.call.retry``.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Mapping


class RollingCounts:
    """Named counters over the last ``window_s`` seconds.

    Time is cut into ``buckets`` buckets of ``window_s / buckets`` seconds; the window is the
    current bucket and the ones before it, so memory stays bounded whatever the call rate.
    """

    def __init__(self, window_s: float, buckets: int = 10) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be positive and buckets at least 1")
        self._bucket_s = window_s / buckets
        self._buckets = buckets
        self._ring: deque[tuple[int, dict[str, int]]] = deque()

    def add(self, name: str, now: float, n: int = 1) -> None:
        ring = self._ring
        bucket = math.floor(now / self._bucket_s)
        if not ring or ring[-1][0] != bucket:  # an add in the newest bucket touches nothing else
            self._prune(now)
            if not ring or ring[-1][0] < bucket:
                ring.append((bucket, {}))
        counts = ring[-1][1]
        counts[name] = counts.get(name, 0) + n

    def total(self, name: str, now: float) -> int:
        self._prune(now)
        return sum(counts.get(name, 0) for _, counts in self._ring)

    def clear(self) -> None:
        self._ring.clear()

    def _prune(self, now: float) -> int:
        bucket = math.floor(now / self._bucket_s)
        while self._ring and self._ring[0][0] <= bucket - self._buckets:
            self._ring.popleft()
        return bucket


# Refill arithmetic leaves float dust; a shortfall smaller than this is no shortfall.
EPSILON = 1e-9


class TokenBucket:
    """``rate_per_min`` tokens a minute, holding at most ``burst`` (default: one minute's worth).

    What it holds may go negative after an oversized ``take`` or an ``adjust`` that charges more
    than was estimated; that debt is repaid by the refill before anything else is taken. It
    never goes below ``-capacity``, so one absurd number cannot stop the bucket for longer
    than two refills.
    """

    def __init__(self, rate_per_min: float, burst: float | None = None) -> None:
        if rate_per_min <= 0:
            raise ValueError("rate_per_min must be positive")
        self.rate_per_min = rate_per_min
        self.capacity = rate_per_min if burst is None else burst
        if self.capacity <= 0:
            raise ValueError("burst must be positive")
        self._available = self.capacity
        self._updated: float | None = None

    def available(self, now: float) -> float:
        """The tokens in the bucket at ``now`` (negative: a debt)."""
        self._refill(now)
        return self._available

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` could be taken; 0.0 if now. Takes nothing.

        A request larger than the whole bucket goes once the bucket is full (and leaves it in
        debt), so an oversized call is slowed, never refused forever.
        """
        self._refill(now)
        shortfall = min(n, self.capacity) - self._available
        if shortfall <= EPSILON:
            return 0.0
        return shortfall * 60.0 / self.rate_per_min

    def take(self, n: float, now: float) -> float:
        """Take ``n`` and return 0.0, or take nothing and return the seconds to wait."""
        wait = self.wait_s(n, now)
        if wait == 0.0:
            self._available = max(-self.capacity, self._available - n)
        return wait

    def adjust(self, delta: float, now: float) -> None:
        """Give back (positive) or charge (negative) tokens, e.g. estimated minus actual."""
        self._refill(now)
        self._available = min(self.capacity, max(-self.capacity, self._available + delta))

    def _refill(self, now: float) -> None:
        if self._updated is not None and now > self._updated:
            gained = (now - self._updated) * self.rate_per_min / 60.0
            self._available = min(self.capacity, self._available + gained)
        if self._updated is None or now > self._updated:
            self._updated = now


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")


def parse_duration(text: str) -> float | None:
    """Seconds in an ``x-ratelimit-reset-*`` value: ``"1s"``, ``"6m0s"``, ``"20ms"``,
    ``"1h2m3.5s"``, or a bare number of seconds. None if it is not one of those."""
    text = text.strip().lower()
    if not text.endswith(("h", "m", "s")):  # no float() ends so: skip its ValueError
        try:
            seconds = float(text)
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    total = 0.0
    position = 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            return None
        total += float(match.group(1)) * scale[match.group(2)]
        position = match.end()
    if position == 0 or position != len(text):
        return None
    return total


def lowercase_keys(headers: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


class _UpstreamQuota:
    """What the provider last said it has left of one limit, until its reset time."""

    def __init__(self) -> None:
        self.remaining = math.inf
        self.reset_at = -math.inf

    def wait_s(self, need: float, now: float) -> float:
        if now >= self.reset_at or self.remaining >= need:
            return 0.0
        return self.reset_at - now

    def spend(self, amount: float, now: float) -> None:
        if now < self.reset_at:
            self.remaining -= amount


class RateLimits:
    """A provider's (or a key's) rpm/tpm buckets plus the upstream's ``x-ratelimit-*`` headers.

    ``rpm`` / ``tpm`` of None means no local limit of that kind. The headers are honoured
    whether or not local limits are configured: once the provider reports fewer requests or
    tokens remaining than a call needs, calls wait for its reset (at most ``max_pause_s``).
    """

    def __init__(
        self,
        rpm: int | None = None,
        tpm: int | None = None,
        *,
        max_pause_s: float = 120.0,
        default_reset_s: float = 1.0,
    ) -> None:
        self.rates = (rpm, tpm)
        self.requests = None if rpm is None else TokenBucket(rpm)
        self.tokens = None if tpm is None else TokenBucket(tpm)
        self.max_pause_s = max_pause_s
        self.default_reset_s = default_reset_s
        self._upstream_requests = _UpstreamQuota()
        self._upstream_tokens = _UpstreamQuota()

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds until a call of ``tokens`` (prompt + expected output) could go. Takes nothing."""
        # The longest of the waits (conditions, not max(): a builtin call costs more here).
        wait = self._upstream_requests.wait_s(1, now)
        other = self._upstream_tokens.wait_s(tokens, now)
        if other > wait:
            wait = other
        if self.requests is not None and (other := self.requests.wait_s(1, now)) > wait:
            wait = other
        if self.tokens is not None and (other := self.tokens.wait_s(tokens, now)) > wait:
            wait = other
        return wait

    def take(self, tokens: int, now: float) -> float:
        """0.0 and the call's share is taken; otherwise the seconds to wait (nothing taken)."""
        wait = self.wait_s(tokens, now)
        if wait > 0.0:
            return wait
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        self._upstream_requests.spend(1, now)
        self._upstream_tokens.spend(tokens, now)
        return 0.0

    def refund(self, tokens: int, now: float, request: bool = True) -> None:
        """Give back what ``take`` took for a call that did not use it (with ``request``
        False, the request itself counted: only the tokens come back)."""
        if request and self.requests is not None:
            self.requests.adjust(1, now)
        self.reconcile(tokens, 0, now)

    def reconcile(self, estimated: int, actual: int, now: float) -> None:
        """Correct the tpm bucket (and the provider's reported quota) once the response's
        ``usage`` is known."""
        if self.tokens is not None:
            self.tokens.adjust(estimated - actual, now)
        self._upstream_tokens.spend(actual - estimated, now)

    def observe_headers(self, headers: Mapping[str, str], now: float) -> None:
        """Learn the provider's ``x-ratelimit-*`` view from a response's headers."""
        if ("x-ratelimit-remaining-requests" not in headers
                and "x-ratelimit-remaining-tokens" not in headers):
            # Another mapping's names may be in any case; an upstream response's are lower
            # case already, and copying all its headers would cost more than all the rest.
            headers = lowercase_keys(headers)
        for kind, quota in (
            ("requests", self._upstream_requests),
            ("tokens", self._upstream_tokens),
        ):
            remaining_text = headers.get(f"x-ratelimit-remaining-{kind}")
            if remaining_text is None:
                continue
            try:
                remaining = float(remaining_text)
            except ValueError:
                continue
            if not math.isfinite(remaining):
                continue
            reset = parse_duration(headers.get(f"x-ratelimit-reset-{kind}", ""))
            quota.remaining = remaining
            quota.reset_at = now + min(
                self.default_reset_s if reset is None else reset, self.max_pause_s
            )

    def paused_until(self, now: float) -> float:
        """When the provider's reported quota allows a call again (``now`` if it does)."""
        until = now
        if self._upstream_requests.wait_s(1, now) > 0.0:
            until = max(until, self._upstream_requests.reset_at)
        if self._upstream_tokens.wait_s(1, now) > 0.0:
            until = max(until, self._upstream_tokens.reset_at)
        return until
