"""A bounded map that forgets its least recently used entry.

``cachetools.LRUCache`` runs several Python-level methods per lookup, and the estimators
look up several times per call; this one is an ``OrderedDict`` underneath, whose lookups
and reorderings are C.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    __slots__ = ("_data", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        found = self._data.get(key)
        if found is not None:
            self._data.move_to_end(key)
        return found

    def __setitem__(self, key: K, value: V) -> None:
        data = self._data
        data[key] = value
        data.move_to_end(key)
        if len(data) > self.maxsize:
            data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
