"""The ingester: workers' event streams in, the global index kept current.

One loop per replica (embeddable: ``await ingester.start()`` / ``stop()``;
the ``kvrouter indexer`` service wraps it)::

    every refresh_interval_s  HKEYS {p}:hosts (the registry; never a scan) and
                              check that Redis kept its data (a marker key)
    every lease_ttl_s / 3     renew, release, take host leases (ingest_lease)
    every dead_check_s        hosts whose heartbeat expired are purged; live
                              ones whose heartbeat is ahead of their stream
                              are asked for a snapshot
    each round                XREAD the owned hosts' streams from their
                              positions, decode, apply in per-host order,
                              then persist the positions ({p}:idx:pos)

Ordering and recovery (DESIGN.md, "Events"; the cursor rules live in the
index, :mod:`indexer.index.base`):

* a duplicate (at-least-once delivery, a re-read after a restart or a lease
  handover) changes nothing;
* a gap (missing seq, new epoch, no cursor) writes ``op=snapshot`` to the
  host's control stream (rate-limited while pending, asked again after
  ``snapshot_timeout_s``) and holds the host's later batches (bounded);
  the snapshot replaces the host's entries, then held batches newer than
  it apply;
* a batch lost at the end of a burst leaves no gap to see until the next
  batch: a live host whose heartbeat names a newer batch (``events_seq``)
  than its stream delivered, for ``tail_grace_s``, is asked for a snapshot
  (pending, asked again until answered); and a host quiet for
  ``quiet_snapshot_s`` after batches is asked once, holding nothing;
* positions are written after the apply, so a restarted ingester re-reads
  at most one round (duplicates); a stream trimmed past a position shows
  up as a seq gap, which asks for a snapshot;
* once a position is written, what the stream holds before it has been
  applied and is trimmed (``XTRIM MINID ~``, ``trim_consumed``): streams stay
  as long as the ingester's lag, not as long as their length cap, so Redis
  memory does not grow with the traffic served;
* a lost Redis (restart without persistence) resets the index's cursors:
  every host's next batch is a gap, and snapshots rebuild the index; the
  ingester notices the loss (marker key gone, leases gone) and reads the
  new streams from their start;
* Redis errors never stop the loop: it retries with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from indexer.events import EventBatch, EventDecodeError, Snapshot, decode_message
from indexer.index.base import ApplyStatus, KVIndex, KVIndexError
from indexer.ingest_host import START_ID, HostState
from indexer.ingest_lease import HostLeases, LeaseChanges
from indexer.ingest_metrics import IngestMetrics
from indexer.ingest_reader import Client, Entries, StreamReader, open_client
from indexer.tasks import cancel_and_wait
from indexer.wire import CONTROL_FIELD, EVENT_FIELD, OP_SNAPSHOT, Keyspace, decode_view

__all__ = ["IngestConfig", "Ingester", "default_replica_id"]

log = logging.getLogger(__name__)

_RETRYABLE = (RedisError, OSError, KVIndexError)


def _key(raw: bytes | str) -> bytes:
    return raw.encode() if isinstance(raw, str) else raw


def default_replica_id() -> str:
    """``hostname-pid-random``: unique per process, readable in the lease keys."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class IngestConfig:
    """How an ingester replica behaves.

    Attributes:
        replica_id: This replica's name in lease keys (unique per replica).
        read_count: Entries per stream per XREAD.
        block_ms: How long a read waits for new entries.
        refresh_interval_s: How often the host registry is re-read.
        lease_ttl_s: Host lease lifetime (renewed every third of it).
        dead_check_interval_s: How often heartbeats are checked (about half
            the workers' heartbeat TTL); a host whose heartbeat is gone and
            that sent nothing for this long is purged.
        snapshot_timeout_s: A snapshot request unanswered this long is repeated.
        quiet_snapshot_s: A host quiet this long after its last batch is asked for
            one snapshot, without holding anything meanwhile: a batch lost at the
            end of a burst (a dropped batch, a Redis failover losing the newest
            entries) leaves no seq gap to see until the host's next batch. Costs
            one snapshot per host per quiet period; 0 turns it off.
        tail_grace_s: A live host whose heartbeat names a newer batch than its
            stream delivered, for this long, lost its newest batches: it is asked
            for a snapshot (and held pending, asked again until answered). Unlike
            the quiet check this sees a tail lost at any time; 0 turns it off.
        hold_limit: Batches held per host while it waits for a snapshot.
        control_maxlen: Approximate length cap of a control stream.
        trim_consumed: Trim each event stream up to its persisted position.
        backoff_max_s: Longest wait between retries while Redis fails.
    """

    replica_id: str = field(default_factory=default_replica_id)
    read_count: int = 256
    block_ms: int = 200
    refresh_interval_s: float = 1.0
    lease_ttl_s: float = 10.0
    dead_check_interval_s: float = 2.5
    snapshot_timeout_s: float = 5.0
    quiet_snapshot_s: float = 10.0
    tail_grace_s: float = 2.0
    hold_limit: int = 10_000
    control_maxlen: int = 100
    trim_consumed: bool = True
    backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        for name in ("read_count", "block_ms", "hold_limit", "control_maxlen"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("refresh_interval_s", "lease_ttl_s", "dead_check_interval_s",
                     "snapshot_timeout_s", "backoff_max_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("quiet_snapshot_s", "tail_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be positive or 0 (off)")


class Ingester:
    """Consumes the event streams of the hosts this replica leases into ``index``.

    Args:
        redis: A ``redis.asyncio`` client or cluster client (bytes responses) or
            a URL (connected on start, retried while unreachable, closed on stop).
        index: The index to keep current (Redis or in-memory).
        keyspace: Key prefix shared with workers and routers.
        config: Timings and limits.
        metrics: Where to count (a fresh registry's if None).
        clock: Wall clock in seconds (batch timestamps and lease expiry use it).

    Raises:
        ValueError: the client decodes responses to str.
    """

    def __init__(
        self,
        redis: Client | str,
        index: KVIndex,
        *,
        keyspace: Keyspace | None = None,
        config: IngestConfig | None = None,
        metrics: IngestMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(redis, str) and redis.get_encoder().decode_responses:
            raise ValueError("the ingester needs a client with decode_responses=False")
        self.index = index
        self.keyspace = keyspace or Keyspace()
        self.config = config or IngestConfig()
        self.metrics = metrics or IngestMetrics(CollectorRegistry())
        self.clock = clock
        self._url = redis if isinstance(redis, str) else None
        self._client: Client | None = None if isinstance(redis, str) else redis
        self._reader: StreamReader | None = None
        self._leases: HostLeases | None = None
        self._hosts: dict[str, HostState] = {}
        self._by_stream: dict[bytes, HostState] = {}
        self._registered: list[str] = []
        self._marker: str | None = None
        self._due = {"refresh": 0.0, "lease": 0.0, "dead": 0.0}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pos_key = self.keyspace.index("pos")
        self._marker_key = self.keyspace.index("ingest")
        self.healthy = False

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start consuming in a background task (returns at once; Redis may still be away)."""
        if self._task is not None:
            return
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name=f"ingester-{self.config.replica_id}")

    async def stop(self) -> None:
        """Finish the current round, persist positions, release leases, close an owned client."""
        if self._task is not None:
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.config.block_ms / 1000 + 10)
            except TimeoutError:
                await cancel_and_wait([self._task])
            self._task = None
        if self._client is not None:
            try:
                await self._persist()
                if self._leases is not None:
                    await self._leases.leave()
            except _RETRYABLE as exc:
                log.warning(
                    "ingester %s stopped without releasing: %s", self.config.replica_id, exc
                )
            if self._url is not None:
                await self._client.aclose()
                self._client = self._reader = self._leases = None
        self._hosts.clear()
        self._by_stream.clear()
        self._due = dict.fromkeys(self._due, 0.0)
        self.healthy = False

    @property
    def owned(self) -> list[str]:
        """Hosts this replica consumes now, sorted."""
        return sorted(self._hosts)

    def status(self) -> dict[str, Any]:
        """A summary for operators (the service's ``/status``)."""
        return {
            "replica": self.config.replica_id,
            "healthy": self.healthy,
            "registered": len(self._registered),
            "owned": self.owned,
            "pending": sorted(h for h, st in self._hosts.items() if st.pending),
        }

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                await self.step()
                self.healthy = True
                backoff = 0.05
                continue
            except _RETRYABLE as exc:
                if self.healthy:
                    log.warning("ingester %s: Redis failed (%s); retrying", self.config.replica_id,
                                exc)  # fmt: skip
                self.metrics.redis_errors.labels(op="round").inc()
            except Exception:
                log.exception("ingester %s: unexpected error; retrying", self.config.replica_id)
            self.healthy = False
            self._due = dict.fromkeys(self._due, 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    # -- one round ------------------------------------------------------------------------

    async def step(self) -> None:
        """One round: the periodic work that is due, then one read of the owned streams."""
        client = await self._connected()
        now = self.clock()
        if now >= self._due["refresh"]:
            await self._refresh(client)
            self._due["refresh"] = now + self.config.refresh_interval_s
        if now >= self._due["lease"]:
            await self._balance(now)
            self._due["lease"] = now + self.config.lease_ttl_s / 3
        if now >= self._due["dead"]:
            await self._check_heartbeats(client, now)
            self._due["dead"] = now + self.config.dead_check_interval_s
        for st in list(self._hosts.values()):
            if st.ask_due(now, self.config.snapshot_timeout_s):
                await self._ask(st, "retry")
            elif st.quiet_check_due(now, self.config.quiet_snapshot_s):
                await self._ask(st, "quiet")
        self.metrics.hosts_owned.set(len(self._hosts))
        self.metrics.hosts_pending.set(sum(st.pending for st in self._hosts.values()))
        assert self._reader is not None
        positions = {st.stream: st.last_id for st in self._hosts.values()}
        entries = await self._reader.read(positions, self._stop)
        try:
            await self._consume(entries)
        finally:
            await self._persist()

    async def _connected(self) -> Client:
        if self._client is None:
            assert self._url is not None
            self._client = await open_client(self._url)
        if self._reader is None or self._leases is None:
            cfg = self.config
            self._reader = StreamReader(self._client, count=cfg.read_count, block_ms=cfg.block_ms)
            self._leases = HostLeases(self._client, self.keyspace, cfg.replica_id, cfg.lease_ttl_s)
        return self._client

    async def _refresh(self, client: Client) -> None:
        """Re-read the registry; if Redis lost its data, read every stream from its start."""
        names = await client.hkeys(self.keyspace.hosts)
        self._registered = sorted(n.decode() if isinstance(n, bytes) else n for n in names)
        token = secrets.token_hex(8)
        await client.set(self._marker_key, token, nx=True)
        raw = await client.get(self._marker_key)
        found = raw.decode() if isinstance(raw, bytes) else str(raw)
        if self._marker is not None and found != self._marker:
            log.warning("ingester %s: Redis lost its data; re-reading every stream",
                        self.config.replica_id)  # fmt: skip
            await self._load_positions(list(self._hosts.values()), forget=True)
        self._marker = found

    async def _balance(self, now: float) -> None:
        assert self._leases is not None
        await self._persist()
        changes: LeaseChanges = await self._leases.balance(self._registered, int(now * 1000))
        for host in [*changes.lost, *changes.released]:
            st = self._hosts.pop(host, None)
            if st is not None:
                self._by_stream.pop(st.stream.encode(), None)
        fresh = []
        for host in changes.acquired:
            st = HostState(host, self.keyspace.events(host), seen_at=now)
            self._hosts[host] = st
            self._by_stream[st.stream.encode()] = st
            fresh.append(st)
        await self._load_positions(fresh, forget=False)
        for change in ("acquired", "released", "lost"):
            self.metrics.leases.labels(change=change).inc(len(getattr(changes, change)))
        if changes.acquired or changes.lost or changes.released:
            log.info("ingester %s: %d replicas; +%d -%d hosts (lost %d), owns %d",
                     self.config.replica_id, changes.replicas, len(changes.acquired),
                     len(changes.released), len(changes.lost), len(self._hosts))  # fmt: skip

    async def _load_positions(self, states: list[HostState], *, forget: bool) -> None:
        if not states:
            return
        assert self._client is not None
        raw = await self._client.hmget(self._pos_key, [st.host for st in states])
        for st, pos in zip(states, raw, strict=True):
            st.last_id = START_ID if pos is None else _key(pos)
            st.dirty = False
            if forget:
                st.forget_pending()

    async def _persist(self) -> None:
        dirty = {st.host: st.last_id for st in self._hosts.values() if st.dirty}
        if not dirty or self._client is None:
            return
        await self._client.hset(self._pos_key, mapping=dirty)  # type: ignore[arg-type]
        for host in dirty:
            self._hosts[host].dirty = False
        if self.config.trim_consumed:
            # Only after the positions are durable: a restart or a lease handover reads
            # from them, and everything before them is applied already.
            pipe = self._client.pipeline(transaction=False)
            for host, pos in dirty.items():
                pipe.xtrim(self._hosts[host].stream, minid=pos, approximate=True)
            await pipe.execute()

    async def _check_heartbeats(self, client: Client, now: float) -> None:
        """Purge hosts whose heartbeat expired; ask live ones whose stream lost its tail."""
        states = [st for st in self._hosts.values() if not st.purged]
        if not states:
            return
        pipe = client.pipeline(transaction=False)
        for st in states:
            pipe.get(self.keyspace.heartbeat(st.host))
        beats = await pipe.execute()
        for st, beat in zip(states, beats, strict=True):
            if beat is not None:
                await self._check_tail(st, beat, now)
                continue
            if now - st.seen_at < self.config.dead_check_interval_s:
                continue
            st.forget_pending()
            st.purged = True
            if await self.index.cursor(st.host) is None:
                continue
            removed = await self.index.purge(st.host)
            self.metrics.dead_hosts.inc()
            self.metrics.purged_entries.inc(removed)
            log.info("host %s: heartbeat expired; purged %d entries", st.host, removed)

    async def _check_tail(self, st: HostState, beat: bytes, now: float) -> None:
        """Ask for a snapshot when the heartbeat names batches the stream never delivered."""
        if self.config.tail_grace_s <= 0:
            return
        try:
            view = decode_view(beat)
        except ValueError:
            return  # not a worker view (a foreign heartbeat): nothing to compare
        if view.events_seq <= 0:
            return
        if st.heard is None:
            # Taken over and nothing read yet: the index's cursor is where the stream stood.
            cursor = await self.index.cursor(st.host)
            if cursor is None:
                return
            st.hear(*cursor)
        if st.tail_lost(view.epoch, view.events_seq, now, self.config.tail_grace_s):
            assert st.heard is not None
            log.info("host %s: heartbeat at batch %s:%s, stream at %s; asking for a snapshot",
                     st.host, view.epoch, view.events_seq, st.heard[1])  # fmt: skip
            await self._ask(st, "tail")

    # -- applying -------------------------------------------------------------------------

    async def _consume(self, entries: Entries) -> None:
        work = [
            self._consume_host(self._by_stream[name], items)
            for name, items in entries.items()
            if name in self._by_stream
        ]
        results = await asyncio.gather(*work, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _consume_host(
        self, st: HostState, items: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> None:
        for entry_id, fields in items:
            await self._handle(st, fields.get(EVENT_FIELD))
            st.consumed(_key(entry_id), self.clock())

    async def _handle(self, st: HostState, payload: bytes | None) -> None:
        try:
            if payload is None:
                raise EventDecodeError(f"an entry of {st.stream} has no {EVENT_FIELD!r} field")
            message = decode_message(payload)
            if message.host != st.host:
                raise EventDecodeError(f"message of host {message.host!r} in {st.stream}")
            if isinstance(message, Snapshot):
                await self._on_snapshot(st, message)
            else:
                await self._on_batch(st, message)
        except (EventDecodeError, ValueError, TypeError) as exc:
            self.metrics.decode_errors.inc()
            log.warning("host %s: skipped an invalid stream entry: %s", st.host, exc)

    async def _on_batch(self, st: HostState, batch: EventBatch) -> None:
        st.unchecked = True
        st.hear(batch.epoch, batch.seq)
        if st.pending:
            self.metrics.held_dropped.inc(st.hold(batch, self.config.hold_limit))
            self.metrics.batches.labels(result="held").inc()
            return
        result = await self.index.apply(batch)
        self.metrics.batches.labels(result=result.status.value).inc()
        if result.status is ApplyStatus.APPLIED:
            self.metrics.events.inc(len(batch.events))
            self.metrics.blocks.inc(result.blocks)
            self.metrics.apply_lag.observe(max(0.0, self.clock() - batch.ts))
        elif result.status is ApplyStatus.GAP:
            log.info("host %s: gap at %s:%s (cursor %s); asking for a snapshot",
                     st.host, batch.epoch, batch.seq, result.cursor)  # fmt: skip
            self.metrics.held_dropped.inc(st.hold(batch, self.config.hold_limit))
            await self._ask(st, "gap")

    async def _on_snapshot(self, st: HostState, snapshot: Snapshot) -> None:
        done = await self.index.replace(snapshot)
        self.metrics.snapshots.labels(result="applied" if done else "stale").inc()
        if not done:
            return
        st.hear(snapshot.epoch, snapshot.seq)
        for batch in st.answered(snapshot):
            await self._on_batch(st, batch)

    async def _ask(self, st: HostState, reason: str) -> None:
        """Write a snapshot request to the host's control stream.

        ``gap`` and ``retry`` make (keep) the host pending: its later batches are
        held until the snapshot. ``quiet`` only asks: batches keep applying, and
        the snapshot, which follows them in the stream, replaces the host if the
        index missed anything (or changes nothing).
        """
        assert self._client is not None
        await self._client.xadd(
            self.keyspace.control(st.host),
            {CONTROL_FIELD: OP_SNAPSHOT},
            maxlen=self.config.control_maxlen,
            approximate=True,
        )
        st.unchecked = False
        if reason != "quiet":
            st.ask(self.clock())
        self.metrics.snapshot_requests.labels(reason=reason).inc()
        if reason == "retry":
            log.info("host %s: snapshot request unanswered; asking again", st.host)
