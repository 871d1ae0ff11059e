"""The Redis index: bucketed hashes and Lua scripts, on one Redis or a Redis Cluster.

Layout and scripts: :mod:`indexer.index.layout`, ``*.lua`` beside this
module, docs/index.md; the cluster side is :mod:`indexer.index.cluster`.
Costs:

======================  ===========================  ==============================
operation               single Redis                 Redis Cluster (N primaries)
======================  ===========================  ==============================
``match`` of P keys     1 round trip (Lua walk,      1 round trip per node, in
                        stops where every host's     parallel; the client combines
                        prefix has ended)            the per-key answers
``apply`` of a batch    1 round trip, atomic         cursor read, 1 per node in
                        (cursor check inside)        parallel (atomic per node,
                                                     group cursors make a replay
                                                     idempotent), cursor write
``replace``, ``purge``  1 round trip, atomic,        as ``apply``; every node
                        O(host's buckets + blocks)
======================  ===========================  ==============================

Data loss: ``{p}:idx:layout`` holds ``<layout>|<random incarnation>``,
created once. Every call checks it (inside the scripts, or pipelined with
the cursor read on a cluster); if it changed or vanished, Redis lost the
index (a restart without persistence), so the client forgets its cached
host ids, registers the incarnation again and retries the call once. The
index is then empty and every cursor None: the ingester asks for
snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError

from indexer.events import AllCleared, BlockRemoved, BlockStored, EventBatch, Snapshot
from indexer.index.base import (
    ApplyResult,
    ApplyStatus,
    Cursor,
    IndexStats,
    IndexUnavailableError,
    KVIndexError,
    batch_blocks,
    check_events,
)
from indexer.index.cluster import ClusterOps
from indexer.index.layout import (
    IndexLayout,
    StaleIncarnationError,
    cursor_text,
    pack_keys,
    parse_cursor,
)
from indexer.index.prefix import to_matches
from indexer.index.scripts import SCRIPTS, Args, run_script
from indexer.media import MEDIA, Medium
from indexer.metrics import IndexMetrics
from indexer.registry import RedisHostRegistry
from indexer.views import PrefixMatch
from indexer.wire import Keyspace

__all__ = ["LayoutMismatchError", "RedisIndex"]

_T = TypeVar("_T")
_STATUS = {1: ApplyStatus.APPLIED, 2: ApplyStatus.DUPLICATE, 3: ApplyStatus.GAP}
Client = aioredis.Redis | RedisCluster


class LayoutMismatchError(KVIndexError):
    """The Redis index was created with another :class:`IndexLayout` than this client's."""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _reverse_buckets(layout: IndexLayout, keyspace: Keyspace, hid: int) -> Iterator[bytes]:
    """Names of every reverse bucket of host ``hid``, as ``rev_key`` in common.lua builds them."""
    nbytes = -(-layout.host_bits // 8)
    shift = 8 * nbytes - layout.host_bits
    per_group = 1 << (layout.host_bits - layout.group_bits)
    for r in range(1 << layout.host_bits):
        tag = layout.group_tag(r // per_group)
        head = f"{keyspace.index('')}{{{tag}}}:r:{hid}:".encode()
        yield head + (r << shift).to_bytes(nbytes, "big")


def _is_stale(exc: RedisError) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith("KVINDEX_STALE")


class RedisIndex:
    """A :class:`~indexer.index.base.KVIndex` in Redis (single node or cluster).

    Args:
        client_or_url: A ``redis.asyncio`` client or cluster client (bytes
            responses), or a URL; with a URL the index connects on first use,
            detects cluster mode (``INFO cluster``) and closes the client in
            :meth:`close`.
        keyspace: Key prefix shared with workers and routers.
        layout: Bucket sizes; every client of one index must use the same one
            (checked against the one recorded in Redis).
        metrics: Where to count (nothing if None).
    """

    def __init__(
        self,
        client_or_url: Client | str,
        keyspace: Keyspace | None = None,
        *,
        layout: IndexLayout | None = None,
        metrics: IndexMetrics | None = None,
    ) -> None:
        self.keyspace = keyspace or Keyspace()
        self.layout = layout or IndexLayout()
        self.metrics = metrics
        self._url = client_or_url if isinstance(client_or_url, str) else None
        self._client: Client | None = None if isinstance(client_or_url, str) else client_or_url
        self._cluster: ClusterOps | None = None
        self._registry: RedisHostRegistry | None = None
        self._incarnation = ""
        self._layout_key = self.keyspace.index("layout")
        self._cursor_key = self.keyspace.index("cur")
        self._lock = asyncio.Lock()

    # -- connection and incarnation -----------------------------------------

    @property
    def is_cluster(self) -> bool:
        """Whether the index runs on a Redis Cluster (known after first use)."""
        return isinstance(self._client, RedisCluster)

    async def _ready(self) -> tuple[Client, RedisHostRegistry]:
        if self._registry is None or self._client is None:
            async with self._lock:
                if self._registry is None:
                    with self._guard("connect"):
                        await self._connect()
        assert self._client is not None
        assert self._registry is not None
        return self._client, self._registry

    async def _connect(self) -> None:
        if self._client is None:
            assert self._url is not None
            probe = aioredis.Redis.from_url(self._url)
            info = await probe.info("cluster")
            if int(info.get("cluster_enabled", 0)) == 1:
                await probe.aclose()
                cluster = RedisCluster.from_url(self._url)
                await cluster.initialize()
                self._client = cluster
            else:
                self._client = probe
        client = self._client
        if client.get_encoder().decode_responses:
            raise ValueError("RedisIndex needs a client with decode_responses=False")
        await self._register_incarnation(client)
        if isinstance(client, RedisCluster):
            self._cluster = ClusterOps(
                client, self.layout, self.keyspace, self._config, self._check
            )
        self._registry = RedisHostRegistry(client, self.keyspace)

    async def _register_incarnation(self, client: Client) -> None:
        mine = f"{self.layout.tag}|{secrets.token_hex(8)}"
        await client.set(self._layout_key, mine, nx=True)
        raw = await client.get(self._layout_key)
        found = mine if raw is None else _text(raw)
        if found.split("|")[0] != self.layout.tag:
            raise LayoutMismatchError(
                f"index under {self.keyspace.prefix!r} has layout {found.split('|')[0]}, "
                f"this client {self.layout.tag}"
            )
        self._incarnation = found

    async def _fresh(self, op: Callable[[Client, RedisHostRegistry], Awaitable[_T]]) -> _T:
        """Run ``op``; if Redis lost the index meanwhile, forget cached ids and run it again.

        A connection dropped under a call (a restarted Redis) also gets one more
        try: every operation is idempotent, though a batch whose first try did
        land is then reported as a duplicate.
        """
        client, registry = await self._ready()
        reconnected = refreshed = False
        while True:
            try:
                return await op(client, registry)
            except (ConnectionError, TimeoutError):
                if reconnected:
                    raise
                reconnected = True
            except (StaleIncarnationError, ResponseError) as exc:
                if isinstance(exc, ResponseError) and not _is_stale(exc):
                    raise
                if refreshed:
                    raise KVIndexError("the index was reset again while retrying") from exc
                refreshed = True
                registry.forget()
                async with self._lock:
                    await self._register_incarnation(client)

    def _config(self, check: bool = True) -> Args:
        """The leading ARGV of every script (see common.lua)."""
        return [*self.layout.script_config(self.keyspace), self._incarnation if check else ""]

    def _check(self, found: bytes | str | None) -> None:
        if found is None or _text(found) != self._incarnation:
            raise StaleIncarnationError

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            if self.metrics is not None:
                self.metrics.redis_errors.labels(op=op).inc()
            raise IndexUnavailableError(f"redis error during {op}: {exc}") from exc

    def _counter_key(self, group: int) -> str:
        return self.layout.group_key(self.keyspace, group, "n")

    @staticmethod
    def _event_args(ev: BlockStored | BlockRemoved, packed: bytes) -> Args:
        kind = "s" if isinstance(ev, BlockStored) else "r"
        return [kind, str(Medium(ev.medium).rank), packed]

    # -- apply --------------------------------------------------------------

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one host's batch if it is next in that host's order (base.batch_order).

        Raises:
            InvalidKeyError, TypeError: bad input (nothing changed).
            IndexUnavailableError: Redis failed (replaying the batch is safe).
        """
        check_events(batch)

        async def op(client: Client, registry: RedisHostRegistry) -> ApplyResult:
            hid = await registry.get_or_create(batch.host)
            if self._cluster is not None:
                return await self._cluster.apply(hid, batch)
            assert not isinstance(client, RedisCluster)
            return await self._apply_single(client, hid, batch)

        with self._guard("apply"):
            result = await self._fresh(op)
        if self.metrics is not None:
            self.metrics.record_batch(result.status.value, batch.events, result.blocks)
        return result

    async def _apply_single(
        self, client: aioredis.Redis, hid: int, batch: EventBatch
    ) -> ApplyResult:
        args: Args = [
            *self._config(),
            str(hid),
            "c",
            cursor_text(batch.epoch, batch.seq),
            cursor_text(batch.epoch, batch.seq - 1) if batch.seq > 0 else "",
            str(batch.epoch),
            str(batch.seq),
            "1" if batch.seq == 1 else "0",
            self._counter_key(0),
            "0",
        ]
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                args.append("c")
            else:
                args += self._event_args(ev, pack_keys(ev.keys))
        status, _, cursor = await run_script(client, SCRIPTS.apply, args)
        st = _STATUS[int(status)]
        blocks = batch_blocks(batch) if st is ApplyStatus.APPLIED else 0
        return ApplyResult(st, blocks, parse_cursor(cursor))

    # -- replace / purge ----------------------------------------------------

    async def replace(self, snapshot: Snapshot) -> bool:
        """Replace the host's entries with ``snapshot``; False if stale (ignored).

        Raises:
            InvalidKeyError, TypeError, ValueError: bad input (nothing changed).
            IndexUnavailableError: Redis failed (replaying the snapshot is safe).
        """
        check_events(snapshot)

        async def op(client: Client, registry: RedisHostRegistry) -> bool:
            hid = await registry.get_or_create(snapshot.host)
            if self._cluster is not None:
                return await self._cluster.replace(hid, snapshot)
            args: Args = [
                *self._config(),
                str(hid),
                "c",
                cursor_text(snapshot.epoch, snapshot.seq),
                str(snapshot.epoch),
                str(snapshot.seq),
                self._counter_key(0),
                "0",
            ]
            for medium, keys in snapshot.blocks.items():
                args += [str(Medium(medium).rank), pack_keys(keys)]
            replaced, _ = await run_script(client, SCRIPTS.replace, args)
            return bool(replaced)

        with self._guard("replace"):
            done = await self._fresh(op)
        if self.metrics is not None:
            self.metrics.snapshots.labels(result="replaced" if done else "stale").inc()
        return done

    async def purge(self, host: str) -> int:
        """Remove every entry of ``host`` and its cursor; entries removed.

        Costs O(the host's reverse buckets + its blocks): no keyspace scan.
        The host keeps its registry id.
        """

        async def op(client: Client, registry: RedisHostRegistry) -> int:
            hid = await registry.lookup(host)
            if hid is None:
                return 0
            if self._cluster is not None:
                return await self._cluster.purge(hid)
            args: Args = [*self._config(), str(hid), "c", self._counter_key(0), "0"]
            return int(await run_script(client, SCRIPTS.purge, args))

        with self._guard("purge"):
            n = await self._fresh(op)
        if self.metrics is not None:
            self.metrics.purges.inc()
            self.metrics.purged_entries.inc(n)
        return n

    # -- lookups ------------------------------------------------------------

    async def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per host holding a prefix of the chain ``keys``: its longest prefix by medium.

        Raises:
            InvalidKeyError: a key is not a u64.
            IndexUnavailableError: Redis failed.
        """
        packed = pack_keys(keys)
        if not packed:
            return {}

        async def op(client: Client, registry: RedisHostRegistry) -> dict[str, PrefixMatch]:
            if self._cluster is not None:
                counts = await self._cluster.match(packed)
            else:
                flat = await run_script(client, SCRIPTS.match, [*self._config(), packed])
                counts = {
                    int(flat[i]): [int(x) for x in flat[i + 1 : i + 5]]
                    for i in range(0, len(flat), 5)
                }
            return to_matches(counts, await registry.names(counts))

        start = time.perf_counter()
        with self._guard("match"):
            out = await self._fresh(op)
        if self.metrics is not None:
            self.metrics.lookup_seconds.observe(time.perf_counter() - start)
            self.metrics.lookup_blocks.observe(len(keys))
        return out

    async def cursor(self, host: str) -> Cursor | None:
        """The host's ``(epoch, seq)``, or None (never seen, purged, or Redis lost it)."""

        async def op(client: Client, registry: RedisHostRegistry) -> Cursor | None:
            hid = await registry.lookup(host)
            if hid is None:
                return None
            pipe = client.pipeline()
            pipe.get(self._layout_key)
            pipe.hget(self._cursor_key, str(hid))
            found, cursor = await pipe.execute()
            self._check(found)
            return parse_cursor(cursor)

        with self._guard("cursor"):
            return await self._fresh(op)

    async def hosts(self) -> list[str]:
        """Hosts with a cursor, sorted."""

        async def op(client: Client, registry: RedisHostRegistry) -> list[str]:
            pipe = client.pipeline()
            pipe.get(self._layout_key)
            pipe.hkeys(self._cursor_key)
            found, ids = await pipe.execute()
            self._check(found)
            names = await registry.names(int(h) for h in ids)
            return sorted(names.values())

        with self._guard("hosts"):
            return await self._fresh(op)

    async def entries(self, host: str) -> dict[Medium, set[int]]:
        """Every block ``host`` holds, per medium: one pipelined HGETALL of each of its
        reverse buckets (one round trip per node), O(its buckets + blocks).

        Raises:
            IndexUnavailableError: Redis failed.
        """

        async def op(client: Client, registry: RedisHostRegistry) -> dict[Medium, set[int]]:
            out: dict[Medium, set[int]] = {m: set() for m in MEDIA}
            hid = await registry.lookup(host)
            if hid is None:
                return out
            pipe = client.pipeline(transaction=False)
            pipe.get(self._layout_key)
            for name in _reverse_buckets(self.layout, self.keyspace, hid):
                pipe.hgetall(name)
            found, *buckets = await pipe.execute()
            self._check(found)
            for bucket in buckets:
                for key, rank in bucket.items():
                    out[MEDIA[int(rank)]].add(int.from_bytes(key, "big"))
            return out

        with self._guard("entries"):
            return await self._fresh(op)

    async def cursors(self) -> dict[str, Cursor]:
        """Every host's cursor, by name (one small hash: a mirror checks its own against it)."""

        async def op(client: Client, registry: RedisHostRegistry) -> dict[str, Cursor]:
            pipe = client.pipeline()
            pipe.get(self._layout_key)
            pipe.hgetall(self._cursor_key)
            found, raw = await pipe.execute()
            self._check(found)
            names = await registry.names(int(h) for h in raw)
            out = {}
            for hid, cur in raw.items():
                name, cursor = names.get(int(hid)), parse_cursor(cur)
                if name is not None and cursor is not None:
                    out[name] = cursor
            return out

        with self._guard("cursors"):
            return await self._fresh(op)

    async def read_host(
        self, host: str, *, attempts: int = 5
    ) -> tuple[Cursor | None, dict[Medium, set[int]]]:
        """The host's cursor and blocks as of one moment: what a mirror bootstraps from.

        One round trip: the cursor, every reverse bucket, the cursor again. On a
        single Redis the reads run in MULTI/EXEC, so no script runs between them.
        On a cluster the buckets span nodes and no transaction covers them; the
        read is taken again until both cursor reads agree (no batch finished
        meanwhile). A batch still half-applied across nodes at that moment can
        show in part; replaying it on top is harmless (applying the whole batch
        after any prefix of it gives the batch's result: docs/index.md).

        Raises:
            KVIndexError: the cursor kept moving for ``attempts`` reads.
            IndexUnavailableError: Redis failed.
        """

        async def op(
            client: Client, registry: RedisHostRegistry
        ) -> tuple[Cursor | None, dict[Medium, set[int]]]:
            hid = await registry.lookup(host)
            if hid is None:
                return None, {m: set() for m in MEDIA}
            for _ in range(attempts):
                pipe = client.pipeline(transaction=not isinstance(client, RedisCluster))
                pipe.get(self._layout_key)
                pipe.hget(self._cursor_key, str(hid))
                for name in _reverse_buckets(self.layout, self.keyspace, hid):
                    pipe.hgetall(name)
                pipe.hget(self._cursor_key, str(hid))
                found, before, *buckets, after = await pipe.execute()
                self._check(found)
                if before != after:
                    continue
                out: dict[Medium, set[int]] = {m: set() for m in MEDIA}
                for bucket in buckets:
                    for key, rank in bucket.items():
                        out[MEDIA[int(rank)]].add(int.from_bytes(key, "big"))
                return parse_cursor(before), out
            raise KVIndexError(f"host {host}: its cursor moved during {attempts} reads")

        with self._guard("read_host"):
            return await self._fresh(op)

    async def stats(self) -> IndexStats:
        """Entries per medium (from the counters the scripts keep), hosts, memory used."""
        client, _ = await self._ready()
        with self._guard("stats"):
            pipe = client.pipeline()
            for g in range(self.layout.groups):
                pipe.hgetall(self._counter_key(g))
            pipe.hlen(self._cursor_key)
            *counters, hosts = await pipe.execute()
            if isinstance(client, RedisCluster):
                infos = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                memory = sum(int(i["used_memory"]) for i in infos.values())
            else:
                memory = int((await client.info("memory"))["used_memory"])
        entries = dict.fromkeys(MEDIA, 0)
        for counter in counters:
            for rank, n in counter.items():
                entries[MEDIA[int(rank)]] += int(n)
        if self.metrics is not None:
            self.metrics.record_stats(entries, memory)
        return IndexStats(entries, int(hosts), memory)

    async def close(self) -> None:
        """Close the client if this index created it from a URL."""
        if self._url is not None and self._client is not None:
            await self._client.aclose()
            self._client = None
            self._registry = None
            self._cluster = None
