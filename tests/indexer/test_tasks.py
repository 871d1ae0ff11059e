"""Background loops stop even when a library swallows their cancellation."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from indexer.tasks import cancel_and_wait


async def _loop_that_outlives_one_cancel(swallowed: list[int]) -> None:
    """A Redis loop as ours are: handles connection errors and carries on. The cancel
    lands in a cleanup that raises ConnectionError over it, as redis-py's pipeline reset
    does on a connection the server has just closed."""
    while True:
        try:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed.append(1)
                raise ConnectionError("Connection closed by server.") from None
        except ConnectionError:
            await asyncio.sleep(0.2)


async def test_a_loop_whose_cancellation_is_swallowed_still_stops() -> None:
    swallowed: list[int] = []
    task = asyncio.create_task(_loop_that_outlives_one_cancel(swallowed))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cancel_and_wait([task]), 5)
    assert task.done()
    assert swallowed  # the first cancellation really was swallowed


async def test_one_cancel_is_not_enough_for_such_a_loop() -> None:
    """What the helper is for: cancel once and wait, and the loop runs on."""
    task = asyncio.create_task(_loop_that_outlives_one_cancel([]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), 0.5)
    assert not task.done()
    await cancel_and_wait([task])
    assert task.done()


async def test_a_task_that_ignores_every_cancel_is_given_up_after_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    give_in = asyncio.Event()

    async def stubborn() -> None:
        while not give_in.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0.01)
    await cancel_and_wait([task], timeout_s=0.3)
    assert not task.done()
    assert "stubborn" in caplog.text
    give_in.set()
    await cancel_and_wait([task])
    assert task.done()
