"""One replica's heartbeat on the wire: what it tells Redis (the arguments of
``scripts.HEARTBEAT``, in the order that script reads them: counted lists of providers,
held leases, waiters and deployments) and what Redis answers."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any


def heartbeat_args(prefix: str, replica: str, ttl_ms: int, recreate: bool, beats: int,
                   limits: Mapping[str, int], held: Sequence[tuple[str, str]],
                   unwritten: Collection[str], waiting: Sequence[tuple[str, str]],
                   deployments: Sequence[str]) -> list[str | int]:
    """``held`` and ``waiting``: (member, provider); ``unwritten``: held members Redis has
    not seen; ``beats``: the heartbeats Redis has answered so far."""
    args: list[str | int] = [prefix, replica, ttl_ms, int(recreate), beats + 1, beats,
                             len(limits)]
    for name, limit in limits.items():
        args += [name, limit]
    args.append(len(held))
    for member, provider in held:
        args += [provider, member, int(member in unwritten)]
    args.append(len(waiting))
    for member, provider in waiting:
        args += [provider, member]
    args.append(len(deployments))
    args += deployments
    return args


def read_answer(answer: Sequence[Any]) -> tuple[int, list[str], list[str], dict[str, float],
                                                bool]:
    """(replicas alive, granted waiters, lost waiters, open breakers → seconds left, Redis
    had forgotten this replica)."""
    alive, granted, lost, opened, forgot = answer
    open_for = {opened[i]: int(opened[i + 1]) / 1000 for i in range(0, len(opened), 2)}
    return int(alive), list(granted), list(lost), open_for, bool(int(forgot))
