"""What the proxy knows about one provider: limits, timers, health settings, simulation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .breaker import BreakerSettings
from .engines import Figures


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0
    first_byte_s: float = 60.0
    idle_s: float = 60.0
    response_s: float = 600.0


@dataclass(frozen=True)
class SimSettings:
    ttft_s: float = 0.2
    tokens_per_s: float = 50.0
    prefill_tokens_per_s: float = 0.0  # 0 = prompt length does not matter
    default_output_tokens: int = 64
    max_output_tokens: int = 4096  # like a real model's limit, whatever max_tokens asks
    error_rate: float = 0.0  # fraction of calls answered 500
    capacity: int | None = None  # concurrent calls before answering 429
    # A self-hosted server's own limits: past ``slots`` running, calls wait inside it (first
    # come, first served); past ``slows_past`` running, each is slower in proportion.
    slots: int | None = None
    slows_past: int | None = None
    seed: int | None = None

    def pace(self, running: int) -> float:
        """How many times its time a call takes with ``running`` running (``slows_past``)."""
        past = self.slows_past
        return running / past if past is not None and running > past else 1.0

    def figures(self, engine: str | None, running: int, waiting: int) -> Figures:
        """What ``engine``'s pages would say of it: its slots only where llama.cpp tells
        them, a KV-cache use as the share of slots in use where vLLM and SGLang do."""
        slots = self.slots
        kv = None if slots is None or engine == "llama.cpp" else min(1.0, running / slots)
        return Figures(running, waiting, slots if engine == "llama.cpp" else None, kv)


@dataclass(frozen=True)
class EgressProxy:
    """The HTTP proxy a provider is reached through (``HTTPS_PROXY`` / ``HTTP_PROXY``):
    calls go through a CONNECT tunnel to the provider."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)  # Proxy-Authorization

    @property
    def display_url(self) -> str:
        """Where it is, without its credentials: ``http://proxy.corp:3128``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


# How the engines that schedule by ``priority`` order it.
PRIORITY_ORDER = {"vllm": "lower", "sglang": "higher"}


@dataclass(frozen=True)
class Provider:
    name: str
    kind: str
    max_concurrency: int
    base_url: str = ""
    api_key: str = field(default="", repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    query: Mapping[str, str] = field(default_factory=dict)
    timeouts: Timeouts = field(default_factory=Timeouts)
    accepts_service_tier: bool = False
    max_response_bytes: int = 64 * 1024 * 1024  # a non-streamed answer, at most
    rpm: int | None = None
    tpm: int | None = None
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    sim: SimSettings | None = None  # the built-in simulated upstream (kind simulated)
    timing: SimSettings | None = None  # the simulator's timing model (any kind)
    egress: EgressProxy | None = None  # None: the provider is reached directly
    # A self-hosted server the proxy reads (vllm, sglang, llama.cpp; None: not read), and
    # whether its limit is learned (``max_concurrency: auto``): from the server's figures
    # where it is read, else from latency. ``max_concurrency`` is then only a cap.
    engine: str | None = None
    auto: bool = False
    priority: bool = True  # send the call's tier as ``priority`` (engines vllm and sglang)
    read_every_s: float = 1.0  # how often a server's figures are read

    @property
    def priority_order(self) -> str | None:
        """How the server orders by ``priority`` ("lower" or "higher" first), None where
        the field is not sent."""
        return PRIORITY_ORDER.get(self.engine or "") if self.priority else None
