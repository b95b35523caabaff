"""The estimators' bounded map: least recently used goes first, never above its size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.lru import Lru


def test_a_lookup_keeps_an_entry_and_the_least_recent_one_goes() -> None:
    lru: Lru[str, int] = Lru(2)
    lru["a"] = 1
    lru["b"] = 2
    assert lru.get("a") == 1  # "b" is now the least recently used
    lru["c"] = 3
    assert (lru.get("a"), lru.get("b"), lru.get("c"), len(lru)) == (1, None, 3, 2)


def test_setting_a_key_again_refreshes_it_without_growing() -> None:
    lru: Lru[str, int] = Lru(2)
    lru["a"] = 1
    lru["b"] = 2
    lru["a"] = 10
    lru["c"] = 3
    assert (lru.get("a"), lru.get("b"), len(lru)) == (10, None, 2)


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Lru(0)


@given(st.integers(1, 5), st.lists(st.tuples(st.booleans(), st.integers(0, 8)), max_size=60))
def test_it_holds_what_a_reference_lru_holds(size: int, steps: list[tuple[bool, int]]) -> None:
    lru: Lru[int, int] = Lru(size)
    reference: list[int] = []  # least recent first
    for write, key in steps:
        if write:
            lru[key] = key
            if key in reference:
                reference.remove(key)
            reference.append(key)
            del reference[:-size]
        else:
            assert (lru.get(key) == key) == (key in reference)
            if key in reference:
                reference.remove(key)
                reference.append(key)
    assert len(lru) == len(reference) <= size
    assert all(lru.get(key) == key for key in reference)
