"""Load accounting shared by gateway replicas: in-flight requests, queued tokens, held blocks.

Each replica counts what *it* routed, per worker: requests in flight, prompt
tokens not yet prefilled (dispatched, no first byte yet), and the distinct
prompt blocks whose KV the worker holds in HBM (first byte seen, not yet
finished; a prefix that several requests share counts once, as the worker
stores it once). Those counts are exact and immediate, unlike a worker's
heartbeat, which lags by up to one interval: a burst routed since the last
heartbeat has filled HBM that the heartbeat still shows empty. Replicas
share them through Redis *leases*::

    {p}:load:replicas            zset   replica -> lease expiry (ms)
    {p}:load:r:{replica}         hash   worker  -> "in_flight,queued_tokens,held_blocks,
                                                    queued_context,queued_taken,
                                                    queued_dram,queued_ssd,running"
                                                   (PEXPIRE lease)

``queued_context`` is the attention work of the queued tokens,
``queued_taken`` the cached blocks their admission takes from the free HBM
pool, and ``queued_dram`` / ``queued_ssd`` those of them it brings up from
DRAM / SSD (the admitting step pays their load), as a worker's heartbeat
counts them (``queued_prefill_context``, ``queued_taken_blocks``,
``queued_load_blocks``). ``running`` counts the requests past their first
token and not yet finished (the worker's decode batch, its heartbeat's
``running``). A reader also accepts the two- to seven-field forms of older
replicas (the missing fields 0) during a rolling upgrade.

Every ``sync_interval_s`` a replica writes its absolute counts (never
increments) and renews its lease, then reads the other live replicas'.
A crashed replica's counts vanish when its lease expires, so nothing it
held leaks; a request that ends in any way (success, error, client gone)
releases its counts through :class:`Ticket`, exactly once.

The counts also date each heartbeat: when discovery gets a worker's new
heartbeat, :meth:`LoadTracker.saw` looks up the counts as they were when it
was taken (a short history of this replica's counts, by the heartbeat's age),
so the overlay can tell what the heartbeat shows beyond this router's own
requests (another router's, a decode's growing KV) from what this router has
already seen end since (``kvrouter.router_core.overlay``). The history holds
each change of the last ``history_s`` seconds per worker: a few entries per
request routed there in that time.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from redis.exceptions import RedisError

from indexer.ingest_reader import Client as RedisClient
from indexer.tasks import cancel_and_wait
from indexer.views import WorkerView
from indexer.wire import Keyspace
from policies.cost_model import prefill_context

__all__ = ["HeldBlocks", "Load", "LoadTracker", "Ticket", "admission_load", "queued_share"]

log = logging.getLogger(__name__)


class HeldBlocks:
    """The distinct block keys that running requests reference on one worker (refcounted)."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}

    def hold(self, keys: Sequence[int]) -> None:
        """A request's prompt blocks are in HBM (its first token came)."""
        refs = self._refs
        for k in keys:
            refs[k] = refs.get(k, 0) + 1

    def release(self, keys: Sequence[int]) -> None:
        """The request that :meth:`hold` counted is over."""
        refs = self._refs
        for k in keys:
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, key: object) -> bool:
        return key in self._refs


@dataclass(slots=True)
class Load:
    """In-flight requests, queued prefill tokens and held prompt blocks on one worker.

    ``held_blocks`` counts the distinct prompt blocks of requests past their first
    token and not yet finished: their KV occupies the worker's HBM whatever its last
    heartbeat said.
    """

    in_flight: int = 0
    queued_tokens: int = 0
    held_blocks: int = 0
    #: The attention work of ``queued_tokens`` (a view's ``queued_prefill_context``).
    queued_context: int = 0
    #: The cached prefix blocks those queued requests take from HBM's free pool on
    #: admission (a view's ``queued_taken_blocks``).
    queued_taken: int = 0
    #: Of those, the blocks brought up from DRAM and from SSD (a view's
    #: ``queued_load_blocks``).
    queued_dram: int = 0
    queued_ssd: int = 0
    #: Requests past their first token and not finished: decoding (a view's ``running``).
    running: int = 0

    def add(self, other: Load) -> None:
        """Accumulate ``other`` into this load."""
        self.in_flight += other.in_flight
        self.queued_tokens += other.queued_tokens
        self.held_blocks += other.held_blocks
        self.queued_context += other.queued_context
        self.queued_taken += other.queued_taken
        self.queued_dram += other.queued_dram
        self.queued_ssd += other.queued_ssd
        self.running += other.running

    def sub(self, other: Load) -> None:
        """Take ``other`` (accumulated before) out of this load."""
        self.in_flight -= other.in_flight
        self.queued_tokens -= other.queued_tokens
        self.held_blocks -= other.held_blocks
        self.queued_context -= other.queued_context
        self.queued_taken -= other.queued_taken
        self.queued_dram -= other.queued_dram
        self.queued_ssd -= other.queued_ssd
        self.running -= other.running

    def empty(self) -> bool:
        """Nothing counted."""
        return not any(
            (self.in_flight, self.queued_tokens, self.held_blocks, self.queued_context,
             self.queued_taken, self.queued_dram, self.queued_ssd, self.running)
        )  # fmt: skip

    def pack(self) -> str:
        """The load-sharing wire form."""
        return (
            f"{self.in_flight},{self.queued_tokens},{self.held_blocks},{self.queued_context},"
            f"{self.queued_taken},{self.queued_dram},{self.queued_ssd},{self.running}"
        )

    @classmethod
    def unpack(cls, packed: bytes) -> Load:
        """Parse :meth:`pack`'s form (or an older replica's shorter one, from two fields).

        Raises:
            ValueError: Not two to eight integers.
        """
        fields = [int(x) for x in packed.split(b",")]
        if not 2 <= len(fields) <= 8:
            raise ValueError(f"load entry {packed!r}: expected 2 to 8 fields")
        return cls(*fields)


def queued_share(prefill_tokens: int, prompt_tokens: int, admission: Load | None = None) -> Load:
    """What a request routed to a worker adds to its queued figures until its first byte:
    the ``prefill_tokens`` it still computes of a ``prompt_tokens`` prompt, their attention
    work (:func:`policies.cost_model.prefill_context`; 0 when the length is not known) and
    its ``admission`` share (:func:`admission_load`)."""
    share = replace(admission) if admission is not None else Load()
    share.queued_tokens += prefill_tokens
    if prompt_tokens:
        share.queued_context += prefill_context(prompt_tokens, prefill_tokens)
    return share


def admission_load(scores: Mapping[str, float]) -> Load:
    """A request's admission share on one worker, from the policy's scores there: the
    cached blocks it takes from the free HBM pool (``taken_blocks``) and those it
    brings up from DRAM and SSD (``load_dram_blocks``, ``load_ssd_blocks``); zero where
    a policy does not score them."""
    return Load(
        queued_taken=int(scores.get("taken_blocks", 0)),
        queued_dram=int(scores.get("load_dram_blocks", 0)),
        queued_ssd=int(scores.get("load_ssd_blocks", 0)),
    )


@dataclass(slots=True)
class Ticket:
    """One routed request's share of a worker's load; released exactly once."""

    tracker: LoadTracker
    worker: str
    #: Its share until its first byte: prompt tokens to prefill, their attention work
    #: (``policies.cost_model.prefill_context``), the cached blocks its admission takes
    #: from HBM's free pool and those it loads from DRAM and SSD (the policy's figures).
    queued: Load
    #: The prompt's block keys (cached ones included): what the worker holds once prefilled.
    keys: Sequence[int] = ()
    prefilled: bool = False
    ended: bool = False

    def first_byte(self) -> None:
        """The worker produced the first token: its prefill is done, its prompt held."""
        if not self.prefilled and not self.ended:
            self.prefilled = True
            self.tracker._add(self.worker, 0, unqueue=self.queued, hold=self.keys, running=1)

    def end(self) -> None:
        """The request is over (any outcome)."""
        if self.ended:
            return
        self.ended = True
        if self.prefilled:
            self.tracker._add(self.worker, -1, release=self.keys, running=-1)
        else:
            self.tracker._add(self.worker, -1, unqueue=self.queued)


@dataclass(slots=True)
class LoadTracker:
    """This replica's counts plus the other replicas' (from their leases)."""

    client: RedisClient | None = None
    keyspace: Keyspace = field(default_factory=Keyspace)
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lease_s: float = 10.0
    sync_interval_s: float = 0.2
    local: dict[str, Load] = field(default_factory=dict)
    remote: dict[str, Load] = field(default_factory=dict)
    held: dict[str, HeldBlocks] = field(default_factory=dict)
    #: Per worker: (``ts`` of its latest heartbeat, the counts when it was taken).
    seen: dict[str, tuple[float, Load]] = field(default_factory=dict)
    #: How far back this replica's counts are kept to date heartbeats (seconds).
    history_s: float = 2.0
    #: Per worker, this replica's counts after each change: (monotonic time, counts).
    history: dict[str, deque[tuple[float, Load]]] = field(default_factory=dict)
    wall: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic
    healthy: bool = True
    _task: asyncio.Task[None] | None = None

    def begin(
        self, worker: str, prefill_tokens: int, keys: Sequence[int] = (), prompt_tokens: int = 0,
        admission: Load | None = None,
    ) -> Ticket:  # fmt: skip
        """Count a request routed to ``worker`` that will prefill ``prefill_tokens`` tokens.

        The prompt's block ``keys`` are held from its first byte to its end; with its
        length ``prompt_tokens`` the attention work of the prefill is counted too, and
        ``admission`` (the cached blocks its admission takes from the free pool and
        loads from DRAM and SSD: :func:`admission_load`) until its first byte.
        """
        queued = queued_share(prefill_tokens, prompt_tokens, admission)
        self._add(worker, 1, queue=queued)
        return Ticket(self, worker, queued, keys)

    def _add(
        self, worker: str, in_flight: int, queue: Load | None = None,
        unqueue: Load | None = None, hold: Sequence[int] = (), release: Sequence[int] = (),
        running: int = 0,
    ) -> None:  # fmt: skip
        load = self.local.setdefault(worker, Load())
        load.in_flight += in_flight
        load.running += running
        if queue is not None:
            load.add(queue)
        if unqueue is not None:
            load.sub(unqueue)
        if hold or release:
            held = self.held.setdefault(worker, HeldBlocks())
            held.hold(hold)
            held.release(release)
            load.held_blocks = len(held)
            if not held:
                del self.held[worker]
        now = self.mono()
        past = self.history.setdefault(worker, deque())
        past.append((now, replace(load)))
        # Keep the window, and the last change before it (the counts at its start).
        while len(past) > 1 and past[1][0] <= now - self.history_s:
            past.popleft()
        if load.empty():
            del self.local[worker]

    def load(self, worker: str) -> Load:
        """Total load on ``worker`` over all replicas (others as of the last sync)."""
        total = Load()
        for part in (self.local.get(worker), self.remote.get(worker)):
            if part is not None:
                total.add(part)
        return total

    def saw(self, worker: str, ts: float | None) -> None:
        """A heartbeat of ``worker`` taken at ``ts`` arrived (None: the worker left).

        The counts as they were when it was taken (this replica's from its recent
        history, by the heartbeat's age on the wall clock, at most ``history_s`` back;
        the other replicas' as of their last sync) are what it already reflects of
        this router's requests; :meth:`seen_at` hands them to the overlay
        (:func:`kvrouter.router_core.overlay`). A worker clock ahead of this one
        dates it now.
        """
        if ts is None:
            self.seen.pop(worker, None)
            self.history.pop(worker, None)
        elif worker not in self.seen or self.seen[worker][0] != ts:
            age = min(max(self.wall() - ts, 0.0), self.history_s)
            self.seen[worker] = (ts, self._at(worker, self.mono() - age))

    def _at(self, worker: str, when: float) -> Load:
        """The counts on ``worker`` at monotonic time ``when``: this replica's then, the
        other replicas' as of their last sync."""
        past = self.history.get(worker)
        # The last change at or before ``when``. The window keeps the last change before
        # its start, so when every kept change is later the worker had none before:
        # nothing was counted then.
        then: Load | None = self.local.get(worker) if not past else None
        for t, counts in reversed(past or ()):
            if t <= when:
                then = counts
                break
        total = Load()
        for part in (then, self.remote.get(worker)):
            if part is not None:
                total.add(part)
        return total

    def seen_at(self, view: WorkerView) -> Load | None:
        """The counts when ``view`` was taken (None: another heartbeat, or none noted)."""
        seen = self.seen.get(view.host)
        return seen[1] if seen is not None and seen[0] == view.ts else None

    def workers(self) -> Iterable[str]:
        """Workers with any load counted."""
        return set(self.local) | set(self.remote)

    # -- sharing through Redis ------------------------------------------------------------------

    def start(self) -> None:
        """Start syncing with the other replicas (no-op without Redis)."""
        if self.client is not None:
            self._task = asyncio.create_task(self._run(), name="load-sync")

    async def stop(self) -> None:
        """Stop syncing and drop this replica's lease at once."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self.client is not None:
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.delete(self._own_key())
                    pipe.zrem(self.keyspace.load("replicas"), self.replica_id)
                    await pipe.execute()
            except (RedisError, OSError):
                pass

    def _own_key(self) -> str:
        return self.keyspace.load(f"r:{self.replica_id}")

    async def _run(self) -> None:
        while True:
            try:
                await self.sync()
                if not self.healthy:
                    log.info("load sharing reaches Redis again")
                self.healthy = True
            except (RedisError, OSError) as exc:
                if self.healthy:
                    log.warning("load sharing: Redis unreachable (%s); using local counts", exc)
                self.healthy = False
                self.remote = {}
            await asyncio.sleep(self.sync_interval_s)

    async def sync(self) -> None:
        """Publish this replica's counts (renewing its lease) and read the others'."""
        assert self.client is not None
        now_ms = int(time.time() * 1000)
        lease_ms = int(self.lease_s * 1000)
        replicas = self.keyspace.load("replicas")
        own = self._own_key()
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(own)
            if self.local:
                pipe.hset(
                    own,
                    mapping={w: v.pack() for w, v in self.local.items()},
                )
                pipe.pexpire(own, lease_ms)
            pipe.zadd(replicas, {self.replica_id: now_ms + lease_ms})
            pipe.zremrangebyscore(replicas, "-inf", now_ms)
            pipe.zrange(replicas, 0, -1)
            results = await pipe.execute()
        others = [r.decode() for r in results[-1] if r.decode() != self.replica_id]
        remote: dict[str, Load] = {}
        if others:
            async with self.client.pipeline(transaction=False) as pipe:
                for r in others:
                    pipe.hgetall(self.keyspace.load(f"r:{r}"))
                for r, counts in zip(others, await pipe.execute(), strict=True):
                    for w, packed in counts.items():
                        try:
                            part = Load.unpack(packed)
                        except ValueError as exc:
                            log.warning("load sharing: replica %s: %s", r, exc)
                            continue
                        remote.setdefault(w.decode(), Load()).add(part)
        self.remote = remote
