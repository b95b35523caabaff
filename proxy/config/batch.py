"""``batch:`` and ``storage:``: work that can wait (the Batch API, background responses)
and the embedded SQLite file that keeps it across restarts."""

from __future__ import annotations

from dataclasses import dataclass

from .reader import Node, fail

MIB = 1024 * 1024


@dataclass(frozen=True)
class BatchSettings:
    tier: str  # the tier batch lines and background calls run in
    max_in_flight: int = 64  # lines handed to the scheduler at once, per batch
    retention_days: float = 7.0  # files, batches and results are deleted after this
    max_file_bytes: int = 200 * MIB  # one uploaded file
    max_lines: int = 50_000  # lines in one batch's input file


@dataclass(frozen=True)
class StorageSettings:
    path: str = "triage.db"  # SQLite; ":memory:" keeps nothing across restarts
    max_bytes: int = 10 * 1024 * MIB  # past this, uploads and new work are refused


def parse_batch(node: Node, tier_names: tuple[str, ...]) -> BatchSettings:
    tier = node.string("tier", tier_names[-1])
    if tier not in tier_names:
        fail(node.sub("tier"), f"unknown tier (tiers: {', '.join(tier_names)})")
    settings = BatchSettings(
        tier=tier,
        max_in_flight=node.integer("max_in_flight", 64, minimum=1, maximum=10_000),
        retention_days=node.number("retention_days", 7.0, positive=True, maximum=3650.0),
        max_file_bytes=node.integer("max_file_bytes", 200 * MIB, minimum=1),
        max_lines=node.integer("max_lines", 50_000, minimum=1, maximum=10_000_000),
    )
    node.check_unknown()
    return settings


def parse_storage(node: Node) -> StorageSettings:
    settings = StorageSettings(
        path=node.string("path", "triage.db"),
        max_bytes=node.integer("max_bytes", 10 * 1024 * MIB, minimum=MIB),
    )
    node.check_unknown()
    return settings
