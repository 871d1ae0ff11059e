"""A gateway replica's copy of the Redis index, kept current from the workers' streams.

Redis stays the shared truth (the ingester writes it); each gateway replica
keeps a :class:`~indexer.index.bitmap.BitmapIndex` that answers ``match``
in this process, in microseconds instead of a Lua call of ~5 us per key.
The mirror follows the same streams ``{p}:ev:{host}`` the ingester reads,
and applies them with the same cursor rules, so it makes the same changes
in the same order::

    every refresh_interval_s   registry + heartbeats: new hosts are bootstrapped,
                               hosts dead for dead_grace_s dropped; the index's
                               incarnation (reset: everything bootstrapped again)
                               and cursors (drift: see below)
    bootstrap of a host        HGET {p}:idx:pos host -> P, then the host's cursor
                               and blocks in one consistent read
                               (RedisIndex.read_host); tail the stream after P
    each round                 XREAD every followed stream after its position;
                               batches by the cursor rules, snapshots replace

Why a bootstrap is exact: the ingester persists P only after applying every
entry up to P, so the state read after P covers them; the entries after P
are either in that state already (duplicates by the cursor rules) or next.
The streams cannot be replayed from their start (the ingester trims them
up to its positions, ``XTRIM MINID ~``), which is why the state comes from
the index and not from the stream.

What can go wrong, and what the mirror does:

* *gap* (a batch not next, a new epoch): entries between P and a later
  position were trimmed before the mirror read them, or the ingester holds
  batches for a snapshot the mirror cannot see. The host is bootstrapped
  again from Redis (at most every ``resync_interval_s``); it never asks a
  worker for a snapshot (the ingester does).
* *drift*: the index's cursor for a host held still for a refresh while
  the mirror's differs and is not simply ahead in the same epoch (the
  ingester lags behind the mirror, that is fine, and so is an index with no
  cursor for the host yet): bootstrapped again. This catches what no gap
  shows (a restart whose first batches were trimmed).
* *reset*: Redis lost the index (its incarnation changed): every host is
  bootstrapped again.
* *Redis away*: from the first failed round (or after ``max_stale_s``
  without a good one, should a round hang) lookups go to the Redis index,
  which fails, so the router routes by load and says so, as before there
  was a mirror; the next good round serves from the mirror again.

Until the first bootstrap of every live host is done, lookups go to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from indexer.events import EventBatch, EventDecodeError, Snapshot, decode_message
from indexer.index.base import (
    ApplyResult,
    ApplyStatus,
    Cursor,
    IndexStats,
    KVIndexError,
    check_keys,
)
from indexer.index.bitmap import BitmapIndex
from indexer.index.redis_index import RedisIndex
from indexer.ingest_host import START_ID
from indexer.ingest_reader import Client, StreamReader
from indexer.media import Medium
from indexer.metrics import MirrorMetrics
from indexer.tasks import cancel_and_wait
from indexer.views import PrefixMatch
from indexer.wire import EVENT_FIELD, Keyspace

__all__ = ["IndexMirror", "MirrorConfig"]

log = logging.getLogger(__name__)

_RETRYABLE = (RedisError, OSError, KVIndexError)


@dataclass(frozen=True, slots=True)
class MirrorConfig:
    """How a mirror follows the streams.

    Attributes:
        read_count: Entries per stream per XREAD.
        block_ms: How long a read waits for new entries.
        refresh_interval_s: How often registry, heartbeats, incarnation and cursors
            are read.
        dead_grace_s: A host without heartbeat that sent nothing this long is dropped
            (the ingester purges it from the index on the same rule).
        resync_interval_s: Shortest time between two bootstraps of one host.
        max_stale_s: Without a good round for this long, lookups go to Redis.
        backoff_max_s: Longest wait between retries while Redis fails.
    """

    read_count: int = 1024
    block_ms: int = 100
    refresh_interval_s: float = 0.5
    dead_grace_s: float = 2.5
    resync_interval_s: float = 0.5
    max_stale_s: float = 5.0
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("read_count", "block_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("refresh_interval_s", "dead_grace_s", "resync_interval_s", "max_stale_s",
                     "backoff_max_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass(slots=True)
class _Tail:
    """One followed host: its stream position and whether it must be (re)bootstrapped."""

    host: str
    stream: str
    last_id: bytes = START_ID
    seen_at: float = 0.0
    boot_at: float | None = 0.0  # None: tailing
    reason: str = "new"
    booted_at: float = float("-inf")
    suspect: Cursor | bool | None = False  # the index cursor seen differing last refresh


def _ahead(mine: Cursor | None, theirs: Cursor | None) -> bool:
    """Whether the mirror's cursor is the index's or later in the same epoch.

    An index without a cursor for the host is behind whatever the mirror read:
    the ingester has not applied the host yet (it takes a host's lease a few
    seconds after the host registers, while the mirror follows its stream at
    once), or it purged the host and its next batch, a gap, asks for the
    snapshot that the mirror applies from the same stream.
    """
    if theirs is None:
        return True
    if mine is None:
        return False
    return mine[0] == theirs[0] and mine[1] >= theirs[1]


class IndexMirror:
    """A :class:`~indexer.index.base.KVIndex` answering lookups from this process.

    ``apply`` / ``replace`` / ``purge`` change only this replica's table (tests
    use them); the shared index is written by the ingester alone.

    Args:
        index: The shared Redis index (bootstrap reads, the lookup fallback).
        client: Redis client for streams, registry and heartbeats (bytes responses).
        keyspace: Key prefix shared with workers and the ingester.
        config: Timings.
        metrics: Where to count (nothing if None).
        clock: Wall clock in seconds (batch timestamps use it).
    """

    def __init__(
        self,
        index: RedisIndex,
        client: Client,
        *,
        keyspace: Keyspace | None = None,
        config: MirrorConfig | None = None,
        metrics: MirrorMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.client = client
        self.keyspace = keyspace or Keyspace()
        self.config = config or MirrorConfig()
        self.metrics = metrics
        self.clock = clock
        self.table = BitmapIndex()
        self._reader = StreamReader(client, count=self.config.read_count,
                                    block_ms=self.config.block_ms)  # fmt: skip
        self._tails: dict[str, _Tail] = {}
        self._by_stream: dict[bytes, _Tail] = {}
        self._incarnation: bytes | None = None
        self._refresh_at = 0.0
        self._good_at = float("-inf")
        self._booted = False
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Follow the streams in a background task (returns at once)."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.create_task(self._run(), name="index-mirror")

    async def stop(self) -> None:
        """Stop following (the table keeps what it holds)."""
        if self._task is not None:
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.config.block_ms / 1000 + 5)
            except TimeoutError:
                await cancel_and_wait([self._task])
            self._task = None

    async def close(self) -> None:
        """Stop, and close the Redis index (the client belongs to the caller)."""
        await self.stop()
        await self.index.close()

    @property
    def serving(self) -> bool:
        """Whether lookups are answered from the mirror (bootstrapped and not stale)."""
        return self._booted and self.clock() - self._good_at <= self.config.max_stale_s

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                await self.step()
                backoff = 0.05
                continue
            except _RETRYABLE as exc:
                log.warning("index mirror: Redis failed (%s); retrying", exc)
            except Exception:
                log.exception("index mirror: unexpected error; retrying")
            # Redis failing is the index being away: the router says so and routes by
            # load (through the fallback lookup), as without a mirror.
            self._good_at = float("-inf")
            if self.metrics is not None:
                self.metrics.errors.inc()
                self.metrics.ready.set(0)
            self._refresh_at = 0.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), backoff)
            backoff = min(backoff * 2, self.config.backoff_max_s)

    # -- one round ----------------------------------------------------------

    async def step(self) -> None:
        """One round: refresh if due, bootstraps that are due, one read of the streams."""
        now = self.clock()
        if now >= self._refresh_at:
            await self._refresh(now)
            self._refresh_at = now + self.config.refresh_interval_s
        for tail in list(self._tails.values()):
            if tail.boot_at is not None and tail.boot_at <= now:
                await self._bootstrap(tail)
        if not self._booted and all(t.reason != "new" for t in self._tails.values()):
            self._booted = True
            log.info("index mirror: bootstrapped %d hosts; serving lookups", len(self._tails))
        positions = {t.stream: t.last_id for t in self._tails.values() if t.boot_at is None}
        entries = await self._reader.read(positions, self._stop)
        for name, items in entries.items():
            followed = self._by_stream.get(name)
            if followed is None or followed.boot_at is not None:
                continue
            for entry_id, fields in items:
                gap = self._consume(followed, fields.get(EVENT_FIELD))
                followed.last_id = entry_id
                followed.seen_at = self.clock()
                if gap:
                    break  # the rest is read again after the bootstrap
        self._good_at = self.clock()
        if self.metrics is not None:
            self.metrics.entries.set(self.table.stats_sync().total)
            self.metrics.hosts.set(len(self._tails))
            self.metrics.ready.set(1 if self.serving else 0)

    def _consume(self, tail: _Tail, payload: bytes | None) -> bool:
        """Apply one stream message as the ingester does; True on a gap (a bootstrap
        of the host is scheduled)."""
        gap = False
        try:
            if payload is None:
                raise EventDecodeError("no event field")
            message = decode_message(payload)
            if message.host != tail.host:
                raise EventDecodeError(f"message of host {message.host!r} in {tail.stream}")
            if isinstance(message, EventBatch):
                status = self.table.apply_sync(message).status
                result = status.value
                if status is ApplyStatus.APPLIED and self.metrics is not None:
                    self.metrics.lag.observe(max(0.0, self.clock() - message.ts))
                elif status is ApplyStatus.GAP:
                    self._schedule(tail, "gap")
                    gap = True
            else:
                result = "snapshot" if self.table.replace_sync(message) else "stale"
        except (EventDecodeError, ValueError, TypeError) as exc:
            result = "invalid"
            log.debug("host %s: skipped an invalid stream entry: %s", tail.host, exc)
        if self.metrics is not None:
            self.metrics.batches.labels(result=result).inc()
        return gap

    def _schedule(self, tail: _Tail, reason: str) -> None:
        tail.boot_at = max(self.clock(), tail.booted_at + self.config.resync_interval_s)
        if tail.reason != "new":
            tail.reason = reason

    async def _bootstrap(self, tail: _Tail) -> None:
        """Read the host from the Redis index, then tail its stream after the ingester's
        persisted position (read first: the state read after it covers it)."""
        raw = await self.client.hget(self.keyspace.index("pos"), tail.host)
        cursor, blocks = await self.index.read_host(tail.host)
        self.table.load(tail.host, blocks, cursor)
        tail.last_id = START_ID if raw is None else raw if isinstance(raw, bytes) else raw.encode()
        tail.boot_at, tail.booted_at, tail.suspect = None, self.clock(), False
        if self.metrics is not None:
            self.metrics.resyncs.labels(reason=tail.reason).inc()
        if tail.reason != "new":
            log.info("index mirror: host %s read again from Redis (%s)", tail.host, tail.reason)
        tail.reason = "read"

    async def _refresh(self, now: float) -> None:
        ks = self.keyspace
        names = sorted(
            n.decode() if isinstance(n, bytes) else str(n)
            for n in await self.client.hkeys(ks.hosts)
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.get(ks.index("layout"))
        for name in names:
            pipe.exists(ks.heartbeat(name))
        incarnation, *alive = await pipe.execute()
        if self._incarnation is not None and incarnation != self._incarnation:
            log.warning("index mirror: the Redis index was reset; reading every host again")
            for tail in self._tails.values():
                self.table.load(tail.host, {}, None)
                tail.boot_at, tail.reason = now, "reset" if tail.reason != "new" else "new"
        self._incarnation = incarnation
        live = {n for n, ok in zip(names, alive, strict=True) if ok}
        for name in sorted(live - self._tails.keys()):
            tail = _Tail(name, ks.events(name), seen_at=now)
            self._tails[name] = tail
            self._by_stream[tail.stream.encode()] = tail
        for name in sorted(self._tails.keys() - live):
            tail = self._tails[name]
            if now - tail.seen_at >= self.config.dead_grace_s:
                self.table.purge_sync(name)
                del self._tails[name]
                self._by_stream.pop(tail.stream.encode(), None)
                if self.metrics is not None:
                    self.metrics.purges.inc()
                log.info("index mirror: host %s dead (no heartbeat); dropped", name)
        await self._check_drift()

    async def _check_drift(self) -> None:
        """Bootstrap hosts whose index cursor held still while the mirror's differs."""
        theirs = await self.index.cursors()
        for tail in self._tails.values():
            if tail.boot_at is not None:
                continue
            index_cursor = theirs.get(tail.host)
            if _ahead(self.table.cursor_sync(tail.host), index_cursor):
                tail.suspect = False
            elif tail.suspect == index_cursor:
                log.info("index mirror: host %s at %s in the mirror, %s in Redis twice in a row",
                         tail.host, self.table.cursor_sync(tail.host), index_cursor)  # fmt: skip
                self._schedule(tail, "drift")
            else:
                tail.suspect = index_cursor

    # -- KVIndex ------------------------------------------------------------

    async def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """From the mirror while it serves (see :attr:`serving`), else from Redis.

        Raises:
            InvalidKeyError: a key is not a u64.
            IndexUnavailableError: the fallback lookup in Redis failed.
        """
        if not self.serving:
            if self.metrics is not None:
                self.metrics.lookups.labels(source="redis").inc()
            return await self.index.match(keys)
        check_keys(keys)
        if self.metrics is not None:
            self.metrics.lookups.labels(source="mirror").inc()
        return self.table.match_sync(keys)

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply to this replica's table only (see the class docstring)."""
        return self.table.apply_sync(batch)

    async def replace(self, snapshot: Snapshot) -> bool:
        """Replace in this replica's table only."""
        return self.table.replace_sync(snapshot)

    async def purge(self, host: str) -> int:
        """Purge from this replica's table only."""
        return self.table.purge_sync(host)

    async def cursor(self, host: str) -> Cursor | None:
        """The host's cursor in the mirror."""
        return self.table.cursor_sync(host)

    async def hosts(self) -> list[str]:
        """Hosts with a cursor in the mirror, sorted."""
        return self.table.hosts_sync()

    async def entries(self, host: str) -> dict[Medium, set[int]]:
        """The host's blocks in the mirror (what the audit compares)."""
        return self.table.entries_sync(host)

    async def stats(self) -> IndexStats:
        """The mirror's entries and hosts."""
        return self.table.stats_sync()
