"""The engine loop's calls from other threads: a caller that gives up never breaks the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from engine_worker.engine import EngineLoop
from engine_worker.scheduler import Scheduler
from tests.engine_worker.test_scheduler import make


async def test_a_call_cancelled_before_it_runs_never_runs_and_the_engine_lives_on() -> None:
    scheduler, runner, _ = make()
    engine = EngineLoop(scheduler, runner)
    engine.start()
    try:
        gate = threading.Event()
        busy = engine.call(lambda _: gate.wait(10))  # holds the engine thread
        ran: list[int] = []

        def late(_: Scheduler) -> None:
            ran.append(1)

        task = asyncio.create_task(engine.acall(late))
        await asyncio.sleep(0.05)
        task.cancel()  # e.g. the client of a pull hung up
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gate.set()
        assert busy.result(10) is True
        # The engine still answers (it used to crash setting the result of the cancelled
        # call), and what was cancelled in time did not run.
        assert await asyncio.wait_for(engine.acall(lambda _: 42), 5) == 42
        assert ran == []
        assert engine.alive
    finally:
        engine.stop()
