"""Live numbers for the dashboard: what calls ended with, kept for the last minutes."""

from __future__ import annotations

from .access import CallRecord


class LiveStats:
    """Told about every proxied call when it ends (``call_ended``)."""

    def call_ended(self, status: int, record: CallRecord, now: float) -> None:
        """``now``: the service clock's time (monotonic seconds)."""
