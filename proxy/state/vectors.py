"""A model's semantic cache entries: vectors by scope, nearest neighbour, TTL and LRU.

Entries live ``ttl_s`` from when they were added (a hit does not extend it); at most
``max_entries`` of them: adding to a full store drops the expired ones, then the least
recently used. A scope (what must match exactly, ``proxy.core.caching.questions``) is searched on
its own: a small one (at most ``SMALL`` entries) exactly, with numpy; a larger one in a
usearch HNSW index. Vectors are kept in half precision either way (2 bytes a dimension;
the similarity is off by about 1e-4, where 8-bit vectors are off by up to 0.02).
Needs the ``semantic`` extra (numpy, usearch); the time is the caller's, never read here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
from usearch.index import Index

T = TypeVar("T")
SMALL = 256  # a scope past this many entries is searched in an HNSW index
CONNECTIVITY, EXPANSION_ADD, EXPANSION_SEARCH = 16, 128, 64


@dataclass(slots=True)
class _Stored(Generic[T]):
    scope: bytes
    expires: float
    payload: T


@dataclass(slots=True)
class _Scope:
    """One scope's vectors: rows of a matrix (exact search), or an HNSW index."""

    dim: int
    ids: list[int] = field(default_factory=list)
    rows: np.ndarray | None = None
    index: Index | None = None

    def add(self, entry: int, vector: np.ndarray) -> None:
        if self.index is not None:
            self.index.add(entry, vector)
            return
        self.ids.append(entry)
        row = vector.astype(np.float16).reshape(1, -1)
        rows = row if self.rows is None else np.vstack([self.rows, row])
        if len(self.ids) <= SMALL:
            self.rows = rows
            return
        self.index = Index(ndim=self.dim, metric="cos", dtype="f16",
                           connectivity=CONNECTIVITY, expansion_add=EXPANSION_ADD,
                           expansion_search=EXPANSION_SEARCH)
        self.index.add(np.array(self.ids, dtype=np.uint64), rows)
        self.ids, self.rows = [], None

    def remove(self, entry: int) -> None:
        if self.index is not None:
            self.index.remove(entry)
            return
        at = self.ids.index(entry)
        del self.ids[at]
        assert self.rows is not None
        self.rows = np.delete(self.rows, at, axis=0) if self.ids else None

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.ids)

    def nearest(self, vector: np.ndarray) -> tuple[int, float] | None:
        if self.index is not None:
            if len(self.index) == 0:
                return None
            found = self.index.search(vector, 1)
            if len(found.keys) == 0:
                return None
            return int(found.keys[0]), 1.0 - float(found.distances[0])
        if self.rows is None:
            return None
        similarities = self.rows.astype(np.float32) @ vector
        best = int(np.argmax(similarities))
        return self.ids[best], float(similarities[best])


class VectorStore(Generic[T]):
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[int, _Stored[T]] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[int, None] = OrderedDict()  # oldest first: expiry order
        self._scopes: dict[bytes, _Scope] = {}
        self._next = 0
        self.dim: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def nearest(self, scope: bytes, vector: list[float] | np.ndarray, now: float,
                threshold: float = 1.0) -> tuple[float, T] | None:
        """(similarity, payload) of the entry of ``scope`` closest to ``vector``, if any;
        it counts as used (for the LRU order) if it is at least ``threshold`` similar."""
        self.expire(now)
        found = self._scopes.get(scope)
        unit = self._unit(vector)
        if found is None or unit is None:
            return None
        match = found.nearest(unit)
        if match is None:
            return None
        entry, similarity = match
        if similarity >= threshold:
            self._entries.move_to_end(entry)
        return min(similarity, 1.0), self._entries[entry].payload

    def add(self, scope: bytes, vector: list[float] | np.ndarray, payload: T,
            now: float) -> int | None:
        """Keep ``payload`` under ``vector`` in ``scope``; its id (None: not a usable vector)."""
        unit = self._unit(vector, adding=True)
        if unit is None:
            return None
        self.expire(now)
        while len(self._entries) >= self.max_entries:
            self.remove(next(iter(self._entries)))
        entry = self._next
        self._next += 1
        found = self._scopes.get(scope)
        if found is None:
            found = self._scopes[scope] = _Scope(unit.shape[0])
        found.add(entry, unit)
        self._entries[entry] = _Stored(scope, now + self.ttl_s, payload)
        self._by_age[entry] = None
        return entry

    def remove(self, entry: int) -> None:
        stored = self._entries.pop(entry, None)
        if stored is None:
            return
        del self._by_age[entry]
        found = self._scopes[stored.scope]
        found.remove(entry)
        if not len(found):
            del self._scopes[stored.scope]

    def expire(self, now: float) -> None:
        while self._by_age:
            oldest = next(iter(self._by_age))
            if self._entries[oldest].expires > now:
                return
            self.remove(oldest)

    def clear(self) -> None:
        self._entries.clear()
        self._by_age.clear()
        self._scopes.clear()
        self.dim = None

    def _unit(self, vector: list[float] | np.ndarray, adding: bool = False) -> np.ndarray | None:
        """``vector`` of length one (float32); None if it is empty, zero or of another
        dimension than the store's (an embedding model that changed: the store starts over)."""
        unit = np.asarray(vector, dtype=np.float32).reshape(-1)
        norm = float(np.linalg.norm(unit))
        if unit.size == 0 or not np.isfinite(norm) or norm == 0.0:
            return None
        if self.dim != unit.size:
            if not adding:
                return None
            self.clear()
            self.dim = unit.size
        return unit / norm
