"""The engine loop: one thread drives the scheduler and the runner.

Everything that changes requests runs on that thread. Other threads (the
asyncio server) talk to it through a command queue:

    server coroutine --submit/abort/call--> command queue --> engine thread
    KV transfers --pool_call--> one side thread, under the scheduler lock
    engine thread --tokens--> per-request asyncio.Queue (call_soon_threadsafe)
    engine thread --load after each step, and after requests come or go--> on_step/on_change
    engine thread --pool events, snapshots--> EventSink (the publisher), in order

Between two steps the thread applies commands (new requests, aborts,
snapshot requests), then plans a step, has the runner execute it, folds
the result back, delivers tokens, and hands the pool's events to the sink.
With the ``sim`` runner it also waits out each step's modeled duration
(times ``time_scale``), so a simulated worker behaves like real hardware.
With the scheduler's ``async_loads``, the DRAM/SSD loads a plan starts run
on one modeled load channel beside the steps, one after another; each
request computes from the first step planned after its load lands (an
engine with only loads in flight sleeps until the first lands).

The thread holds the scheduler lock except while the runner executes a
step (and the modeled wait). :meth:`EngineLoop.pool_call` runs a function
under that lock on a side thread, so the pool work of a KV transfer
(reserve, commit, pin, unpin, leases) waits at most for a step's planning
or bookkeeping, not for the step itself: on a worker busy with a long
prefill chunk, a between-steps call waits for the rest of that chunk, which
made a live pull several times its priced time. Such functions must touch
only the pool and leases, never the requests a step has planned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine_worker.request import FinishReason, Request
from engine_worker.runners.base import Runner
from engine_worker.scheduler import LoadChannel, Scheduler, SchedulerPlan, StepOutput
from indexer.events import Event
from indexer.media import Medium

__all__ = ["EngineLoop", "EventSink", "SinkFanOut", "StepRecord", "TokenEvent"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class EventSink(Protocol):
    """Receives the pool's events and snapshots, in the order they happened."""

    def put_events(self, events: list[Event]) -> None:
        """Events drained after a step."""
        ...

    def put_snapshot(self, blocks: dict[Medium, list[int]], ts: float) -> None:
        """A snapshot taken right after the events before it."""
        ...


class SinkFanOut:
    """Hands every event list and snapshot to several sinks, in order (Redis and vLLM format)."""

    def __init__(self, sinks: list[EventSink]) -> None:
        self.sinks = sinks

    def put_events(self, events: list[Event]) -> None:
        """Events drained after a step, to each sink."""
        for sink in self.sinks:
            sink.put_events(events)

    def put_snapshot(self, blocks: dict[Medium, list[int]], ts: float) -> None:
        """A snapshot, to each sink."""
        for sink in self.sinks:
            sink.put_snapshot(blocks, ts)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A token (or the end) of one request, as its consumer sees it."""

    token: int | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: dict[Medium, int]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did and how long it took (metrics and profile fitting)."""

    plan: SchedulerPlan
    seconds: float
    modeled: bool


@dataclass(slots=True)
class _Consumer:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent]


@dataclass(slots=True)
class _Command:
    kind: str
    request: Request | None = None
    request_id: str = ""
    reason: FinishReason = FinishReason.ABORT
    consumer: _Consumer | None = None
    fn: Callable[[Scheduler], Any] | None = None
    future: Future[Any] | None = field(default=None)


class EngineLoop:
    """Drives a :class:`Scheduler` and a :class:`Runner` on a dedicated thread."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        *,
        sink: EventSink | None = None,
        time_scale: float = 1.0,
        on_step: Callable[[StepRecord], None] | None = None,
        on_change: Callable[[], None] | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.05,
        step_estimate: Callable[[SchedulerPlan], float] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sink = sink
        self.time_scale = time_scale
        self.on_step = on_step
        self.on_change = on_change
        #: Called on the engine thread, once its requests are aborted, when the loop died
        #: of an exception (not when stopped).
        self.on_crash = on_crash
        self.idle_wait_s = idle_wait_s
        #: Seconds a planned step is expected to take (None: not estimated).
        self.step_estimate = step_estimate
        #: When the step in progress is expected to end (``time.time()`` clock; 0.0: no
        #: step in progress, or not estimated): heartbeats publish it (``step_ends_ts``).
        self.step_ends = 0.0
        self._changed = False
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._consumers: dict[str, _Consumer] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Held by the engine thread except while a step executes; pool_call takes it.
        self._lock = threading.Lock()
        self._side = ThreadPoolExecutor(1, thread_name_prefix="engine-pool")
        self.steps = 0
        self.error: BaseException | None = None
        #: Loads in flight (``async_loads``), on the ``perf_counter`` clock.
        self._loads = LoadChannel()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (and publish the pool's start-up events, e.g. SSD restore)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; pending requests end with ``abort``."""
        self._stop.set()
        self._commands.put(_Command("wake"))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._side.shutdown(wait=False)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- API for other threads ----------------------------------------------------------------

    def submit(self, request: Request) -> asyncio.Queue[TokenEvent]:
        """Queue ``request``; its tokens arrive on the returned queue (call from a coroutine)."""
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        consumer = _Consumer(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Command("add", request=request, consumer=consumer))
        return consumer.queue

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish a request between steps (client gone, stop string); frees its blocks."""
        self._commands.put(_Command("abort", request_id=request_id, reason=reason))

    def call(self, fn: Callable[[Scheduler], _T]) -> Future[_T]:
        """Run ``fn(scheduler)`` on the engine thread between steps."""
        fut: Future[_T] = Future()
        self._commands.put(_Command("call", fn=fn, future=fut))
        return fut

    async def acall(self, fn: Callable[[Scheduler], _T]) -> _T:
        """Awaitable :meth:`call`."""
        return await asyncio.wrap_future(self.call(fn))

    def pool_call(self, fn: Callable[[Scheduler], _T]) -> Future[_T]:
        """Run ``fn(scheduler)`` once the scheduler is not being changed: between steps
        or while the runner executes one. For pool and lease work only (see the module
        docstring); a call cancelled before it runs never runs.

        Raises:
            RuntimeError: The loop was stopped.
        """
        return self._side.submit(self._locked, fn)

    async def apool_call(self, fn: Callable[[Scheduler], _T]) -> _T:
        """Awaitable :meth:`pool_call`."""
        return await asyncio.wrap_future(self.pool_call(fn))

    def _locked(self, fn: Callable[[Scheduler], _T]) -> _T:
        with self._lock:
            return fn(self.scheduler)

    def request_snapshot(self) -> None:
        """Flush pending events, then hand the sink a snapshot of the pool (in that order)."""
        self._commands.put(_Command("call", fn=self._snapshot))

    # -- the thread ---------------------------------------------------------------------------

    def _snapshot(self, scheduler: Scheduler) -> None:
        self._flush_events()
        if self.sink is not None:
            self.sink.put_snapshot(scheduler.pool.snapshot(), time.time())

    def _flush_events(self) -> None:
        events = self.scheduler.pool.take_events()
        if events and self.sink is not None:
            self.sink.put_events(events)

    def _deliver(self, request_id: str, ev: TokenEvent) -> None:
        if ev.finished:
            self.runner.forget(request_id)  # its seeded generator, its prompt's ids
        consumer = self._consumers.get(request_id)
        if consumer is None:
            return
        if ev.finished:
            del self._consumers[request_id]
        # A closed loop means nobody listens any more.
        with contextlib.suppress(RuntimeError):
            consumer.loop.call_soon_threadsafe(consumer.queue.put_nowait, ev)

    @staticmethod
    def _event(req: Request, token: int | None, out: StepOutput | None) -> TokenEvent:
        return TokenEvent(
            token=token,
            finished=out.finished if out else True,
            finish_reason=out.finish_reason if out else req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            cached_tokens=req.cached_by_medium(),
        )

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind in ("add", "abort"):
            self._changed = True
        if cmd.request is not None and cmd.consumer is not None:
            self._add(cmd.request, cmd.consumer)
        elif cmd.kind == "abort":
            req = self.scheduler.abort(cmd.request_id, cmd.reason)
            if req is not None:
                self._deliver(cmd.request_id, self._event(req, None, None))
        elif cmd.fn is not None:
            if cmd.future is not None and not cmd.future.set_running_or_notify_cancel():
                return  # the caller gave up before it ran (a cancelled task)
            try:
                result = cmd.fn(self.scheduler)
            except BaseException as exc:  # the caller gets it through its future
                if cmd.future is not None:
                    cmd.future.set_exception(exc)
            else:
                if cmd.future is not None:
                    cmd.future.set_result(result)

    def _add(self, req: Request, consumer: _Consumer) -> None:
        self._consumers[req.request_id] = consumer
        try:
            self.scheduler.add(req)
        except ValueError:
            log.warning("request %s refused by the scheduler", req.request_id, exc_info=True)
            req.finish_reason = FinishReason.ABORT
            self._deliver(req.request_id, self._event(req, None, None))

    def _next(self, block: bool) -> _Command | None:
        """The first pending command, waiting up to ``idle_wait_s`` when ``block`` (less
        when a load lands sooner)."""
        try:
            if block:
                timeout = self.idle_wait_s
                if (lands := self._loads.next_at()) is not None:
                    timeout = min(timeout, max(lands - time.perf_counter(), 0.0))
                return self._commands.get(timeout=timeout)
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _land_loads(self) -> None:
        """Hand the loads that have landed to the scheduler (under the lock)."""
        for request_id in self._loads.landed(time.perf_counter()):
            self.scheduler.loaded(request_id)

    def _start_loads(self, plan: SchedulerPlan, now: float) -> None:
        """Put the loads ``plan`` starts on the load channel, after those before them."""
        block_size = self.scheduler.block_size
        for req, media in plan.loads:
            seconds = self.runner.profile().blocks_load_seconds(media, block_size)
            self._loads.start(now, seconds * self.time_scale, req.request_id)

    def _drain(self, first: _Command | None) -> None:
        cmd = first
        while cmd is not None:
            self._apply(cmd)
            cmd = self._next(block=False)

    def _run(self) -> None:
        try:
            with self._lock:
                self._flush_events()
            idle = True
            while not self._stop.is_set():
                # Waiting for work happens outside the lock: pool calls run meanwhile.
                # With nothing to compute until a load lands, that wait ends when it does.
                first = self._next(
                    block=not self.scheduler.has_work()
                    or (idle and self._loads.next_at() is not None)
                )
                with self._lock:
                    self._drain(first)
                    self._land_loads()
                    if self._changed and self.on_change is not None:
                        # Requests came or went: the published load must say so now, not
                        # after the next step (an idle engine has none).
                        self._changed = False
                        self.on_change()
                    t0 = time.perf_counter()  # a step's time includes its planning
                    plan = self.scheduler.schedule() if self.scheduler.has_work() else None
                    if plan is not None and plan.loads:
                        self._start_loads(plan, t0)
                idle = plan is None or plan.empty
                if not idle:
                    assert plan is not None
                    if self.step_estimate is not None:
                        self.step_ends = time.time() + self.step_estimate(plan)
                    self._step(plan, t0)
                with self._lock:
                    self._flush_events()
        except BaseException as exc:
            log.exception("engine loop crashed")
            self.error = exc
        finally:
            with self._lock:
                for rid in list(self._consumers):
                    req = self.scheduler.abort(rid)
                    if req is not None:
                        self._deliver(rid, self._event(req, None, None))
                self._flush_events()
            if self.error is not None and self.on_crash is not None:
                self.on_crash(self.error)

    def _step(self, plan: SchedulerPlan, t0: float) -> None:
        """Execute a step planned at ``t0`` outside the lock, then fold it back under it."""
        result = self.runner.execute(plan)
        if result.modeled:
            remaining = result.duration_s * self.time_scale - (time.perf_counter() - t0)
            if remaining > 0:
                self._stop.wait(remaining)
        self.step_ends = 0.0
        with self._lock:
            outputs = self.scheduler.update(plan, result.sampled)
            self.steps += 1
            for out in outputs:
                self._deliver(out.request.request_id, self._event(out.request, out.token, out))
            if self.on_step is not None:
                seconds = result.duration_s if result.modeled else time.perf_counter() - t0
                self.on_step(StepRecord(plan, seconds, result.modeled))
