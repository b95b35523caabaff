"""What is Anthropic's own in a ``kind: anthropic`` provider's answers: its rate-limit
headers, read as the ``x-ratelimit-*`` ones every other provider sends.

Anthropic reports ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` (and
the same for ``input-tokens`` and ``output-tokens``), each reset an RFC 3339 time; the
proxy's provider limits read ``x-ratelimit-remaining-*`` and a reset in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

PREFIX = "anthropic-ratelimit-"


def quota_headers(headers: Mapping[str, str], wall: float) -> dict[str, str]:
    """The ``x-ratelimit-*`` view of an Anthropic answer's headers at wall time ``wall``
    (empty if it has none). ``tokens`` is Anthropic's most restrictive token limit."""
    found: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        remaining = headers.get(f"{PREFIX}{kind}-remaining")
        if remaining is None:
            continue
        found[f"x-ratelimit-remaining-{kind}"] = remaining
        reset = _seconds_until(headers.get(f"{PREFIX}{kind}-reset", ""), wall)
        if reset is not None:
            found[f"x-ratelimit-reset-{kind}"] = f"{reset:.3f}"
    return found


def _seconds_until(text: str, wall: float) -> float | None:
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return max(at.timestamp() - wall, 0.0)
