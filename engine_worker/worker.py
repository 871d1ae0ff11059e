"""A worker, HTTP aside: model, tokenizer, tiers, pool, scheduler, runner, engine loop, Redis link.

:meth:`Worker.build` does the heavy, synchronous part (loading weights and
the tokenizer, allocating the tiers); :meth:`Worker.start` and
:meth:`Worker.stop` run on the server's event loop and own the engine
thread, the event publisher and the heartbeat. Without a Redis URL the
worker serves alone (no events, no heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_worker.block_pool import BlockPool, PoolStats, TierCapacity
from engine_worker.chat_template import ChatTemplate, ChatTemplateError
from engine_worker.engine import EngineLoop, EventSink, SinkFanOut, StepRecord
from engine_worker.kv_pull import KvPuller, ModeledTransfer
from engine_worker.kv_socket import KvSocketServer
from engine_worker.kv_transfer import Outgoing, export_pinned, transfer_chunks
from engine_worker.metrics import WorkerMetrics
from engine_worker.model.registry import ModelSpec, resolve
from engine_worker.pd import Leases
from engine_worker.presence import Presence
from engine_worker.profiles import default_profile, load_profile
from engine_worker.publisher import EventPublisher, new_epoch
from engine_worker.runners.base import Runner
from engine_worker.runners.sim import SimRunner, plan_seconds
from engine_worker.scheduler import Scheduler, SchedulerConfig, SchedulerLoad, SchedulerPlan
from engine_worker.settings import WorkerSettings
from engine_worker.tokenizer import Tokenizer, load_tokenizer
from engine_worker.vllm_events import VllmEventPublisher
from indexer.ingest_reader import Client, client_for
from indexer.keys import root_parent
from indexer.media import MEDIA, Medium
from indexer.profile import TimingProfile
from indexer.registry import RedisHostRegistry
from indexer.tasks import cancel_and_wait
from indexer.views import WorkerView
from indexer.wire import Keyspace

if TYPE_CHECKING:
    from engine_worker.tiers import TierStorage

__all__ = ["Worker"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineState:
    """The engine's load as of its last step (read by heartbeats without touching the pool)."""

    load: SchedulerLoad = field(default_factory=SchedulerLoad)
    used_blocks: dict[Medium, int] = field(default_factory=dict)
    moves: PoolStats = field(default_factory=PoolStats)


class Worker:
    """Everything one worker runs."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        spec: ModelSpec,
        tokenizer: Tokenizer,
        pool: BlockPool,
        storage: TierStorage | None,
        scheduler: Scheduler,
        runner: Runner,
        metrics: WorkerMetrics,
    ) -> None:
        self.settings = settings
        self.name = settings.worker_name
        self.model_name = settings.served_model_name or spec.name
        self.spec = spec
        self.tokenizer = tokenizer
        try:
            self.chat_template: ChatTemplate | None = ChatTemplate.for_tokenizer(tokenizer)
        except ChatTemplateError:
            self.chat_template = None
        # Computed now, not on the first request: the gateway sends it (tokenized_prompt).
        log.info("tokenizer fingerprint %s", tokenizer.fingerprint)
        self.pool = pool
        self.storage = storage
        self.scheduler = scheduler
        self.runner = runner
        self.metrics = metrics
        self.block_size = settings.block_size
        self.epoch = new_epoch()
        self.started_at = time.time()
        self.state = EngineState()
        self.engine = EngineLoop(
            scheduler,
            runner,
            time_scale=settings.time_scale,
            on_step=self._on_step,
            on_change=lambda: self._refresh_state(self.scheduler),
            step_estimate=self._step_seconds,
        )
        self.redis: Client | None = None
        self.publisher: EventPublisher | None = None
        self.vllm_events: VllmEventPublisher | None = None
        self.presence: Presence | None = None
        self._roots: dict[str, int] = {}
        token = settings.internal_token
        self.puller = KvPuller(
            engine=self.engine,
            storage=storage,
            model=self.model_name,
            block_size=self.block_size,
            metrics=metrics,
            token=token.get_secret_value() if token is not None else None,
            modeled=ModeledTransfer(
                runner.profile().kv_bytes_per_token,
                settings.sim_transfer_bandwidth,
                settings.time_scale,
            )
            if settings.runner == "sim"
            else None,
        )
        self.leases = Leases()
        self.kv_server = KvSocketServer(
            self.export_pinned,
            token.get_secret_value() if token is not None else None,
            settings.bind,
            settings.kv_port,
        )
        #: Lease expiry and the engine watch (:meth:`_watch_engine`), cancelled by stop.
        self._tasks: list[asyncio.Task[None]] = []
        self._engine_died = asyncio.Event()
        self._published = (0, 0, 0)
        self._registered = False
        #: Set on SIGTERM: new generation requests get 503 (routers retry them elsewhere).
        self.draining = False
        #: Called with the reason once the engine loop has died and the worker withdrew
        #: (the server's ``app.state.fail``: the process exits to be restarted). None: the
        #: worker stays up, answering 503, until something stops it.
        self.on_engine_death: Callable[[str], None] | None = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, settings: WorkerSettings, metrics: WorkerMetrics) -> Worker:
        """Load the model (torch runner) or just the tokenizer (sim), allocate the tiers."""
        spec = resolve(settings.model, settings.served_model_name or None)
        tokenizer = load_tokenizer(str(spec.tokenizer_path))
        capacity = TierCapacity(
            hbm=settings.hbm_blocks, dram=settings.dram_blocks, ssd=settings.ssd_blocks
        )
        storage: TierStorage | None = None
        runner: Runner
        if settings.runner == "torch":
            from engine_worker.profile_fit import ProfileFitter
            from engine_worker.runners.torch_runner import TorchRunner
            from engine_worker.tiers import TierStorage

            config, model = spec.load(device=settings.device, seed=settings.seed)
            layout = config.kv_layout(settings.block_size, settings.kv_dtype)
            storage = TierStorage(
                layout, capacity, device=settings.device, ssd_path=settings.ssd_path
            )
            prior = default_profile()
            fitter = ProfileFitter(
                name=f"{spec.name}-{settings.device}-fitted",
                kv_bytes_per_token=layout.bytes_per_token,
                load_bandwidth={},
                max_num_batched_tokens=settings.max_num_batched_tokens,
                prior=prior,
            )
            runner = TorchRunner(model, storage.hbm, fitter=fitter, seed=settings.seed)
            context = config.max_position_embeddings
        else:
            profile = load_profile(settings.profile) if settings.profile else default_profile()
            runner = SimRunner(
                profile,
                settings.block_size,
                vocab_size=min(settings.sim_vocab_size, tokenizer.vocab_size),
                avoid_token_ids=tokenizer.eos_token_ids,
            )
            context = 131072
        max_len = settings.max_model_len or min(context, settings.hbm_blocks * settings.block_size)
        pool = BlockPool(capacity, storage, enable_caching=settings.enable_prefix_caching)
        sched_config = SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            # The torch runner's copies up run in the pool's acquire, in the step's planning.
            async_loads=settings.async_loads and settings.runner == "sim",
        )
        scheduler = Scheduler(sched_config, pool, settings.block_size)
        for m in MEDIA:
            metrics.kv_blocks_capacity.labels(m.value).set(capacity.of(m))
        return cls(
            settings,
            spec=spec,
            tokenizer=tokenizer,
            pool=pool,
            storage=storage,
            scheduler=scheduler,
            runner=runner,
            metrics=metrics,
        )

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have."""
        return self.scheduler.config.max_model_len

    def root(self, cache_salt: str | None) -> int:
        """Root parent key for this model and an optional per-request cache salt."""
        salt = cache_salt or ""
        root = self._roots.get(salt)
        if root is None:
            root = root_parent(self.model_name, "", salt)
            if len(self._roots) < 4096:
                self._roots[salt] = root
        return root

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and, with Redis, the publisher and heartbeat; with a
        vLLM events endpoint, the vLLM-format publisher too."""
        sinks: list[EventSink] = []
        if self.settings.vllm_events_endpoint:
            self.vllm_events = self._start_vllm_events()
            sinks.append(self.vllm_events)
        if self.settings.redis_url:
            self.redis = await client_for(self.settings.redis_url, socket_timeout=2.0)
            keyspace = Keyspace(self.settings.key_prefix)
            self.publisher = EventPublisher(
                self.redis,
                self.name,
                keyspace=keyspace,
                epoch=self.epoch,
                max_batch_blocks=self.settings.event_batch_blocks,
                max_delay_s=self.settings.event_max_delay_s,
                buffer_limit=self.settings.event_buffer_limit,
                drop_rate=self.settings.event_drop_rate,
                request_snapshot=self.engine.request_snapshot,
                seed=self.settings.seed,
            )
            sinks.append(self.publisher)
            self.publisher.start()
            registry = RedisHostRegistry(self.redis, keyspace)

            async def register() -> None:
                registry.forget()
                if await registry.lookup(self.name) is None:
                    await registry.get_or_create(self.name)
                    if self._registered:
                        log.warning("worker %s: Redis lost its data; resynchronizing", self.name)
                        self.engine.request_snapshot()
                self._registered = True

            self.presence = Presence(
                self.redis,
                self.name,
                self.view,
                self.engine.request_snapshot,
                keyspace=keyspace,
                register=register,
                interval_s=self.settings.heartbeat_interval_s,
                ttl_s=self.settings.heartbeat_ttl_s,
            )
            # The first message of every epoch is a snapshot (SSD blocks restored at start).
            self.engine.request_snapshot()
        if sinks:
            self.engine.sink = sinks[0] if len(sinks) == 1 else SinkFanOut(sinks)
        loop = asyncio.get_running_loop()

        def crashed(_: BaseException) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._engine_died.set)

        self.engine.on_crash = crashed
        self.engine.start()
        await self.kv_server.start()
        self._tasks = [
            asyncio.create_task(self._expire_leases(), name="lease-expiry"),
            asyncio.create_task(self._watch_engine(), name="engine-watch"),
        ]
        self._refresh_state(self.scheduler)
        if self.presence is not None:
            self.presence.start()

    def _start_vllm_events(self) -> VllmEventPublisher:
        """Bind the vLLM-format event sockets (vLLM's events carry token ids: turn them on)."""
        st = self.settings
        pub = VllmEventPublisher(
            st.vllm_events_endpoint,
            block_size=self.block_size,
            root=self.root(None),
            replay_endpoint=st.vllm_events_replay_endpoint or None,
            topic=st.vllm_events_topic,
            buffer_steps=st.vllm_events_buffer_steps,
        )
        self.pool.event_token_ids = True
        pub.start()
        log.info(
            "worker %s: vLLM-format KV events on %s (replay %s, topic %r, block_size %d)",
            self.name, pub.endpoint, pub.replay_endpoint or "off", st.vllm_events_topic,
            self.block_size,
        )  # fmt: skip
        return pub

    async def drain(self) -> None:
        """Withdraw before shutdown: heartbeat gone (routers drop us), new requests 503.

        Requests in flight go on; PD leases stay pullable until they end or expire.
        """
        if not self.draining:
            log.info("worker %s: draining (%d requests in flight)", self.name, self.in_flight)
        self.draining = True
        if self.presence is not None:
            await self.presence.stop()

    @property
    def in_flight(self) -> int:
        """Requests running or waiting, as of the engine's last change."""
        return self.state.load.running + self.state.load.waiting

    async def stop(self) -> None:
        """Stop serving: heartbeat first (routers drop us), then the engine, then publishing.

        Every step runs whatever the ones before it raised: Redis and the SSD tier
        are always closed.
        """
        steps = [
            self.drain,
            self.kv_server.stop,
            self._stop_tasks,
            self._stop_engine,
            self.puller.aclose,
            *([self.publisher.stop] if self.publisher is not None else []),
            *([self._stop_vllm_events] if self.vllm_events is not None else []),
            *([self.redis.aclose] if self.redis is not None else []),
        ]
        errors = []
        for step in steps:
            try:
                await step()
            except Exception as exc:
                log.exception("worker %s: stopping failed at %s", self.name, step)
                errors.append(exc)
        if self.storage is not None:
            self.storage.close()
        if errors:
            raise errors[0]

    async def _stop_vllm_events(self) -> None:
        if self.vllm_events is not None:
            await asyncio.to_thread(self.vllm_events.stop)

    async def _stop_tasks(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []

    async def _stop_engine(self) -> None:
        if self.engine.alive:
            await self.engine.acall(self.leases.release_all)
        await asyncio.to_thread(self.engine.stop)

    # -- KV transfer ----------------------------------------------------------------------------

    async def export_stream(
        self, keys: Sequence[int], release: str | None = None
    ) -> AsyncIterator[memoryview | bytes]:
        """The transfer of the longest cached run of ``keys`` as the chunks of an HTTP
        body: pinned in one pool call (the lease ``release``, if any, released in the
        same call), then the header and each block, those on the SSD or in device memory
        read on a thread just before they go (:meth:`Outgoing.stream_header`,
        :meth:`Outgoing.take`), so a body holds one block it read at a time, not the
        run. The pins go when the body ends, however it ends, once no read is running."""
        return transfer_chunks(await self.export_pinned(keys, release))

    async def export_pinned(self, keys: Sequence[int], release: str | None = None) -> Outgoing:
        """The longest cached run of ``keys``, pinned in one pool call, which a running
        step does not hold up and which reads no SSD (see :func:`export_pinned`); the
        lease ``release`` (if any) is released in the same call. Close the result once
        sent: the pins are dropped in another."""
        storage = self.storage
        engine = self.engine
        modeled = self.puller.modeled
        read = 0.0

        def take(s: Scheduler) -> Outgoing:
            nonlocal read
            if modeled is not None:
                # A sim worker's blocks are placeholders: it takes the time its profile
                # says reading them off DRAM and SSD would (as the offline simulator
                # times a pull), so a peer's SSD copy is no faster to pull than to load.
                media = Counter(b.medium for b in s.pool.match_prefix(keys))
                read = self.runner.profile().blocks_load_seconds(media, self.block_size)
            out = export_pinned(s.pool, storage, self.model_name, self.block_size, keys)
            if release is not None:
                self.leases.release(s, release)
            return out

        out = await engine.apool_call(take)
        unpin = out.on_close

        def close() -> None:
            if engine.alive:
                engine.pool_call(lambda _: unpin())

        out.on_close = close
        if read > 0 and modeled is not None:
            try:
                await asyncio.sleep(read * (modeled.time_scale or 1.0))
            except BaseException:
                close()  # cancelled while "reading": nothing will be sent, unpin now
                raise
        self.metrics.transfer_blocks.labels("sent").inc(len(out.payload))
        self.metrics.transfer_bytes.labels("sent").inc(out.nbytes)
        return out

    async def hold_blocks(self, lease_id: str, keys: Sequence[int]) -> list[int]:
        """Hold the cached run of ``keys`` for a decoder (see :mod:`engine_worker.pd`)."""
        ttl = self.settings.lease_ttl_s
        return await self.engine.apool_call(lambda s: self.leases.hold(s, lease_id, keys, ttl))

    async def _watch_engine(self) -> None:
        """Withdraw from routing once the engine loop has died of an error.

        Every request the worker then gets is a 503 and ``/health`` says so; without
        this its heartbeat would go on, and routers would keep sending it requests that
        can only fail. Then :attr:`on_engine_death` (when set) stops the process, so
        whatever runs it restarts it with a fresh engine.
        """
        await self._engine_died.wait()
        log.critical(
            "worker %s: the engine loop died (%r); heartbeat withdrawn, /health is 503",
            self.name, self.engine.error,
        )  # fmt: skip
        await self.drain()
        if self.on_engine_death is not None:
            self.on_engine_death(
                f"worker {self.name}: the engine loop died ({self.engine.error!r})"
            )

    async def _expire_leases(self) -> None:
        period = min(1.0, self.settings.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            if not self.engine.alive:
                continue
            expired = await self.engine.apool_call(self.leases.expire)
            if expired:
                self.metrics.leases_expired.inc(expired)
                log.info("worker %s: %d block leases expired unclaimed", self.name, expired)

    # -- state for heartbeats and metrics ------------------------------------------------------

    def _refresh_state(self, scheduler: Scheduler) -> None:
        self.state = EngineState(
            load=scheduler.load(),
            used_blocks=scheduler.pool.usage(),
            moves=scheduler.pool.stats(),
        )

    def _on_step(self, record: StepRecord) -> None:
        self._refresh_state(self.scheduler)
        m = self.metrics
        m.steps.inc()
        m.step_seconds.observe(record.seconds)
        if record.plan.preempted:
            m.preemptions.inc(len(record.plan.preempted))

    def _step_seconds(self, plan: SchedulerPlan) -> float:
        """Wall-clock seconds a planned step is expected to take: its profile's time (a
        ``sim`` worker's modeled steps run ``time_scale`` times over)."""
        seconds = plan_seconds(self.runner.profile(), plan, self.block_size)
        return seconds * self.settings.time_scale if self.settings.runner == "sim" else seconds

    def profile(self) -> TimingProfile:
        """The timing profile this worker publishes.

        A ``sim`` worker's steps take its modeled times ``time_scale`` times over, so it
        publishes the profile slowed by that scale: routers then predict in the wall-clock
        time of their own books (routing rates, pulls in flight). At ``time_scale`` 0
        nothing is modeled in wall time, and it publishes the model's own profile. Either
        way with the step budget its scheduler runs (``max_num_batched_tokens``), not the
        one the profile file was written for: a router counts a long prompt's chunks
        with it.
        """
        profile = self.runner.profile()
        if self.settings.runner != "sim":
            return profile
        profile = profile.with_step_budget(self.settings.max_num_batched_tokens)
        scale = self.settings.time_scale
        return profile.slowed(scale) if scale > 0 else profile

    def load_bandwidth(self) -> dict[Medium, float]:
        """Measured bandwidth (bytes/s) moving KV into HBM, per medium, where measured."""
        return self.storage.load_bandwidth() if self.storage is not None else {}

    def view(self) -> WorkerView:
        """This worker as routers see it (heartbeat payload)."""
        st = self.state
        load = st.load
        cap = self.pool.capacity()
        fields = load.view_fields()
        # The step in progress, as of now (the state is as of the last step's end).
        fields["step_prefill_tokens"], fields["step_prefill_context"] = self.scheduler.stepping
        return WorkerView(
            host=self.name,
            url=self.settings.url,
            model=self.model_name,
            block_size=self.block_size,
            role=self.settings.role,
            epoch=self.epoch,
            events_seq=self.publisher.seq if self.publisher is not None else 0,
            **fields,
            in_flight=load.running + load.waiting,
            kv_capacity_blocks={m: cap.of(m) for m in MEDIA},
            kv_used_blocks=dict(st.used_blocks),
            load_bandwidth=self.load_bandwidth(),
            transfer_bandwidth=self.puller.bandwidth or 0.0,
            profile=self.profile(),
            marks_first_token=True,
            async_loads=self.scheduler.config.async_loads,
            step_ends_ts=self.engine.step_ends,
            ts=time.time(),
        )

    def update_metrics(self) -> None:
        """Refresh gauges from the latest engine state (called on /metrics scrapes)."""
        m = self.metrics
        st = self.state
        m.running.set(st.load.running)
        m.waiting.set(st.load.waiting)
        m.queued_prefill_tokens.set(st.load.queued_prefill_tokens)
        cap = self.pool.capacity()
        for med in MEDIA:
            used = st.used_blocks.get(med, 0)
            m.kv_blocks_used.labels(med.value).set(used)
            total = cap.of(med)
            m.kv_usage.labels(med.value).set(used / total if total else 0.0)
        for med, bw in self.load_bandwidth().items():
            m.load_bandwidth.labels(med.value).set(bw)
        if (transfer := self.puller.bandwidth) is not None:
            m.transfer_bandwidth.set(transfer)
        m.leases.set(len(self.leases))
        for kind, counts in (
            ("demotion", st.moves.demotions),
            ("promotion", st.moves.promotions),
            ("eviction", st.moves.evictions),
        ):
            for med, n in counts.items():
                m.block_moves.labels(kind, med.value).set(n)
        if self.publisher is not None:
            ps = self.publisher.stats
            now = (ps.batches_sent, ps.batches_dropped + ps.batches_faulted, ps.snapshots_sent)
            sent, dropped, snaps = (a - b for a, b in zip(now, self._published, strict=True))
            m.events_published.inc(sent)
            m.events_dropped.inc(dropped)
            m.snapshots_published.inc(snaps)
            self._published = now
            m.redis_up.set(1 if self.publisher.healthy else 0)
