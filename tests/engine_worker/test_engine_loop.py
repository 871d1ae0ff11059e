"""The engine loop's calls from other threads: a caller that gives up never breaks the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from engine_worker.engine import EngineLoop
from engine_worker.scheduler import Scheduler
from tests.engine_worker.test_scheduler import PROFILE, make, req


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


async def test_a_pool_call_runs_while_a_step_executes_and_a_call_waits_for_it() -> None:
    # A KV pull's pool work (reserve, commit, pin) is a pool call: on a worker busy with
    # a long step it must not wait for that step, as between-steps calls do.
    scheduler, runner, _ = make()
    prompt = list(range(1, 33))
    engine = EngineLoop(scheduler, runner, time_scale=1.5 / PROFILE.prefill_seconds(32))
    engine.start()  # so the request's first step lasts ~1.5 s
    try:
        engine.submit(req("a", prompt, max_tokens=1))
        for _ in range(100):  # until that step is planned (the request is running)
            running, steps = await engine.apool_call(lambda s: (s.num_running, engine.steps))
            if running:
                break
            await asyncio.sleep(0.01)
        assert (running, steps) == (1, 0)  # ran mid-step: planned, not yet folded back
        between = asyncio.ensure_future(engine.acall(lambda _: engine.steps))
        await asyncio.sleep(0.3)
        assert not between.done()  # a between-steps call waits for the step
        assert await asyncio.wait_for(between, 10) == 1
    finally:
        engine.stop()
