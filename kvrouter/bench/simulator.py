"""Offline discrete-event replay of a trace on a simulated cluster, with the real cores.

Each worker is the code a live ``sim`` worker runs: a metadata-only
:class:`~engine_worker.block_pool.BlockPool` with the configured tiers, the
:class:`~engine_worker.scheduler.Scheduler` and the
:class:`~engine_worker.runners.sim.SimRunner`, whose step durations come from
the timing profile. One :class:`~indexer.index.memory.MemoryIndex` is fed the
workers' real events and the real policy routes every request. Only the clock
is virtual: a heap of step completions merged with the trace's arrivals::

    arrival at t:  deliver index batches due by t -> views -> index.match(keys)
                   -> policy.choose -> scheduler.add; an idle worker starts a step
    step start:    landed loads -> scheduler.loaded; plan = scheduler.schedule();
                   its loads queue on the worker's load channel (a wake-up when each
                   lands); d = runner.execute(plan).duration_s
    step end t+d:  scheduler.update(plan) -> first tokens, finishes;
                   pool.take_events() -> EventBatch(host, epoch, seq + 1), delivered
                   to the index at t + d + event_delay; next step if work remains

A step end at the same instant as an arrival is processed first.

Routing is the gateway's own core (``kvrouter.router_core.RouterCore``): load
overlay, candidates, policy, session affinity (for trace records that carry a
``session_id``) and the PD plan. With ``view_interval_s == 0`` every routing
sees each worker's state at that instant (running, waiting, queued prefill
tokens, KV usage, profile; ``ts`` = now) and nothing is overlaid. With
``view_interval_s > 0`` views are heartbeats taken every interval, and the core
lays the router's own accounting over them as in the gateway: requests in
flight, the prompt tokens it routed that have not produced a first token
yet (the uncached part, by the decision's matched blocks), and the distinct
prompt blocks of those that have and are still running (KV held in HBM);
each term is the router's count now plus what the heartbeat showed beyond the
router's count when it was taken (as the gateway dates a heartbeat by its
age). The core also
marks each prefix match's HBM blocks that none of those running requests
holds (``PrefixMatch.idle_hbm``), from the same held keys; with exact views, the
HBM blocks no request on the worker references, from its pool.

Requests hold the keys the router computed (``indexer.keys.block_keys`` from
the same root), so a prompt is hashed once per replay, as its tokens are known.
The index is driven through its synchronous core (``MemoryIndex.apply_sync`` /
``match_sync``), which its async methods wrap.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.kv_transfer import import_blocks
from engine_worker.profiles import default_profile
from engine_worker.request import Request, SamplingParams
from engine_worker.runners.base import StepResult
from engine_worker.runners.sim import SimRunner
from engine_worker.scheduler import LoadChannel, Scheduler, SchedulerConfig, SchedulerPlan
from indexer.events import EventBatch
from indexer.index.base import ApplyStatus
from indexer.index.memory import MemoryIndex
from indexer.keys import root_parent
from indexer.media import MEDIA, Medium
from indexer.profile import TimingProfile
from indexer.views import Role, WorkerView
from kvrouter.bench.oracle import OracleBound, trace_bound
from kvrouter.bench.report import RequestRecord
from kvrouter.bench.trace import PromptFactory, TraceRecord, arrival_times
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.load import HeldBlocks, Load, admission_load, queued_share
from kvrouter.gateway.pd import PdMode, PdPlanner
from kvrouter.router_core import CoreDecision, RouterCore, prefill_tokens, route_request
from policies.base import NoWorkerError, Policy
from policies.cost_model import DEFAULT_TRANSFER_BANDWIDTH

__all__ = [
    "JITTER_S",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "blocks_for_bytes",
    "simulate",
    "trace_oracle",
]

#: Default tier sizes per worker, in bytes: an 80 GB H100 at vLLM's 0.9 memory
#: utilization minus Llama-3-8B's 16 GB of bf16 weights (56 GB of KV, ~26.7K
#: blocks at B=16); 64 GB of host DRAM and 256 GB of NVMe. A real node has more
#: DRAM and SSD; these bound the pool's metadata so a replay stays fast.
HBM_KV_BYTES = 80e9 * 0.9 - 16e9
DRAM_KV_BYTES = 64e9
SSD_KV_BYTES = 256e9

#: Heap entries at or below this wake worker ``_WAKE - entry`` (a load landed).
_WAKE = -(1 << 40)

#: The most a perturbed replay (``SimConfig.jitter``) delays an arrival: 1 ms.
JITTER_S = 1e-3


class SimulationError(RuntimeError):
    """The replay cannot proceed (a request that never fits, a policy naming no worker...)."""


def blocks_for_bytes(num_bytes: float, profile: TimingProfile, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that ``num_bytes`` of KV memory hold under ``profile``."""
    return int(num_bytes // (profile.kv_bytes_per_token * block_size))


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A simulated cluster.

    Attributes:
        workers: Workers (hosts ``w0``, ``w1``... zero-padded).
        block_size: Tokens per KV block (B).
        model: Served model name (the root of the block keys).
        profile: Timing profile of the workers (unless ``worker_profiles`` is given).
        worker_profiles: A mixed fleet: the timing profiles of the workers in turn, in
            the order ``w0``, ``w1``..., ``p0``..., ``d0``... (cycled: ``(h100, a100)``
            makes every other worker an A100), as ``kvrouter up --profile`` gives them
            to the workers it starts; empty: every worker has ``profile``. Each
            worker's view publishes its own, as a heartbeat does.
        hbm_blocks: HBM blocks per worker (None: :data:`HBM_KV_BYTES` worth).
        dram_blocks: DRAM blocks per worker (None: :data:`DRAM_KV_BYTES` worth; 0: no tier).
        ssd_blocks: SSD blocks per worker (None: :data:`SSD_KV_BYTES` worth; 0: no tier).
        max_num_seqs: Requests per step at most.
        max_num_batched_tokens: Step token budget (None: the profile's); the profile
            the policies see is given the same budget.
        max_model_len: Longest prompt + output (None: the trace's longest).
        event_delay_s: Virtual delay from a step's end to its events reaching the index.
        view_interval_s: Heartbeat period of worker views (0: exact views at each routing).
        time_scale: Arrival rate multiplier (see :func:`kvrouter.bench.trace.arrival_times`).
        seed: Seeds the policies and the workers' epochs.
        vocab_size: Token ids of the replayed prompts and of generated tokens.
        prefill_workers: Prefill-only workers (hosts ``p0``...), beside ``workers``.
        decode_workers: Decode-only workers (hosts ``d0``...).
        pd: Prefill/decode split, as the gateway's ``--pd`` (``never``, ``always``,
            ``auto``; :class:`kvrouter.gateway.pd.PdPlanner`).
        transfer_bandwidth: Bytes/s of a KV transfer between two workers (PD hand-offs
            and pooled prefixes); the default is one 100 Gb/s RDMA NIC.
        jitter: 0 replays the trace's arrival times as they are; k > 0 delays each
            arrival by a seeded amount under :data:`JITTER_S` (the k-th perturbation),
            less than any client or network adds. Near capacity a replay is chaotic:
            such a perturbation moves a cell's TTFT p90 by tens of percent
            (docs/benchmarks.md, "2026-12-04 (fourth)"), so replaying a few ``k`` tells a
            difference between two policies from the luck of one trajectory.
        async_loads: The workers bring cached DRAM/SSD blocks up into HBM beside their
            steps, one load at a time per worker (``SchedulerConfig.async_loads``, a
            ``sim`` worker's default, as vLLM's offloading connector does); False:
            in the step that admits the request, which every request in it waits for.
    """

    workers: int = 8
    block_size: int = 16
    model: str = "llama3-8b"
    profile: TimingProfile = field(default_factory=default_profile)
    worker_profiles: tuple[TimingProfile, ...] = ()
    hbm_blocks: int | None = None
    dram_blocks: int | None = None
    ssd_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    event_delay_s: float = 0.010
    view_interval_s: float = 0.0
    time_scale: float = 1.0
    seed: int = 0
    vocab_size: int = 32000
    prefill_workers: int = 0
    decode_workers: int = 0
    pd: PdMode = "never"
    transfer_bandwidth: float = DEFAULT_TRANSFER_BANDWIDTH
    jitter: int = 0
    async_loads: bool = True

    def __post_init__(self) -> None:
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if min(self.workers, self.prefill_workers, self.decode_workers) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.workers + self.prefill_workers + self.decode_workers < 1:
            raise ValueError("workers + prefill_workers + decode_workers must be >= 1")
        if self.workers + self.prefill_workers < 1:
            raise ValueError(
                "the cluster needs a worker that prefills (workers or prefill_workers)"
            )
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1")
        if self.pd not in ("never", "always", "auto"):
            raise ValueError(f"pd must be never, always or auto, got {self.pd!r}")
        if not (math.isfinite(self.transfer_bandwidth) and self.transfer_bandwidth > 0):
            raise ValueError(f"transfer_bandwidth must be positive, got {self.transfer_bandwidth}")
        for other in self.worker_profiles:
            if other.kv_bytes_per_token != self.profile.kv_bytes_per_token:
                raise ValueError(
                    f"worker profile {other.name!r} holds {other.kv_bytes_per_token} KV bytes "
                    f"per token, {self.profile.name!r} {self.profile.kv_bytes_per_token}: a "
                    "mixed fleet serves one model"
                )
        if self.hbm_blocks is not None and self.hbm_blocks < 1:
            raise ValueError(f"hbm_blocks must be >= 1, got {self.hbm_blocks}")
        for name in ("dram_blocks", "ssd_blocks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        for name in ("event_delay_s", "view_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")

    def capacity(self) -> TierCapacity:
        """Blocks per medium of one worker."""
        p, b = self.profile, self.block_size

        def pick(value: int | None, default_bytes: float) -> int:
            return blocks_for_bytes(default_bytes, p, b) if value is None else value

        return TierCapacity(
            hbm=pick(self.hbm_blocks, HBM_KV_BYTES),
            dram=pick(self.dram_blocks, DRAM_KV_BYTES),
            ssd=pick(self.ssd_blocks, SSD_KV_BYTES),
        )

    def effective_profile(self, profile: TimingProfile | None = None) -> TimingProfile:
        """``profile`` (default: :attr:`profile`) with the step budget the schedulers use."""
        profile = self.profile if profile is None else profile
        budget = self.max_num_batched_tokens
        return profile if budget is None else profile.with_step_budget(budget)

    def profile_of(self, index: int) -> TimingProfile:
        """The effective profile of the ``index``-th worker (``w*``, then ``p*``, then
        ``d*``; see ``worker_profiles``)."""
        mixed = self.worker_profiles
        return self.effective_profile(mixed[index % len(mixed)] if mixed else None)


@dataclass(slots=True)
class SimResult:
    """One replay's outcome.

    Attributes:
        policy: The policy's name.
        records: One per trace request, in trace order.
        busy_s: Per worker, the sum of its step durations.
        steps: Per worker, the steps it ran.
        in_use_blocks: Per worker, HBM blocks still referenced at the end (0: no leak).
        capacity: Blocks per medium of each worker.
        cached_blocks: Blocks holding a cached key per medium, summed over the workers'
            pools at the end (what the index should hold once every event landed).
        index_entries: (block, host) entries per medium in the index at the end.
        wall_s: Real seconds the replay took (not part of the results' identity).
        busy_arrivals_s: Per worker, the part of its step durations that fell between
            the first arrival and the last: how saturated the cluster was while load
            was offered, which the drain after the last arrival does not dilute.
    """

    policy: str
    records: list[RequestRecord]
    busy_s: dict[str, float]
    steps: dict[str, int]
    in_use_blocks: dict[str, int]
    capacity: TierCapacity
    cached_blocks: dict[Medium, int]
    index_entries: dict[Medium, int]
    wall_s: float = 0.0
    busy_arrivals_s: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Worker:
    """One simulated worker and its step in progress."""

    slot: int
    host: str
    pool: BlockPool
    scheduler: Scheduler
    runner: SimRunner
    epoch: int
    seq: int = 0
    busy_s: float = 0.0
    #: Step time between the first arrival and the last (SimResult.busy_arrivals_s).
    busy_arrivals_s: float = 0.0
    steps: int = 0
    in_flight: int = 0
    step: tuple[SchedulerPlan, StepResult] | None = None
    #: When the step in progress ends (0.0: none).
    step_ends: float = 0.0
    beat: WorkerView | None = None
    beat_seen: Load | None = None
    #: The router's own count of what it routed here that has not prefilled yet: prompt
    #: tokens, their attention work, the cached blocks their admission takes.
    queued: Load = field(default_factory=Load)
    #: The router's own count of the prompt blocks held here (first token to finish).
    tracked_held: HeldBlocks = field(default_factory=HeldBlocks)
    #: The router's count of its requests past their first token and not finished.
    tracked_running: int = 0
    #: Prompt tokens to prefill of the requests waiting here for a pulled prefix.
    pulling: int = 0
    role: Role = Role.BOTH
    #: Its timing profile (the step budget applied): what its runner models and its
    #: view publishes.
    profile: TimingProfile = field(default_factory=default_profile)
    #: Its loads beside the steps (``async_loads``).
    loads: LoadChannel = field(default_factory=LoadChannel)


@dataclass(frozen=True, slots=True)
class _InUse:
    """The block keys a worker's requests hold in HBM, read from its pool (exact views)."""

    pool: BlockPool

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.pool.in_use(key)


@dataclass(slots=True)
class _Transfer:
    """KV blocks on their way to ``target``, and the request that waits for them.

    A PD hand-off (``cached`` is what the prefill worker's cache served, the request's
    hit rate) or a pooled prefix (``cached`` None: the target's own hit counts).
    """

    index: int
    target: str
    keys: list[int]
    tokens: list[int]
    have: int
    held: int
    cached: tuple[int, int, int] | None = None
    counted: bool = False


def _max_model_len(trace: Sequence[TraceRecord], config: SimConfig) -> int:
    longest = max(r.input_length + r.output_length for r in trace)
    limit = config.max_model_len if config.max_model_len is not None else max(longest, 2)
    if longest > limit:
        worst = next(i for i, r in enumerate(trace) if r.input_length + r.output_length > limit)
        raise SimulationError(
            f"trace request {worst} needs {longest} tokens, more than max_model_len={limit}"
        )
    return limit


class _Cluster:
    """The replay's state; :func:`simulate` builds one per run."""

    def __init__(self, trace: Sequence[TraceRecord], policy: Policy, config: SimConfig) -> None:
        self.trace = trace
        self.policy = policy
        self.config = config
        self.profile = config.effective_profile()
        self.capacity = config.capacity()
        self.root = root_parent(config.model)
        self.prompts = PromptFactory(config.block_size, self.root, vocab_size=config.vocab_size)
        max_model_len = _max_model_len(trace, config)
        rng = random.Random(config.seed)
        self.workers: list[_Worker] = []
        for prefix, count, role in (
            ("w", config.workers, Role.BOTH),
            ("p", config.prefill_workers, Role.PREFILL),
            ("d", config.decode_workers, Role.DECODE),
        ):
            width = len(str(max(count - 1, 0)))
            for i in range(count):
                slot = len(self.workers)
                profile = config.profile_of(slot)
                sched = SchedulerConfig(
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=profile.max_num_batched_tokens,
                    max_model_len=max_model_len,
                    async_loads=config.async_loads,
                )
                pool = BlockPool(self.capacity)
                try:
                    scheduler = Scheduler(sched, pool, config.block_size)
                except ValueError as exc:
                    raise SimulationError(str(exc)) from exc
                runner = SimRunner(profile, config.block_size, vocab_size=config.vocab_size)
                epoch = rng.getrandbits(62)
                host = f"{prefix}{i:0{width}d}"
                self.workers.append(
                    _Worker(slot, host, pool, scheduler, runner, epoch, role=role, profile=profile)
                )
        self.by_host = {w.host: w for w in self.workers}
        self.index = MemoryIndex()
        self.pending: deque[tuple[float, EventBatch]] = deque()
        self.heap: list[tuple[float, int, int]] = []
        #: The first and last arrival (set when the replay starts).
        self.arrival_window = (0.0, 0.0)
        self.tiebreak = itertools.count()
        self.records: list[RequestRecord | None] = [None] * len(trace)
        self.live: dict[str, int] = {}
        #: Per routed request until its first token: its share of its worker's ``queued``.
        self.unprefilled: dict[str, Load] = {}
        #: The prompt's block keys of each request routed, until it ends (as the gateway's
        #: ticket has them): held on its worker from its first token.
        self.prompt_keys: dict[str, tuple[int, ...]] = {}
        self.next_beat = 0.0
        planner = (
            PdPlanner(config.pd, self.profile, pooling=bool(getattr(policy, "pooling", False)))
            if config.pd != "never"
            else None
        )
        self.core = RouterCore(policy, affinity=SessionAffinity(), planner=planner)
        #: Prefill-only requests (PD) by request id: the hand-off waiting for each.
        self.handoffs: dict[str, _Transfer] = {}
        self.transfers: dict[int, _Transfer] = {}
        self.transfer_ids = itertools.count()
        self.cached_override: dict[int, tuple[int, int, int]] = {}

    # -- index ------------------------------------------------------------------------

    def deliver(self, now: float) -> None:
        """Apply, in order, every published batch due at the index by ``now``."""
        pending, index = self.pending, self.index
        while pending and pending[0][0] <= now:
            batch = pending.popleft()[1]
            result = index.apply_sync(batch)
            if result.status is not ApplyStatus.APPLIED:
                raise SimulationError(f"index refused batch {batch.seq} of {batch.host}: {result}")

    def publish(self, w: _Worker, now: float) -> None:
        """Wrap the pool's events of the step just ended in the worker's next batch."""
        events = w.pool.take_events()
        if events:
            w.seq += 1
            batch = EventBatch(host=w.host, epoch=w.epoch, seq=w.seq, ts=now, events=events)
            self.pending.append((now + self.config.event_delay_s, batch))

    # -- views --------------------------------------------------------------------------

    def view(self, w: _Worker, now: float) -> WorkerView:
        """The worker as its heartbeat at ``now`` would describe it."""
        load = w.scheduler.load()
        cap = self.capacity
        return WorkerView(
            host=w.host,
            model=self.config.model,
            block_size=self.config.block_size,
            epoch=w.epoch,
            # A request waiting for its pulled prefix is queued as far as routing goes.
            **load.view_fields(queued_extra_tokens=w.pulling),
            in_flight=w.in_flight,
            kv_capacity_blocks={m: cap.of(m) for m in MEDIA},
            kv_used_blocks=w.pool.usage(),
            transfer_bandwidth=self.config.transfer_bandwidth,
            async_loads=self.config.async_loads,
            role=w.role,
            profile=w.profile,
            step_ends_ts=w.step_ends,
            ts=now,
        )

    def heartbeat(self, now: float) -> None:
        """Take the heartbeats due by ``now`` (state is constant since the last event)."""
        interval = self.config.view_interval_s
        if interval <= 0 or now < self.next_beat:
            return
        beat = math.floor(now / interval) * interval
        for w in self.workers:
            w.beat = self.view(w, beat)
            w.beat_seen = self.tracked(w.host)
        self.next_beat = beat + interval

    def views(self, now: float) -> list[WorkerView]:
        """What the router sees of every worker: exact views, or the last heartbeats."""
        if self.config.view_interval_s <= 0:
            return [self.view(w, now) for w in self.workers]
        beats = [w.beat for w in self.workers]
        assert all(b is not None for b in beats)
        return [b for b in beats if b is not None]

    def tracked(self, host: str) -> Load:
        """The router's own count of what it sent to ``host`` (overlaid on heartbeats)."""
        w = self.by_host[host]
        # The queued shares carry every queued figure; in flight and held are kept apart.
        return replace(
            w.queued, in_flight=w.in_flight, held_blocks=len(w.tracked_held),
            running=w.tracked_running,
        )  # fmt: skip

    def seen_of(self, view: WorkerView) -> Load | None:
        """The router's count for a worker when its last heartbeat was taken."""
        return self.by_host[view.host].beat_seen

    def held_of(self, host: str) -> HeldBlocks:
        """The block keys the router's running requests hold on ``host``."""
        return self.by_host[host].tracked_held

    def pool_held_of(self, host: str) -> _InUse:
        """The block keys requests hold on ``host`` now, as its pool knows them (the
        exact views' counterpart of :meth:`held_of`)."""
        return _InUse(self.by_host[host].pool)

    def decide(self, i: int, now: float, tokens: int, keys: list[int]) -> CoreDecision:
        """Route trace request ``i`` through the router core, as the gateway does."""
        rec, cfg = self.trace[i], self.config
        request = route_request(
            f"r{i}", cfg.model, tokens, keys, cfg.block_size, now, rec.output_length,
            rec.session_id,
        )  # fmt: skip
        exact = cfg.view_interval_s <= 0
        try:
            out = self.core.decide(
                request, self.views(now), None if exact else self.tracked,
                self.index.match_sync(keys), clock=now,
                held_of=self.pool_held_of if exact else self.held_of,
                seen_of=None if exact else self.seen_of,
            )  # fmt: skip
        except NoWorkerError as exc:
            raise SimulationError(str(exc)) from exc
        self.core.served(rec.session_id, out.worker, now)
        return out

    # -- requests and steps -------------------------------------------------------------

    def route(self, i: int, now: float) -> None:
        """Route trace request ``i`` with the policy (and the PD plan) and queue it."""
        rec = self.trace[i]
        tokens = self.prompts.tokens(rec)
        keys = self.prompts.keys(rec)
        self.deliver(now)
        rid = f"r{i}"
        out = self.decide(i, now, len(tokens), keys)
        decision, plan = out.decision, out.plan
        w = self.by_host.get(out.worker)
        if w is None:
            raise SimulationError(f"policy {self.policy.name} chose unknown worker {decision}")
        predicted = decision.predicted_ttft_s
        size = self.config.block_size
        # As the gateway: what each worker would still prefill, counted as queued there.
        todo = prefill_tokens(decision, plan, len(tokens), size)
        if plan is not None:
            if plan.disaggregate and plan.decode is not None:
                self.records[i] = RequestRecord(
                    i, plan.decode, now, len(tokens), predicted_ttft_s=predicted,
                    prefill_worker=w.host,
                )  # fmt: skip
                handoff = _Transfer(i, plan.decode, keys, tokens, 0, 0)
                self.handoffs[f"{rid}.p"] = handoff
                uncached = todo.get(w.host, len(tokens))
                self.admit(w, f"{rid}.p", tokens, keys, 1, uncached, i, now)
                return
            w = self.by_host[plan.prefill]
        self.records[i] = RequestRecord(i, w.host, now, len(tokens), predicted_ttft_s=predicted)
        # As the gateway: the cached blocks the policy says its admission takes from the
        # free pool (and loads from DRAM and SSD) count as queued on the worker until its
        # first token.
        admission = admission_load(decision.scores.get(w.host, {}))
        # As the gateway: a peer's prefix is pulled onto the policy's own choice when it
        # prefills there, as the policy priced it; onto the worker a colocated plan moved
        # the request to, as the plan priced it.
        pooled, priced = None, 0
        if plan is not None and w.host != decision.worker:
            pooled, priced = plan.kv_source, plan.matched_blocks
        elif w.host == out.worker == decision.worker:
            pooled, priced = decision.kv_source, decision.matched_blocks
        source = self.by_host.get(pooled or "")
        if source is not None and source is not w:
            have = len(w.pool.match_prefix(keys))
            # The blocks priced, as the gateway asks for (no more than the source holds).
            held = min(len(source.pool.match_prefix(keys)), priced)
            if held > have:
                # The gateway counts a request's load when it dispatches it, before the
                # worker pulls: so does the replay, or the pull would hide it from routing.
                uncached = max(len(tokens) - held * size, 1)
                self.count(w, rid, len(tokens), uncached, i, keys, admission)
                w.pulling += self.unprefilled[rid].queued_tokens
                pull = _Transfer(i, w.host, keys, tokens, have, held, counted=True)
                self.send(source, pull, now)
                return
        self.admit(
            w, rid, tokens, keys, rec.output_length, todo.get(w.host, len(tokens)), i, now,
            admission=admission,
        )  # fmt: skip

    def count(
        self, w: _Worker, rid: str, tokens: int, uncached: int, i: int, keys: list[int],
        admission: Load | None = None,
    ) -> None:  # fmt: skip
        """Add a request to the router's own load count of ``w`` (released as it runs):
        ``uncached`` of its ``tokens`` prompt tokens still to prefill."""
        self.prompt_keys[rid] = tuple(keys)  # the scheduler appends output keys to its list
        w.in_flight += 1
        queued = queued_share(uncached, tokens, admission)
        w.queued.add(queued)
        self.unprefilled[rid] = queued
        self.live[rid] = i

    def prefilled(self, w: _Worker, rid: str) -> None:
        """``rid``'s prompt is computed: it leaves the router's queued count of ``w``."""
        queued = self.unprefilled.pop(rid, None)
        if queued is not None:
            w.queued.sub(queued)

    def admit(
        self, w: _Worker, rid: str, tokens: list[int], keys: list[int], output: int,
        uncached: int, i: int, now: float, counted: bool = False,
        admission: Load | None = None,
    ) -> None:  # fmt: skip
        """Queue a request on ``w`` (counting its load, ``uncached`` prompt tokens to
        prefill, unless ``counted``); an idle worker starts a step."""
        cfg = self.config
        sampling = SamplingParams(max_tokens=output, ignore_eos=True)
        request = Request(rid, tokens, sampling, self.root, cfg.block_size, arrival=now)
        request.keys = keys
        w.scheduler.add(request)
        if not counted:
            self.count(w, rid, len(tokens), uncached, i, keys, admission)
        if w.step is None:
            self.start_step(w, now)

    def send(self, source: _Worker, transfer: _Transfer, now: float) -> None:
        """Start moving ``transfer``'s blocks from ``source``; they land when both the
        network and the source's reads are done.

        The source streams blocks as it reads them, so a transfer takes the longer of the
        network time (bytes / ``transfer_bandwidth``) and the time the source spends reading
        the blocks off their media at its profile's load bandwidth: a peer's SSD is read no
        faster than the peer could load it itself (HBM blocks are read at memory speed).
        The source's blocks are read at once (a PD lease holds them; a pooled pull reads
        what the source holds now), so later evictions there do not matter.
        """
        size = self.config.block_size
        moved = transfer.held - transfer.have
        network = moved * size * self.profile.kv_bytes_per_token / self.config.transfer_bandwidth
        media = Counter(b.medium for b in source.pool.match_prefix(transfer.keys)[
            transfer.have : transfer.held
        ])  # fmt: skip
        read = source.profile.blocks_load_seconds(media, size)
        seconds = max(network, read)
        tid = next(self.transfer_ids)
        self.transfers[tid] = transfer
        heapq.heappush(self.heap, (now + seconds, next(self.tiebreak), -1 - tid))

    def land(self, tid: int, now: float) -> None:
        """Import a transfer's blocks into its target, then queue the waiting request."""
        t = self.transfers.pop(tid)
        w = self.by_host[t.target]
        have = len(w.pool.match_prefix(t.keys))
        start = min(have, t.held)
        parent = t.keys[start - 1] if start else self.root
        run = t.keys[start : t.held]
        import_blocks(w.pool, None, parent, run, [b""] * len(run))
        self.publish(w, now)
        if t.cached is not None:
            self.cached_override[t.index] = t.cached
        if t.counted:
            w.pulling -= self.unprefilled[f"r{t.index}"].queued_tokens
        output = self.trace[t.index].output_length
        uncached = max(len(t.tokens) - t.held * self.config.block_size, 1)
        self.admit(
            w, f"r{t.index}", t.tokens, t.keys, output, uncached, t.index, now, counted=t.counted
        )

    def start_step(self, w: _Worker, now: float) -> None:
        """Plan and time the worker's next step, or leave it idle when it has no work (or
        only loads in flight: the first to land wakes it)."""
        for request_id in w.loads.landed(now):
            w.scheduler.loaded(request_id)
        plan = w.scheduler.schedule()
        for req, media in plan.loads:
            seconds = w.profile.blocks_load_seconds(media, self.config.block_size)
            done = w.loads.start(now, seconds, req.request_id)
            heapq.heappush(self.heap, (done, next(self.tiebreak), _WAKE - w.slot))
        if plan.empty:
            if w.scheduler.can_schedule() and w.loads.next_at() is None:
                raise SimulationError(f"{w.host} has work but cannot schedule any of it")
            w.step = None
            w.step_ends = 0.0
            return
        result = w.runner.execute(plan)
        w.step = (plan, result)
        w.step_ends = now + result.duration_s
        w.busy_s += result.duration_s
        first, last = self.arrival_window
        w.busy_arrivals_s += max(min(now + result.duration_s, last) - max(now, first), 0.0)
        w.steps += 1
        heapq.heappush(self.heap, (now + result.duration_s, next(self.tiebreak), w.slot))

    def end_step(self, w: _Worker, now: float) -> int:
        """Fold the finished step in; return how many requests finished."""
        assert w.step is not None
        plan, result = w.step
        outputs = w.scheduler.update(plan, result.sampled)
        finished = 0
        for out in outputs:
            req = out.request
            if not out.finished and len(req.output_token_ids) != 1:
                continue  # a token in the middle of a request: nothing to record
            handoff = self.handoffs.pop(req.request_id, None) if out.finished else None
            if handoff is not None:
                # PD: the prefill-only request is done; its blocks go to the decoder.
                self.prefilled(w, req.request_id)
                del self.prompt_keys[req.request_id]
                del self.live[req.request_id]
                w.in_flight -= 1
                c = req.cached_tokens
                handoff.cached = (c[0], c[1], c[2])
                handoff.have = len(self.by_host[handoff.target].pool.match_prefix(handoff.keys))
                handoff.held = len(w.pool.match_prefix(handoff.keys))
                self.send(w, handoff, now)
                continue
            rec = self.records[self.live[req.request_id]]
            assert rec is not None
            if rec.first_token_s is None:
                rec.first_token_s = now
                self.prefilled(w, req.request_id)
                w.tracked_held.hold(self.prompt_keys[req.request_id])
                w.tracked_running += 1
            if out.finished:
                w.tracked_held.release(self.prompt_keys.pop(req.request_id))
                w.tracked_running -= 1
                rec.finish_s = now
                rec.output_tokens = len(req.output_token_ids)
                c = req.cached_tokens
                rec.cached_tokens = self.cached_override.pop(rec.index, (c[0], c[1], c[2]))
                rec.preemptions = req.num_preemptions
                del self.live[req.request_id]
                w.in_flight -= 1
                finished += 1
        self.publish(w, now)
        self.start_step(w, now)
        return finished

    def run(self, progress: Callable[[int], None] | None) -> None:
        """Process arrivals and step ends in time order until every request finished."""
        arrivals = arrival_times(self.trace, self.config.time_scale)
        if self.config.jitter:
            rng = random.Random(f"jitter:{self.config.jitter}")
            arrivals = [t + rng.random() * JITTER_S for t in arrivals]
        order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))
        if order:
            self.arrival_window = (arrivals[order[0]], arrivals[order[-1]])
        heap = self.heap
        n = len(order)
        a = 0
        self.heartbeat(0.0)
        while a < n or heap:
            if heap and (a >= n or heap[0][0] <= arrivals[order[a]]):
                now, _, slot = heapq.heappop(heap)
                self.heartbeat(now)
                if slot <= _WAKE:
                    w = self.workers[_WAKE - slot]
                    if w.step is None:
                        self.start_step(w, now)
                    continue
                if slot < 0:
                    self.land(-1 - slot, now)
                    continue
                done = self.end_step(self.workers[slot], now)
                if done and progress is not None:
                    progress(done)
            else:
                now = arrivals[order[a]]
                self.heartbeat(now)
                self.route(order[a], now)
                a += 1
        self.deliver(math.inf)


def simulate(
    trace: Sequence[TraceRecord],
    policy: Policy,
    config: SimConfig | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay ``trace`` on the simulated cluster, routing with ``policy``.

    Args:
        trace: The requests (any order; replayed by arrival time, then position).
        policy: A fresh policy (it keeps state across calls).
        config: The cluster (defaults: 8 H100-sized workers).
        progress: Called with the number of requests that just finished.

    Raises:
        SimulationError: An empty trace, a request longer than ``max_model_len`` or
            than a worker's HBM, a policy naming an unknown worker, or (a bug) the
            router's own load counts not back to zero at the end.
    """
    if not trace:
        raise SimulationError("the trace is empty")
    cfg = config if config is not None else SimConfig()
    start = time.perf_counter()
    cluster = _Cluster(trace, policy, cfg)
    cluster.run(progress)
    records = [r for r in cluster.records if r is not None]
    if len(records) != len(trace) or cluster.live or cluster.transfers:
        raise SimulationError(f"{len(cluster.live)} requests never finished")
    workers = cluster.workers
    counts = {w.host: cluster.tracked(w.host) for w in workers}
    leaked = {host: load for host, load in counts.items() if not load.empty()}
    if leaked or cluster.prompt_keys or cluster.unprefilled:
        raise SimulationError(f"the router's load counts did not return to zero: {leaked}")
    snapshots = [w.pool.snapshot() for w in workers]
    return SimResult(
        policy=policy.name,
        records=records,
        busy_s={w.host: w.busy_s for w in workers},
        steps={w.host: w.steps for w in workers},
        in_use_blocks={w.host: cluster.capacity.hbm - w.pool.num_free(Medium.HBM) for w in workers},
        capacity=cluster.capacity,
        cached_blocks={m: sum(len(snap[m]) for snap in snapshots) for m in MEDIA},
        index_entries=cluster.index.stats_sync().entries,
        wall_s=time.perf_counter() - start,
        busy_arrivals_s={w.host: w.busy_arrivals_s for w in workers},
    )


def trace_oracle(trace: Sequence[TraceRecord], config: SimConfig | None = None) -> OracleBound:
    """The oracle bound of ``trace`` on ``config``'s cluster (all tiers of all workers)."""
    cfg = config if config is not None else SimConfig()
    cap = cfg.capacity()
    hosts = cfg.workers + cfg.prefill_workers + cfg.decode_workers
    total = hosts * (cap.hbm + cap.dram + cap.ssd)
    return trace_bound(
        trace, total, cfg.block_size, cfg.model, vocab_size=cfg.vocab_size,
        time_scale=cfg.time_scale,
    )  # fmt: skip
