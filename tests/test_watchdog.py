"""The stream write timeout: no timer for writes that do not wait, the right error for one
that waits too long, and a step that waits runs exactly as if it had been awaited."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.call.watchdog import ClientGone, Watchdog


async def waits_until_ended(cleaned: list[bool]) -> None:
    """A write that waits until it is ended from outside; notes that it cleaned up."""
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        cleaned.append(True)


async def test_a_write_that_does_not_wait_arms_no_timer() -> None:
    done: list[bool] = []

    async def step() -> None:
        done.append(True)

    watchdog = Watchdog(0.05)
    await watchdog.send(step())
    await watchdog.send(step())
    assert done == [True, True] and watchdog._timer is None
    watchdog.stop()


async def test_a_write_that_waits_runs_to_its_end_with_what_it_awaited() -> None:
    loop = asyncio.get_running_loop()
    seen: list[object] = []

    async def step() -> None:
        for value in ("a", "b"):
            future: asyncio.Future[str] = loop.create_future()
            loop.call_later(0.01, future.set_result, value)
            seen.append(await future)
        await asyncio.sleep(0)

    watchdog = Watchdog(1.0)
    await watchdog.send(step())
    assert seen == ["a", "b"] and watchdog._timer is not None
    watchdog.stop()


async def test_a_write_waiting_past_the_timeout_ends_with_client_gone() -> None:
    cleaned: list[bool] = []

    async def relay() -> None:
        watchdog = Watchdog(0.05)
        try:
            await watchdog.send(waits_until_ended(cleaned))
        finally:
            watchdog.stop()

    task = asyncio.ensure_future(relay())
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, 2)
    assert cleaned == [True] and task.cancelling() == 0


async def test_a_reset_before_or_after_waiting_is_client_gone() -> None:
    async def at_once() -> None:
        raise ConnectionResetError()

    async def later() -> None:
        await asyncio.sleep(0.01)
        raise ConnectionResetError()

    watchdog = Watchdog(1.0)
    for step in (at_once(), later()):
        with pytest.raises(ClientGone):
            await watchdog.send(step)
    watchdog.stop()


async def test_a_cancellation_from_elsewhere_reaches_the_write_and_is_not_client_gone() -> None:
    cleaned: list[bool] = []
    watchdog = Watchdog(5.0)
    task = asyncio.ensure_future(watchdog.send(waits_until_ended(cleaned)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True]
    watchdog.stop()


async def test_what_the_task_throws_into_a_waiting_write_reaches_the_write() -> None:
    loop = asyncio.get_running_loop()
    caught: list[BaseException] = []

    async def step() -> None:
        try:
            await loop.create_future()
        except KeyError as exc:
            caught.append(exc)

    watchdog = Watchdog(5.0)
    outer = watchdog.send(step())
    waiting = outer.send(None)  # as a task would: the write waits on its future
    assert isinstance(waiting, asyncio.Future)
    with pytest.raises(StopIteration):
        outer.throw(KeyError("x"))
    assert [type(exc) for exc in caught] == [KeyError]
    watchdog.stop()


async def test_closing_a_waiting_write_closes_the_step() -> None:
    cleaned: list[bool] = []
    watchdog = Watchdog(5.0)
    outer = watchdog.send(waits_until_ended(cleaned))
    outer.send(None)
    outer.close()
    assert cleaned == [True]
    watchdog.stop()
