"""After a burst, once idle, the proxy collects its garbage and trims the heap; never while
a call is in progress, never for a handful of calls."""

from __future__ import annotations

import asyncio

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


def test_the_heap_can_be_trimmed_here() -> None:
    trim = _malloc_trim()
    assert trim is not None
    trim()
