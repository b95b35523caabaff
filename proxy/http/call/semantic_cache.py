"""The semantic cache, opt-in per model (``models.<name>.semantic_cache``).

Which calls it may answer, and what must match exactly, is ``proxy.core.caching.questions``'s; the
entries, their nearest neighbour, TTL and bound are ``proxy.state.vectors``'. This module
does the I/O: the question's embedding comes from ``embedding_model`` through this proxy's
own listener (the way batch lines are sent, ``proxy.http.work.loopback``): on behalf of the
calling key, at the calling call's tier, so it queues, is counted and is billed like any
call, and the calling call holds nothing while it waits. A hit answers as the exact cache
does (JSON, or a replayed SSE stream), with no slot, no upstream tokens and no cost. Any
failure of the lookup (the embedding model down, slow, refusing) is a plain miss: the call
goes on as if the model had no semantic cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from ...core.caching.questions import SEMANTIC_KINDS, Question, band, may_answer_from_past, question
from ...core.call.plan import Plan
from ...core.call.route import ModelRoute, SemanticSettings
from ...core.clock import Clock
from ...core.errors import UpstreamError
from ...core.formats.request import Call
from ...core.health.provider import Timeouts
from ..base.appkeys import RECORD
from ..base.edge import Incoming
from ..base.metrics import Metrics
from ..upstream.upstream import HttpUpstream, UpstreamRequest
from .auth import ON_BEHALF
from .cache import Entry, fingerprint_of
from .hits import hit_response

if TYPE_CHECKING:
    from ...state.base import State
    from ...state.shared_semantic import Shared, SharedSemantic
    from ...state.vectors import VectorStore

EMBEDDING_TIMEOUT_S = 10.0  # at most this long for the vector,
LOOKUP_SHARE = 0.25  # and at most this share of the time left before the call's deadline
MAX_EMBEDDING_BYTES = 1 << 20
CONNECT_S = 2.0


class Pending:
    """A call that missed: its answer, once there is one, is kept under its vector."""

    __slots__ = ("fingerprint", "model", "scope", "vector")

    def __init__(self, model: str, scope: bytes, vector: list[float],
                 fingerprint: bytes) -> None:
        self.model, self.scope, self.vector = model, scope, vector
        self.fingerprint = fingerprint  # the response cache's, of the call


class SemanticCache:
    def __init__(self, clock: Clock, metrics: Metrics, token: str) -> None:
        self._clock, self._metrics, self._token = clock, metrics, token
        self._stores: dict[str, tuple[SemanticSettings, VectorStore[Entry]]] = {}
        self._loopback: HttpUpstream | None = None
        self._shared: SharedSemantic | None = None  # the redis backend: entries shared

    def configure(self, models: Mapping[str, ModelRoute]) -> None:
        """The models' settings as configured now: a store whose settings did not change
        keeps its entries."""
        stores = {}
        for name, route in models.items():
            settings = route.semantic_cache
            if settings is None:
                continue
            found = self._stores.get(name)
            if found is not None and found[0] == settings:
                stores[name] = found
                continue
            from ...state.vectors import VectorStore  # the semantic extra, only when used
            stores[name] = (settings, VectorStore(settings.max_entries, settings.ttl_s))
        self._stores = stores
        self._share_models()

    def share(self, state: State) -> None:
        """With the redis backend, the entries are shared with the other replicas."""
        if not state.across_replicas or self._shared is not None:
            return
        from ...state.shared import RedisState
        from ...state.shared_semantic import SharedSemantic
        if isinstance(state, RedisState):
            self._shared = SharedSemantic(state, self._received)
            errors = self._metrics.semantic_shared_errors
            self._shared.on_error = lambda operation: errors.get(operation).inc()
            self._share_models()

    def _share_models(self) -> None:
        if self._shared is not None:
            from ...state.shared_semantic import Bounds
            self._shared.configure({name: Bounds(s.max_entries, s.ttl_s)
                                    for name, (s, _) in self._stores.items()})

    def _received(self, model: str, shared: Shared) -> None:
        """An answer another replica kept."""
        found = self._stores.get(model)
        if found is not None and shared.age_s < found[0].ttl_s:
            entry = Entry(shared.answer, shared.deployment, shared.prompt_tokens,
                          shared.completion_tokens)
            found[1].add(shared.scope, shared.vector, entry, self._clock.now() - shared.age_s)

    def listening(self, base_url: str) -> None:
        """Where this proxy listens: the embeddings are asked for there."""
        if self._loopback is None:
            self._loopback = HttpUpstream(base_url.rstrip("/"),
                                          {"authorization": f"Bearer {self._token}"},
                                          max_response_bytes=MAX_EMBEDDING_BYTES)

    def size(self, model: str) -> int:
        found = self._stores.get(model)
        if found is None:
            return 0
        found[1].expire(self._clock.now())
        return len(found[1])

    def applies(self, call: Call, headers: Mapping[str, str]) -> bool:
        return (call.model in self._stores and call.kind in SEMANTIC_KINDS
                and may_answer_from_past(call.body, headers))

    async def look_up(self, request: Incoming, plan: Plan) -> web.Response | Pending | None:
        """The cached answer (a response), or what to keep the answer under (a miss), or
        None (bypassed, or the lookup failed)."""
        call, key_name, tier_name = plan.call, plan.caller, plan.tier_name
        settings, store = self._stores[call.model]
        metrics, started = self._metrics, self._clock.now()
        asked = question(call.kind, key_name, call.model, call.body)
        if not isinstance(asked, Question):
            metrics.semantic_lookups.get(call.model, "bypass").inc()
            return None
        limit = min(EMBEDDING_TIMEOUT_S, LOOKUP_SHARE * (plan.deadline - started))
        vector = await self._embedding(settings.embedding_model, asked.text, key_name,
                                       tier_name, limit)
        if vector is None:
            metrics.semantic_lookups.get(call.model, "error").inc()
            return None
        found = store.nearest(asked.scope, vector, self._clock.now(), settings.threshold)
        metrics.semantic_seconds.get(call.model).observe(self._clock.now() - started)
        if found is not None:
            metrics.semantic_nearest.get(call.model, band(found[0])).inc()
        if found is None or found[0] < settings.threshold:
            metrics.semantic_lookups.get(call.model, "miss").inc()
            request[RECORD].cache = "semantic_miss"
            return Pending(call.model, asked.scope, vector, fingerprint_of(key_name, call))
        metrics.semantic_lookups.get(call.model, "hit").inc()
        return _answer(request, call, tier_name, found[1], found[0],
                       self._clock.now() - started)

    def keep(self, pending: Pending | None, entry: Entry) -> None:
        """A missed call's answer, kept for the calls that ask the same by meaning."""
        if pending is None:
            return
        found = self._stores.get(pending.model)
        if found is not None:
            found[1].add(pending.scope, pending.vector, entry, self._clock.now())
            if self._shared is not None:
                self._shared.add(pending.model, pending.scope, pending.vector, entry.answer,
                                 entry.deployment, entry.prompt_tokens,
                                 entry.completion_tokens)

    async def _embedding(self, model: str, text: str, key_name: str, tier_name: str,
                         limit_s: float) -> list[float] | None:
        """The embedding of ``text`` by ``model`` through this proxy; None if it fails."""
        if self._loopback is None or limit_s <= 0:
            return None
        body = orjson.dumps({"model": model, "input": text})
        headers = {ON_BEHALF: key_name, "X-Priority": tier_name}
        try:
            async with asyncio.timeout(limit_s):
                response = await self._loopback.send(
                    UpstreamRequest("/v1/embeddings", body, model, False, headers),
                    Timeouts(CONNECT_S, limit_s, limit_s, limit_s))
                try:
                    data = await response.read()
                    status = response.status
                finally:
                    response.close()
        except (UpstreamError, TimeoutError):
            return None
        return _vector(data) if status == 200 else None

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()
        if self._loopback is not None:
            await self._loopback.close()


def _vector(data: bytes) -> list[float] | None:
    try:
        answer: Any = orjson.loads(data)
        vector = answer["data"][0]["embedding"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(vector, list) or not vector or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
        return None
    return vector


def _answer(request: Incoming, call: Call, tier_name: str, entry: Entry, similarity: float,
            took_s: float) -> web.Response:
    """A hit: the kept answer, as JSON or as the stream the call asks for."""
    return hit_response(request, call, entry, "semantic", tier_name, took_s,
                        **{"x-proxy-cache-similarity": f"{similarity:.4f}"})
