"""The seam between the proxy and what its replicas share, and its embedded backend.

The pure scheduler stays each replica's own; what must hold across replicas goes through a
``State``: provider slots as leases (``lease``/``release``), rpm/tpm buckets
(``take_rate``/``reconcile_rate``), open breakers and 429 cuts; through ``answers``, the
response cache's entries and the Responses API's response homes; and the keys' spend
budgets (``budgets``: a ``BudgetBook``). ``MemoryState`` (one process) has nothing to
share: ``across_replicas`` is False, ``answers`` None, and the driver asks it nothing on
the request path; its budgets are the process's own ledger (``LocalBudgets``).
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..config.state import StateSettings
from ..core.call.budgets import Budget, Budgets, Refusal, Reservation
from ..core.value import value


def replica_id() -> str:
    """Unique across machines and restarts; readable in status pages."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"


@value
class Lease:
    member: str
    provider: str
    turn: int = 0  # the redis backend's: which call holds a lease handed from one to another


class Hooks(Protocol):
    """What the state tells the proxy it serves."""

    def on_mode(self, mode: str, alive: int) -> None:
        """``shared``, or ``local``/``reject`` while Redis cannot be reached; ``alive``:
        the replicas that sent a heartbeat within the lease TTL."""

    def on_breakers(self, open_for_s: Mapping[str, float]) -> None:
        """Deployments whose breaker a replica opened, with the seconds it stays open."""


class Answers(Protocol):
    """Cached answers and response homes shared by the replicas
    (``proxy.state.shared_answers.SharedAnswers``): a lookup that fails or is slow is a miss,
    a write that fails is dropped; neither raises."""

    on_error: Callable[[str], None]  # told the operation of every command that failed

    async def recall(self, fingerprint: bytes) -> tuple[bytes, float] | None: ...

    def keep(self, model: str, fingerprint: bytes, packed: bytes, ttl_s: float,
             max_entries: int) -> None: ...

    async def home(self, response_id: str) -> str | None: ...

    def remember(self, response_id: str, deployment: str) -> None: ...


class BudgetBook(Protocol):
    """The keys' spend budgets as the driver uses them (``proxy.core.call.budgets``): checked
    on arrival, reserved at dispatch, settled when an attempt ends."""

    @property
    def budgets(self) -> dict[str, Budget]: ...

    def configure(self, budgets: Mapping[str, Budget], timezone: str) -> None: ...

    def spent(self, key: str, wall: float) -> float: ...

    def check(self, key: str, estimate: float, wall: float) -> Refusal | None: ...

    async def reserve(self, key: str, estimate: float, maximum: float,
                      wall: float) -> Reservation | Refusal | None: ...

    def settle(self, reservation: Reservation, cost: float) -> None: ...

    def spend(self, key: str, usd: float, wall: float) -> None: ...

    def snapshot(self, wall: float) -> dict[str, dict[str, object]]: ...


class LocalBudgets(Budgets):
    """One process's budgets: its ledger decides (``reserve`` never waits for anything)."""

    async def reserve(self, key: str, estimate: float, maximum: float,
                      wall: float) -> Reservation | Refusal | None:
        return self.admit(key, estimate, maximum, wall)


class State(Protocol):
    across_replicas: bool  # False: nothing to ask on the request path
    replica: str

    @property
    def mode(self) -> str:
        """shared | local | reject"""

    @property
    def alive(self) -> int:
        """Replicas seen within the lease TTL."""

    @property
    def errors(self) -> int:
        """Redis operations that failed."""

    @property
    def answers(self) -> Answers | None:
        """None: the response cache and the response homes are this process's own."""

    async def start(self, hooks: Hooks) -> None: ...

    async def close(self) -> None: ...

    def configure(self, limits: Mapping[str, int], deployments: Sequence[str]) -> None: ...

    async def lease(self, provider: str, limit: int, rank: int, waited_s: float,
                    timeout_s: float, key: str = "", weight: float = 1.0,
                    claim_s: float = 0.0) -> Lease | None: ...

    def release(self, lease: Lease) -> None: ...

    def withdraw_below(self, provider: str, rank: int) -> bool: ...

    async def take_rate(self, name: str, rpm: int | None, tpm: int | None,
                        tokens: int) -> float: ...

    def reconcile_rate(self, name: str, rpm: int | None, tpm: int | None, requests: int,
                       tokens: int) -> None: ...

    def breaker_opened(self, deployment: str, open_for_s: float) -> None: ...

    def limit_cut(self, provider: str, limit: int, for_s: float) -> None: ...

    def budgets(self, budgets: Mapping[str, Budget], timezone: str,
                wall: Callable[[], float]) -> BudgetBook:
        """The keys' budgets (``wall``: the clock of their periods)."""
        ...

    def status(self) -> dict[str, object]: ...


class MemoryState:
    """One process: its scheduler is the whole truth."""

    across_replicas = False
    answers: Answers | None = None
    mode = "local"
    alive = 1
    errors = 0

    def __init__(self) -> None:
        self.replica = replica_id()

    async def start(self, hooks: Hooks) -> None:
        return None

    async def close(self) -> None:
        return None

    def configure(self, limits: Mapping[str, int], deployments: Sequence[str]) -> None:
        return None

    async def lease(self, provider: str, limit: int, rank: int, waited_s: float,
                    timeout_s: float, key: str = "", weight: float = 1.0,
                    claim_s: float = 0.0) -> Lease | None:
        return None

    def release(self, lease: Lease) -> None:
        return None

    def withdraw_below(self, provider: str, rank: int) -> bool:
        return False

    async def take_rate(self, name: str, rpm: int | None, tpm: int | None,
                        tokens: int) -> float:
        return 0.0

    def reconcile_rate(self, name: str, rpm: int | None, tpm: int | None, requests: int,
                       tokens: int) -> None:
        return None

    def breaker_opened(self, deployment: str, open_for_s: float) -> None:
        return None

    def limit_cut(self, provider: str, limit: int, for_s: float) -> None:
        return None

    def budgets(self, budgets: Mapping[str, Budget], timezone: str,
                wall: Callable[[], float]) -> BudgetBook:
        return LocalBudgets(budgets, timezone)

    def status(self) -> dict[str, object]:
        return {"backend": "memory", "replica": self.replica, "mode": "local",
                "replicas_alive": 1}


def open_state(settings: StateSettings) -> State:
    """The backend ``state:`` names (Redis' client is imported only when it is used)."""
    if settings.backend == "redis":
        from .shared import RedisState

        return RedisState(settings)
    return MemoryState()
