"""The engine loop: calls from other threads (a caller that gives up never breaks the
loop), and loads beside the steps."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import msgspec
import pytest

from engine_worker.engine import EngineLoop, TokenEvent
from engine_worker.runners.sim import SimRunner
from engine_worker.scheduler import Scheduler
from indexer.media import Medium
from tests.engine_worker.test_scheduler import PROFILE, B, cache_on_dram, make, req


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


@pytest.mark.parametrize("async_loads", [False, True])
async def test_a_running_decode_waits_for_another_requests_dram_load_only_without_async_loads(
    async_loads: bool,
) -> None:
    scheduler, runner, pool = make(hbm=16, dram=32, max_model_len=32, async_loads=async_loads)
    cache_on_dram(scheduler, runner, pool)  # before the engine runs: "x"'s prefix on DRAM
    # Steps of ~1 ms; DRAM so slow that bringing the 24-token prefix up takes ~0.5 s.
    slow = msgspec.structs.replace(PROFILE, load_bandwidth={Medium.DRAM: 5e4})
    engine = EngineLoop(scheduler, SimRunner(slow, B, vocab_size=1000))
    engine.start()
    try:
        done: list[str] = []

        async def until_finished(name: str, q: asyncio.Queue[TokenEvent]) -> None:
            while not (await q.get()).finished:
                pass
            done.append(name)

        d = engine.submit(req("d", list(range(500, 504)), max_tokens=20))
        await asyncio.wait_for(d.get(), 10)  # "d" decodes
        x = engine.submit(req("x", [*range(24), 7, 7], max_tokens=1))
        await asyncio.wait_for(asyncio.gather(until_finished("d", d), until_finished("x", x)), 20)
        # With async loads "d"'s 19 steps (~20 ms) run while "x" loads; without, the step
        # that admits "x" loads first (~0.5 s) and "x" is answered in it, before "d" ends.
        assert done == (["d", "x"] if async_loads else ["x", "d"])
        assert await engine.acall(lambda s: (s.has_work(), s.loading)) == (False, {})
    finally:
        engine.stop()
