"""Request traces in the Azure LLM inference format (``TIMESTAMP,ContextTokens,
GeneratedTokens``), for the benchmarks and the tests that replay real arrivals."""

from __future__ import annotations

import csv
import datetime
from pathlib import Path

__all__ = ["SHIPPED_TRACE", "read_trace"]

# The first 11 minutes of the public Azure conversation trace, shipped with the repo.
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "traces/azure_llm_conv_2023_first11min.csv"


def read_trace(path: Path, start_s: float = 0.0,
               length_s: float = float("inf")) -> list[tuple[float, int, int]]:
    """(seconds after ``start_s``, prompt tokens, output tokens) of the calls that arrived
    in ``[start_s, start_s + length_s)`` after the trace's first call."""
    rows: list[tuple[float, int, int]] = []
    first: datetime.datetime | None = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26])
            first = first or stamp
            t = (stamp - first).total_seconds() - start_s
            if 0 <= t < length_s:
                rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return rows
