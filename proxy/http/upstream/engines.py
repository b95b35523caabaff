"""Reading a self-hosted server's own figures: what it runs, what waits in its queue.

- vLLM: ``/metrics`` (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``, before v0.10 ``vllm:gpu_cache_usage_perc``), summed over
  its engines (data parallel).
- SGLang (``--enable-metrics``): ``/metrics`` (``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``), of its first tensor/pipeline rank.
- llama.cpp's ``llama-server``: ``/metrics`` with ``--metrics``
  (``llamacpp:requests_processing``, ``llamacpp:requests_deferred``), else ``/slots``
  (its slots' ``is_processing``); its slot count from ``/props`` (``total_slots``).

One reader per server: one read in flight, each bounded by a timeout, on a timer and soon
after an answer (``nudge``), never on a call's path; the figures go to the fleet
(``Fleet.engine_read``), a failure too (``Fleet.engine_failed``): the core decides what
they are worth. A long page is parsed in a worker thread; llama.cpp's slots are asked
again after a failed read or when its figures no longer fit them (a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from typing import TypeVar

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from ...core.health.engines import Figures
from ...core.health.provider import Provider
from .simulated import SimulatedUpstream

log = logging.getLogger(__name__)
T = TypeVar("T")

READ_TIMEOUT_S = 2.0  # one read's bound (at most the read interval)
NUDGE_GAP_S = 0.25  # after an answer, a read no sooner than this
THREAD_BYTES = 64 * 1024  # a page longer than this is parsed in a worker thread
PAGE_BYTES = 16 * 1024 * 1024  # a page longer than this is not read: the server unreadable
PROPS_EVERY = 30  # llama.cpp: its slot count read again every this many reads

# engine -> (running, waiting, KV use) metric names, first found wins for KV use.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    "llama.cpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                  ("llamacpp:kv_cache_usage_ratio",)),
}


class Unreadable(Exception):
    """The server's figures could not be had (the message says why)."""


def server_root(base_url: str) -> str:
    """Where a server's own endpoints are: its base URL without a trailing ``/v1``."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def parse_metrics(engine: str, text: str) -> Figures:
    """Figures from a Prometheus text page; Unreadable without the running and waiting
    gauges."""
    running_name, waiting_name, kv_names = METRICS[engine]
    wanted = {running_name, waiting_name, *kv_names}
    # Only the lines of the wanted gauges are parsed (a vLLM page holds many histograms).
    lines = [line for line in text.splitlines()
             if line.startswith(tuple(wanted)) or (line.startswith("# TYPE ") and any(
                 line[7:].startswith(name + " ") for name in wanted))]
    sums: dict[str, float] = {}  # running and waiting: summed over engines
    kv: float | None = None  # KV use: a fraction per engine, the fullest counts
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name not in wanted or not math.isfinite(sample.value):
                continue
            labels = sample.labels
            if labels.get("tp_rank", "0") != "0" or labels.get("pp_rank", "0") != "0":
                continue  # SGLang: every rank reports the same scheduler
            if sample.name in kv_names:
                if kv is None or sample.name == kv_names[0]:
                    kv = sample.value if kv is None else max(kv, sample.value)
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    if running_name not in sums or waiting_name not in sums:
        raise Unreadable(f"/metrics has no {running_name} and {waiting_name}")
    return Figures(running=round(sums[running_name]), waiting=round(sums[waiting_name]),
                   kv_use=None if kv is None else min(max(kv, 0.0), 1.0))


async def parse(engine: str, body: bytes) -> Figures:
    """``parse_metrics`` of a page, in a worker thread when it is long (a vLLM with many
    engines writes hundreds of kilobytes), so the event loop is not held up."""
    if len(body) < THREAD_BYTES:
        return parse_metrics(engine, body.decode("utf-8", "replace"))
    return await asyncio.to_thread(parse_metrics, engine, body.decode("utf-8", "replace"))


def parse_slots(data: bytes) -> tuple[int, int]:
    """(slots, slots processing) from llama.cpp's ``/slots``."""
    slots = orjson.loads(data)
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise Unreadable("/slots is not a list of slots")
    return len(slots), sum(1 for s in slots if s.get("is_processing") is True)


def parse_props(data: bytes) -> int:
    """llama.cpp's slot count from ``/props``."""
    props = orjson.loads(data)
    total = props.get("total_slots") if isinstance(props, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise Unreadable("/props has no total_slots")
    return total


class EngineReader:
    """Reads one server on a timer and when nudged; hands each outcome to ``on_read`` /
    ``on_failure``. A simulated provider (``simulated``) is read in process."""

    def __init__(self, provider: Provider, session: aiohttp.ClientSession,
                 on_read: Callable[[str, Figures], None],
                 on_failure: Callable[[str, str], None],
                 simulated: SimulatedUpstream | None = None) -> None:
        assert provider.engine is not None
        self.provider = provider
        self._engine = provider.engine
        self._simulated = simulated
        self._root = server_root(provider.base_url)
        self._session = session
        self._on_read, self._on_failure = on_read, on_failure
        self._headers = ({"authorization": f"Bearer {provider.api_key}"}
                         if provider.api_key else {})
        self._wake: asyncio.Future[bool] | None = None  # the pause between reads
        self._task: asyncio.Task[None] | None = None
        self._slots: int | None = None
        self._props_due = False  # llama.cpp: its slots are asked again on the next read
        self._reads = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def nudge(self) -> None:
        """An answer came from the server: read it again soon."""
        if self._wake is not None:
            _settle(self._wake, True)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        every = self.provider.read_every_s
        timeout = min(READ_TIMEOUT_S, every)
        name = self.provider.name
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(timeout):
                    figures = await self.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is "unreadable", told
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, TimeoutError):
                    reason = f"no answer in {timeout:g} s"
                self._props_due = True  # restarted, perhaps: its slots asked again
                self._told(self._on_failure, name, reason)
            else:
                self._told(self._on_read, name, figures)
            wake = self._wake = loop.create_future()
            timer = loop.call_later(every, _settle, wake, False)
            try:
                nudged = await wake
            finally:
                timer.cancel()
            if nudged:
                await asyncio.sleep(NUDGE_GAP_S)

    @staticmethod
    def _told(callback: Callable[[str, T], None], name: str, what: T) -> None:
        """A reading told to the fleet; a fault there is logged, and the reads go on."""
        try:
            callback(name, what)
        except Exception:  # the reader must outlive a fault in what it reports to
            log.exception("provider %s: acting on its server's figures failed", name)

    async def read(self) -> Figures:
        engine = self._engine
        if self._simulated is not None:
            return self._simulated.figures(engine)
        if engine != "llama.cpp":
            status, body = await self._get("/metrics")
            if status != 200:
                raise Unreadable(f"/metrics answered {status}")
            return await parse(engine, body)
        return await self._read_llama()

    async def _read_llama(self) -> Figures:
        self._reads += 1
        if self._slots is None or self._props_due or self._reads % PROPS_EVERY == 0:
            status, body = await self._get("/props")
            if status != 200:
                raise Unreadable(f"/props answered {status}")
            self._slots, self._props_due = parse_props(body), False
        status, body = await self._get("/metrics")
        if status == 200:
            found = await parse(self._engine, body)
            figures = Figures(found.running, found.waiting, self._slots, found.kv_use)
        else:
            status, body = await self._get("/slots")
            if status != 200:
                raise Unreadable("neither /metrics nor /slots answers (start llama-server "
                                 "with --metrics, or without --no-slots)")
            slots, processing = parse_slots(body)
            figures = Figures(processing, 0, slots)
        # Calls waiting, or more running than the slots it said: it may have restarted
        # with other slots; they are asked again on the next read.
        self._props_due = figures.waiting > 0 or figures.running > (self._slots or 0)
        return figures

    async def _get(self, path: str) -> tuple[int, bytes]:
        async with self._session.get(self._root + path, headers=self._headers,
                                     allow_redirects=False) as response:
            too_long = Unreadable(f"{path} is longer than {PAGE_BYTES // 2**20} MiB")
            if (response.content_length or 0) > PAGE_BYTES:
                raise too_long
            body = bytearray()
            async for chunk in response.content.iter_chunked(THREAD_BYTES):
                body += chunk
                if len(body) > PAGE_BYTES:
                    raise too_long
            return response.status, bytes(body)


def _settle(wake: asyncio.Future[bool], nudged: bool) -> None:
    if not wake.done():
        wake.set_result(nudged)


class Readers:
    """A reader per provider that names an ``engine``, kept in step with the config."""

    def __init__(self, on_read: Callable[[str, Figures], None],
                 on_failure: Callable[[str, str], None]) -> None:
        self._on_read, self._on_failure = on_read, on_failure
        self._readers: dict[str, EngineReader] = {}
        self._session: aiohttp.ClientSession | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    def configure(self, providers: Mapping[str, Provider],
                  upstreams: Mapping[str, object]) -> None:
        """Start readers for servers new or changed, stop those no longer configured.
        Needs a running loop; before ``start`` it only remembers."""
        self._providers, self._upstreams = providers, upstreams
        if self._session is None:
            return
        for name in list(self._readers):
            reader = self._readers[name]
            if providers.get(name) != reader.provider:
                del self._readers[name]
                task = asyncio.get_running_loop().create_task(reader.close())
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
        for name, provider in providers.items():
            if provider.engine is not None and name not in self._readers:
                upstream = self._upstreams.get(name)
                reader = self._readers[name] = EngineReader(
                    provider, self._session, self._on_read, self._on_failure,
                    upstream if isinstance(upstream, SimulatedUpstream) else None)
                reader.start()

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S), trust_env=False)
        self.configure(self._providers, self._upstreams)

    def nudge(self, name: str) -> None:
        reader = self._readers.get(name)
        if reader is not None:
            reader.nudge()

    async def close(self) -> None:
        await asyncio.gather(*(reader.close() for reader in self._readers.values()),
                             *self._retiring, return_exceptions=True)
        self._readers.clear()
        if self._session is not None:
            await self._session.close()
