"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

The scheduler is a pure core: :meth:`Scheduler.schedule` turns the current
state into a :class:`SchedulerPlan` (which tokens of which requests to
compute this step), a runner executes the plan, and
:meth:`Scheduler.update` folds the sampled tokens back in. No clock, no
I/O, no tensors: the same code drives the live workers (``torch`` and
``sim`` runners) and the offline simulator.

One step, in the spirit of vLLM v1::

    budget = max_num_batched_tokens
    1. running requests, oldest first: each gets its remaining tokens
       (1 when decoding, a chunk when a long prompt is still prefilling);
       when HBM runs out, the newest running request is preempted (its
       blocks freed, recomputed later) until the older one fits.
    2. waiting requests, first come first served, if nothing was preempted:
       look up the longest cached prefix (HBM, DRAM or SSD), take it
       (DRAM/SSD blocks are promoted into HBM), allocate blocks for the
       first chunk of the rest, move to running. Stop at the first that
       does not fit: no overtaking.

NOTE: at least one prompt token is always computed, even on a full hit, so
that the step produces logits for the first output token.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from engine_worker.block_pool import Block, BlockPool
from engine_worker.request import FinishReason, Request, RequestStatus
from indexer.keys import chained_prefix
from indexer.media import Medium

__all__ = [
    "LoadChannel",
    "LoadViewFields",
    "RequestTooLargeError",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLoad",
    "SchedulerPlan",
    "StepOutput",
]


class RequestTooLargeError(ValueError):
    """The request can never fit (longer than the context or than all of HBM)."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching limits.

    Attributes:
        max_num_seqs: Requests computed in one step at most.
        max_num_batched_tokens: Tokens computed in one step at most (the chunk budget).
        max_model_len: Longest sequence (prompt + output) a request may reach.
        enable_prefix_caching: Reuse cached blocks across requests.
        async_loads: Bring a request's cached DRAM/SSD blocks up into HBM beside the
            steps, as vLLM's offloading connector does (the request waits in
            ``LOADING``, computing nothing, until :meth:`Scheduler.loaded`), instead of
            in the step that admits it (which every request in that step waits for).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    async_loads: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens ``num_cached .. num_cached + num_new - 1``."""

    request: Request
    num_cached: int
    num_new: int
    want_logits: bool
    #: A one-token decode step (not prefill): set once, read by the timing model.
    is_decode: bool = False

    @property
    def block_ids(self) -> list[int]:
        """The request's block table as HBM block ids (built on demand: only the torch
        runner needs it, and rebuilding it every step costs O(context) per sequence)."""
        return [b.block_id for b in self.request.block_table]


@dataclass(slots=True)
class SchedulerPlan:
    """What one step computes.

    Attributes:
        seqs: Scheduled requests, running ones first.
        preempted: Requests preempted this step (their KV must be recomputed).
        loaded_blocks: Blocks promoted into HBM this step, per medium (the runner's load
            cost), those of ``loads`` excluded.
        loads: With ``async_loads``, the requests admitted this step to load first, each
            with its blocks to bring up per medium (:meth:`Scheduler.loaded` when done).
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    loaded_blocks: dict[Medium, int] = field(default_factory=dict)
    loads: list[tuple[Request, dict[Medium, int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed by this step."""
        return sum(s.num_new for s in self.seqs)

    @property
    def empty(self) -> bool:
        """Whether there is nothing to compute."""
        return not self.seqs

    def prefill_chunks(self) -> list[tuple[int, int]]:
        """(new, cached) tokens of every prefill chunk (the timing model's input)."""
        return [(s.num_new, s.num_cached) for s in self.seqs if not s.is_decode]

    def decode_batch(self) -> tuple[int, int]:
        """(sequences decoding, KV tokens they attend to)."""
        n = kv = 0
        for s in self.seqs:
            if s.is_decode:
                n += 1
                kv += s.num_cached + 1
        return n, kv


@dataclass(slots=True)
class StepOutput:
    """A token produced for a request by one step (``token`` None if it only finished)."""

    request: Request
    token: int | None
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """What a router needs to know of one worker's load (its heartbeat's load fields).

    Attributes:
        running: Requests in the running queue.
        waiting: Requests waiting to start (or preempted).
        queued_prefill_tokens: Tokens still to prefill (:meth:`Scheduler.queued_prefill_tokens`).
        queued_prefill_context: Attention work of that prefill: over every queued
            request, ``new * (cached + new / 2)``, the context its new tokens attend to
            summed (a long prompt's later chunks attend to everything before them).
        queued_taken_blocks: HBM blocks the waiting requests' cached prefixes take on
            admission besides those they compute: of the prefix each matched when it
            arrived, what no running request holds now (on DRAM/SSD, or free in HBM).
        queued_load_blocks: Cached blocks per medium (DRAM, SSD) that the waiting requests
            bring up into HBM on admission, as matched when each arrived, plus those the
            step in flight is bringing up: the step that admits a request pays its load,
            so everything queued behind it waits for it too.
        running_kv_tokens: Context tokens of the running requests (what a decode step reads).
        active_blocks: HBM blocks the running requests hold (free cached blocks excluded).
        mean_output_tokens: Moving average of the tokens finished requests generated
            (0.0 until one finished): how long a request holds its KV memory.
        step_prefill_tokens: Of ``queued_prefill_tokens``, those the step planned and not
            yet folded in computes (its prefill chunks): they are done when it ends.
        step_prefill_context: Their share of ``queued_prefill_context``.
        kv_release: Per running request, in running order: the running prefill tokens
            computed before its prompt is done (0: decoding), the output tokens it is
            expected to generate still (the mean residual of recent requests' outputs,
            :class:`OutputLengths`, within its ``max_tokens``), and the HBM blocks it
            frees for others when it finishes (those no other running request shares
            and no waiting request waits to reuse).
    """

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_context: int = 0
    queued_taken_blocks: int = 0
    queued_load_blocks: dict[Medium, int] = field(default_factory=dict)
    running_kv_tokens: int = 0
    active_blocks: int = 0
    mean_output_tokens: float = 0.0
    step_prefill_tokens: int = 0
    step_prefill_context: int = 0
    kv_release: list[tuple[int, int, int]] = field(default_factory=list)

    def view_fields(self, queued_extra_tokens: int = 0) -> LoadViewFields:
        """The :class:`~indexer.views.WorkerView` load fields (one mapping for a worker's
        heartbeat and a simulated worker's view); ``queued_extra_tokens`` adds prefill
        work the router must count that is not in the queue yet (a pull in progress)."""
        return LoadViewFields(
            running=self.running,
            waiting=self.waiting,
            queued_prefill_tokens=self.queued_prefill_tokens + queued_extra_tokens,
            queued_prefill_context=self.queued_prefill_context,
            queued_taken_blocks=self.queued_taken_blocks,
            queued_load_blocks=self.queued_load_blocks,
            running_kv_tokens=self.running_kv_tokens,
            kv_active_blocks=self.active_blocks,
            mean_output_tokens=self.mean_output_tokens,
            step_prefill_tokens=self.step_prefill_tokens,
            step_prefill_context=self.step_prefill_context,
            kv_release=self.kv_release,
        )


class LoadViewFields(TypedDict):
    """The :class:`~indexer.views.WorkerView` fields a :class:`SchedulerLoad` gives."""

    running: int
    waiting: int
    queued_prefill_tokens: int
    queued_prefill_context: int
    queued_taken_blocks: int
    queued_load_blocks: dict[Medium, int]
    running_kv_tokens: int
    kv_active_blocks: int
    mean_output_tokens: float
    step_prefill_tokens: int
    step_prefill_context: int
    kv_release: list[tuple[int, int, int]]


#: Weight of the newest finished request in :attr:`SchedulerLoad.mean_output_tokens`.
_OUTPUT_EWMA = 0.05


class Scheduler:
    """Waiting and running queues over one :class:`BlockPool`."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int) -> None:
        self.config = config
        self.pool = pool
        self.block_size = block_size
        hbm_tokens = pool.capacity().hbm * block_size
        if hbm_tokens < config.max_model_len:
            raise ValueError(
                f"HBM holds {hbm_tokens} tokens, less than max_model_len={config.max_model_len}: "
                "a single request could never fit; lower max_model_len or add HBM blocks"
            )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Admitted, holding their blocks, waiting for their loads (``async_loads``).
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._mean_output = 0.0
        self._outputs = OutputLengths()
        #: Blocks the step planned and not yet folded in brings up from each lower medium.
        self._loading: dict[Medium, int] = {}
        #: The prefill tokens (and their attention work) of the step planned and not yet
        #: folded in: queued until it ends, and computing meanwhile.
        self._stepping: tuple[int, int] = (0, 0)

    # -- queue management -------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise RequestTooLargeError if ``request`` can never run (reads config only)."""
        if request.block_size != self.block_size:
            raise ValueError("request block size differs from the scheduler's")
        if request.num_prompt_tokens < 1:
            raise RequestTooLargeError("the prompt is empty")
        total = request.num_prompt_tokens + request.sampling.max_tokens
        if total > self.config.max_model_len:
            raise RequestTooLargeError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the context length "
                f"{self.config.max_model_len}"
            )

    def add(self, request: Request) -> None:
        """Queue a new request; raises RequestTooLargeError if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check(request)
        if self.config.enable_prefix_caching:
            matched = self.pool.match_prefix(request.ensure_keys(request.num_tokens))
            hit = len(matched)
            request.expected_cached_tokens = min(hit * self.block_size, request.num_tokens - 1)
            lower: dict[Medium, int] = {}
            for b in matched:
                if b.medium is not Medium.HBM:
                    lower[b.medium] = lower.get(b.medium, 0) + 1
            request.expected_hit_blocks = hit
            request.expected_load_blocks = lower
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finish a request now (client gone, stop string seen); its blocks are freed."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif self.loading.pop(request_id, None) is None:
            self.waiting.remove(req)
        self._finish(req, reason)
        return req

    def loaded(self, request_id: str) -> None:
        """A request's loads are done: it computes from the next step on (a no-op for a
        request no longer loading: aborted meanwhile)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @property
    def num_running(self) -> int:
        """Requests in the running queue."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to start (or preempted, or loading their prefix)."""
        return len(self.waiting) + len(self.loading)

    @property
    def stepping(self) -> tuple[int, int]:
        """The prefill tokens, and their attention work, of the step planned and not yet
        folded in (:attr:`SchedulerLoad.step_prefill_tokens`); one read, safe from another
        thread."""
        return self._stepping

    def queued_prefill_tokens(self) -> int:
        """Tokens still to prefill over all requests (the router's queue-wait signal).

        A waiting request counts only what its prefix hit at queueing time will not
        cover, so a worker holding its queue's prefixes does not look busier than it is.
        """
        return self.load().queued_prefill_tokens

    def load(self) -> SchedulerLoad:
        """The load summary a heartbeat publishes; O(running + waiting)."""
        queued = context = taken = 0
        loads = dict(self._loading)
        wanted: list[tuple[int, Block]] = []
        for r in self.waiting:
            cached = max(r.num_computed_tokens, r.expected_cached_tokens)
            new = r.num_tokens - cached
            queued += new
            context += new * cached + new * new // 2
            held = self._held_prefix(r.keys, r.expected_hit_blocks)
            taken += r.expected_hit_blocks - held
            deepest = self.pool.cached_block(r.keys[held - 1]) if held else None
            if deepest is not None and deepest.ref_cnt == 1:
                # One running request alone holds what it waits to reuse: that one's
                # finishing frees none of it for anybody else.
                wanted.append((held, deepest))
            for medium, n in r.expected_load_blocks.items():
                loads[medium] = loads.get(medium, 0) + n
        for r in self.loading.values():
            new = r.num_tokens - r.num_computed_tokens
            queued += new
            context += new * r.num_computed_tokens + new * new // 2
            for medium, n in r.expected_load_blocks.items():
                loads[medium] = loads.get(medium, 0) + n
        running_kv = 0
        release: list[tuple[int, int, int]] = []
        ahead = 0
        for r in self.running:
            running_kv += r.num_tokens
            new = r.num_tokens - r.num_computed_tokens
            if new > 1:
                queued += new
                ahead += new
                context += new * r.num_computed_tokens + new * new // 2
            generated = len(r.output_token_ids)
            left = max(r.sampling.max_tokens - generated, 1)
            if (expected := self._outputs.residual(generated)) is not None:
                left = min(left, max(round(expected), 1))
            table = r.block_table
            kept = _shared_blocks(table)
            for held, block in wanted:
                if kept < held <= len(table) and table[held - 1] is block:
                    kept = held
            blocks = -(-(r.num_tokens + left) // self.block_size) - kept
            release.append((ahead if new > 1 else 0, left, blocks))
        return SchedulerLoad(
            running=len(self.running),
            waiting=len(self.waiting) + len(self.loading),
            queued_prefill_tokens=queued,
            queued_prefill_context=context,
            queued_taken_blocks=taken,
            queued_load_blocks=loads,
            running_kv_tokens=running_kv,
            active_blocks=self.pool.capacity().hbm - self.pool.num_free(Medium.HBM),
            mean_output_tokens=self._mean_output,
            step_prefill_tokens=self._stepping[0],
            step_prefill_context=self._stepping[1],
            kv_release=release,
        )

    def _held_prefix(self, keys: Sequence[int], hit: int) -> int:
        """How many of the first ``hit`` of ``keys`` running requests hold now.

        Admitting a waiting request takes the rest of its matched prefix out of the free
        HBM pool (cached free blocks, and those it brings up from DRAM or SSD). That
        changes while it waits: an agent's next step queued while its previous step
        still decodes finds its history held on arrival, and taken once that step ends.
        """
        return chained_prefix(min(hit, len(keys)), lambda i: self.pool.in_use(keys[i]))

    def has_work(self) -> bool:
        """Whether any request is waiting, loading or running."""
        return bool(self.waiting or self.running or self.loading)

    def can_schedule(self) -> bool:
        """Whether a step would compute anything now: a request is waiting or running
        (those loading compute nothing until :meth:`loaded`)."""
        return bool(self.waiting or self.running)

    # -- the step -----------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def schedule(self) -> SchedulerPlan:
        """Plan one step (see the module docstring). Mutates queues and block tables."""
        plan = SchedulerPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        block_size = self.block_size
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            need = -(-(req.num_computed_tokens + num_new) // block_size) - len(req.block_table)
            while need > 0 and not self.pool.can_allocate(need):
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if need > 0:
                req.block_table.extend(self.pool.allocate(need))
            cached = req.num_computed_tokens
            # Inline _scheduled(): this runs once per running request per step.
            plan.seqs.append(
                ScheduledSeq(
                    req,
                    cached,
                    num_new,
                    cached + num_new >= req.num_tokens,
                    num_new == 1 and cached >= len(req.prompt_token_ids),
                )
            )
            budget -= num_new
            i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        self._loading = plan.loaded_blocks
        # The chunks load() counts as queued (a request with more than one token left to
        # compute) that this step computes; ``new * (cached + new / 2)`` each, as load()
        # counts the attention work of the queued tokens.
        tokens = context = 0
        for seq in plan.seqs:
            n = seq.num_new
            if seq.request.num_tokens - seq.num_cached > 1:
                tokens += n
                context += n * seq.num_cached + n * n // 2
        self._stepping = (tokens, context)
        return plan

    def _admit(self, plan: SchedulerPlan, budget: int) -> None:
        seqs = self.config.max_num_seqs
        # Those loading count: they run as soon as their loads land.
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < seqs:
            req = self.waiting[0]
            matched = self._match(req)
            cached_tokens = len(matched) * self.block_size
            num_new = min(req.num_tokens - cached_tokens, budget)
            new_blocks = self._blocks_for(cached_tokens + num_new) - len(matched)
            # Matched HBM blocks with no reference leave the free queue; lower-tier ones need
            # an HBM block each: both count against what is allocatable.
            taken = sum(1 for b in matched if b.medium is not Medium.HBM or b.ref_cnt == 0)
            if not self.pool.can_allocate(taken + new_blocks):
                break
            self.waiting.popleft()
            lower: dict[Medium, int] = {}
            for b in matched:
                if b.medium is not Medium.HBM:
                    lower[b.medium] = lower.get(b.medium, 0) + 1
            if not req.admitted:
                req.admitted = True
                for b in matched:
                    req.cached_tokens[b.medium.rank] += self.block_size
            req.num_computed_tokens = cached_tokens
            req.num_cached_blocks = len(matched)
            if lower and self.config.async_loads:
                # Only the prefix now: the rest is allocated when it computes.
                req.block_table = self.pool.acquire(matched)
                req.status = RequestStatus.LOADING
                req.expected_load_blocks = lower
                self.loading[req.request_id] = req
                plan.loads.append((req, lower))
                continue
            for medium, n in lower.items():
                plan.loaded_blocks[medium] = plan.loaded_blocks.get(medium, 0) + n
            req.block_table = [*self.pool.acquire(matched), *self.pool.allocate(new_blocks)]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.seqs.append(self._scheduled(req, num_new))
            budget -= num_new

    def _match(self, req: Request) -> list[Block]:
        if not self.config.enable_prefix_caching:
            return []
        keys = req.ensure_keys(req.num_tokens)
        matched = self.pool.match_prefix(keys)
        if len(matched) * self.block_size >= req.num_tokens:
            matched = matched[:-1]
        return matched

    def _scheduled(self, req: Request, num_new: int) -> ScheduledSeq:
        cached = req.num_computed_tokens
        return ScheduledSeq(
            req,
            cached,
            num_new,
            cached + num_new >= req.num_tokens,
            num_new == 1 and cached >= len(req.prompt_token_ids),
        )

    def update(self, plan: SchedulerPlan, sampled: Mapping[str, int]) -> list[StepOutput]:
        """Fold a step's results in: advance computed tokens, cache full blocks, append tokens.

        Args:
            plan: The plan the runner executed.
            sampled: The sampled token of every scheduled request with ``want_logits``.
        """
        outputs: list[StepOutput] = []
        self._loading = {}
        self._stepping = (0, 0)
        caching = self.config.enable_prefix_caching
        block_size = self.block_size
        running = RequestStatus.RUNNING
        max_len = self.config.max_model_len
        for s in plan.seqs:
            req = s.request
            if req.status is not running:
                continue
            req.num_computed_tokens = computed = s.num_cached + s.num_new
            if caching and computed // block_size > req.num_cached_blocks:
                self._cache_full_blocks(req)
            if not s.want_logits:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            req.num_tokens += 1
            sp = req.sampling
            # The common case (keep going) without a call: this runs once per token.
            reason = (
                self._stop_reason(req, token)
                if token in req.eos_token_ids
                or token in sp.stop_token_ids
                or len(req.output_token_ids) >= sp.max_tokens
                or req.num_tokens >= max_len
                else None
            )
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
            outputs.append(StepOutput(req, token, reason is not None, reason))
        return outputs

    def _cache_full_blocks(self, req: Request) -> None:
        full = req.num_computed_tokens // self.block_size
        keys = req.ensure_keys(full * self.block_size)
        bs, tokens = self.block_size, self.pool.event_token_ids
        for i in range(req.num_cached_blocks, full):
            ids = req.token_ids(i * bs, (i + 1) * bs) if tokens else None
            self.pool.cache_block(req.block_table[i], keys[i], req.parent_of(i), ids)
        req.num_cached_blocks = full

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if not sp.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= sp.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, req: Request) -> None:
        if req.block_table:
            self.pool.free(list(reversed(req.block_table)))
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if reason is not FinishReason.ABORT:
            n = len(req.output_token_ids)
            mean = self._mean_output
            self._mean_output = n if mean == 0.0 else mean + _OUTPUT_EWMA * (n - mean)
            self._outputs.add(n)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)


def _shared_blocks(table: Sequence[Block]) -> int:
    """How many of a running request's blocks another request holds too (a prefix: keys
    are chained), which its finishing does not free."""
    return chained_prefix(len(table), lambda i: table[i].ref_cnt > 1)


class OutputLengths:
    """The output lengths of the last ``size`` finished requests, and what they say of a
    running request's tokens still to come.

    A request that has generated ``g`` tokens is expected to generate the mean of
    ``L - g`` over the recent lengths ``L > g`` (its mean residual length): a request
    just started, the mean output; one past most of them, what the longer ones went on
    for. A single mean would call a request past it about to finish.
    """

    def __init__(self, size: int = 256) -> None:
        self._recent: deque[int] = deque(maxlen=size)
        self._sorted: list[int] = []
        self._suffix: list[int] = []

    def add(self, n: int) -> None:
        """Record one finished request's output length."""
        self._recent.append(n)
        self._sorted = []

    def residual(self, generated: int) -> float | None:
        """Expected tokens still to come after ``generated`` (None: no finished request
        generated more)."""
        if not self._recent:
            return None
        if not self._sorted:
            self._sorted = sorted(self._recent)
            self._suffix = list(itertools.accumulate(reversed(self._sorted)))[::-1]
        i = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - i
        if longer == 0:
            return None
        return self._suffix[i] / longer - generated


@dataclass(slots=True)
class LoadChannel:
    """One worker's loads beside its steps (``async_loads``): one after another, first
    come first served, on whatever clock the caller keeps (the engine loop's wall clock,
    the simulator's virtual one)."""

    #: When the channel is next free.
    free_at: float = 0.0
    #: Loads in flight: (lands at, request id), soonest first.
    pending: list[tuple[float, str]] = field(default_factory=list)

    def start(self, now: float, seconds: float, request_id: str) -> float:
        """Queue a load of ``seconds`` after those before it; when it lands."""
        self.free_at = done = max(now, self.free_at) + seconds
        heapq.heappush(self.pending, (done, request_id))
        return done

    def landed(self, now: float) -> list[str]:
        """The requests whose loads have landed by ``now`` (each once)."""
        out = []
        while self.pending and self.pending[0][0] <= now:
            out.append(heapq.heappop(self.pending)[1])
        return out

    def next_at(self) -> float | None:
        """When the next load lands (None: none in flight)."""
        return self.pending[0][0] if self.pending else None
