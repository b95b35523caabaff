"""Quantiles of measured waits, for the dashboard and the simulator's reports."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of a sorted list (0.0 when it is empty)."""
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)] if ordered else 0.0
