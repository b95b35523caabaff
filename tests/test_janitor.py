"""After a burst, once idle, the proxy collects its garbage and trims the heap; never while
a call is in progress, never for a handful of calls."""

from __future__ import annotations

import asyncio
from unittest import mock

from proxy.http.base.drain import Lifecycle
from proxy.http.server.janitor import Janitor, _malloc_trim


async def test_it_sweeps_only_when_idle_after_enough_calls() -> None:
    lifecycle, done = Lifecycle(), []
    janitor = Janitor(lifecycle, min_calls=3, collect=lambda: done.append("collect"),
                      trim=lambda: done.append("trim"))

    async def call(hold: asyncio.Event) -> None:
        with lifecycle.call():
            await hold.wait()

    hold = asyncio.Event()
    calls = [asyncio.ensure_future(call(hold)) for _ in range(3)]
    await asyncio.sleep(0)
    assert lifecycle.started == 3 and not janitor.tick()  # three calls, all in progress
    hold.set()
    await asyncio.gather(*calls)
    with lifecycle.call():
        pass
    assert not janitor.tick()  # idle now, but a call started since the last tick
    assert janitor.tick() and done == ["collect", "trim"]  # quiet for a whole tick
    assert not janitor.tick()  # nothing since
    with lifecycle.call():
        pass
    assert not janitor.tick() and not janitor.tick()
    assert janitor.sweeps == 1  # one call is not a burst


async def test_where_there_is_no_trim_it_still_collects() -> None:
    lifecycle, done = Lifecycle(), []
    bare = Janitor(lifecycle, min_calls=1, collect=lambda: done.append("collect"), trim=None)
    with lifecycle.call():
        pass
    assert not bare.tick() and bare.tick()  # quiet for a whole tick: a sweep, no trim
    assert done == ["collect"] and bare.sweeps == 1


class Libc:
    def __init__(self) -> None:
        self.trimmed: list[int] = []

    def malloc_trim(self, pad: int) -> int:
        self.trimmed.append(pad)
        return 1


def test_the_heap_is_trimmed_by_malloc_trim_0_where_the_c_library_has_one() -> None:
    libc = Libc()
    with mock.patch("ctypes.util.find_library", return_value="libc.so.6"):
        with mock.patch("ctypes.CDLL", return_value=libc):
            trim = _malloc_trim()
        assert trim is not None and libc.trimmed == []  # found, not called yet
        trim()
        assert libc.trimmed == [0]  # keep no padding at the top of the heap
        with mock.patch("ctypes.CDLL", return_value=object()):  # a libc without it (musl)
            assert _malloc_trim() is None
    with mock.patch("ctypes.util.find_library", return_value=None):  # no C library found
        assert _malloc_trim() is None
