"""Load accounting shared by gateway replicas: in-flight requests and queued prefill tokens.

Each replica counts what *it* routed, per worker: requests in flight, and
prompt tokens not yet prefilled (dispatched, no first byte yet). Those
counts are exact and immediate, unlike a worker's heartbeat, which lags by
up to one interval. Replicas share them through Redis *leases*::

    {p}:load:replicas            zset   replica -> lease expiry (ms)
    {p}:load:r:{replica}         hash   worker  -> "in_flight,queued_tokens"  (PEXPIRE lease)

Every ``sync_interval_s`` a replica writes its absolute counts (never
increments) and renews its lease, then reads the other live replicas'.
A crashed replica's counts vanish when its lease expires, so nothing it
held leaks; a request that ends in any way (success, error, client gone)
releases its counts through :class:`Ticket`, exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from indexer.ingest_reader import Client as RedisClient
from indexer.tasks import cancel_and_wait
from indexer.wire import Keyspace

__all__ = ["Load", "LoadTracker", "Ticket"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Load:
    """In-flight requests and queued prefill tokens on one worker."""

    in_flight: int = 0
    queued_tokens: int = 0

    def add(self, other: Load) -> None:
        """Accumulate ``other`` into this load."""
        self.in_flight += other.in_flight
        self.queued_tokens += other.queued_tokens


@dataclass(slots=True)
class Ticket:
    """One routed request's share of a worker's load; released exactly once."""

    tracker: LoadTracker
    worker: str
    prefill_tokens: int
    prefilled: bool = False
    ended: bool = False

    def first_byte(self) -> None:
        """The worker produced the first token: its prefill is no longer queued."""
        if not self.prefilled and not self.ended:
            self.prefilled = True
            self.tracker._add(self.worker, 0, -self.prefill_tokens)

    def end(self) -> None:
        """The request is over (any outcome)."""
        if self.ended:
            return
        self.ended = True
        self.tracker._add(self.worker, -1, 0 if self.prefilled else -self.prefill_tokens)


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
    healthy: bool = True
    _task: asyncio.Task[None] | None = None

    def begin(self, worker: str, prefill_tokens: int) -> Ticket:
        """Count a request routed to ``worker`` that will prefill ``prefill_tokens`` tokens."""
        self._add(worker, 1, prefill_tokens)
        return Ticket(self, worker, prefill_tokens)

    def _add(self, worker: str, in_flight: int, tokens: int) -> None:
        load = self.local.setdefault(worker, Load())
        load.in_flight += in_flight
        load.queued_tokens += tokens
        if load.in_flight == 0 and load.queued_tokens == 0:
            del self.local[worker]

    def load(self, worker: str) -> Load:
        """Total load on ``worker`` over all replicas (others as of the last sync)."""
        total = Load()
        for part in (self.local.get(worker), self.remote.get(worker)):
            if part is not None:
                total.add(part)
        return total

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
                    mapping={w: f"{v.in_flight},{v.queued_tokens}" for w, v in self.local.items()},
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
                for counts in await pipe.execute():
                    for w, packed in counts.items():
                        in_flight, tokens = (int(x) for x in packed.split(b","))
                        remote.setdefault(w.decode(), Load()).add(Load(in_flight, tokens))
        self.remote = remote
