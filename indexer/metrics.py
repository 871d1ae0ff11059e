"""Prometheus metrics of the KV index (``kvindex_`` namespace, injected registry).

Every backend takes an optional :class:`IndexMetrics`; tests build one on a
fresh ``CollectorRegistry``, a service on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from indexer.events import AllCleared, BlockRemoved, BlockStored, Event
from indexer.media import Medium

__all__ = ["LOOKUP_BUCKETS", "IndexMetrics", "MirrorMetrics"]

#: Lookup latency buckets (seconds): 50 us .. 1 s.
LOOKUP_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class IndexMetrics:
    """The index's counters, gauges and histograms.

    Attributes:
        batches: Batches seen by ``apply``, by ``result`` (applied, duplicate, gap).
        events: Events applied, by ``kind`` (stored, removed, cleared).
        blocks: Block events applied (keys of applied stored/removed events).
        snapshots: Snapshots seen by ``replace``, by ``result`` (replaced, stale).
        purges: Hosts purged.
        purged_entries: Entries removed by purges.
        entries: (block, host) entries per ``medium``, as of the last ``stats``.
        memory: Bytes the store uses, as of the last ``stats``.
        lookup_seconds: Latency of ``match``.
        lookup_blocks: Length of the chains looked up.
        redis_errors: Redis errors by ``op``.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "kvindex"
        self.batches = Counter(
            "batches", "Event batches seen, by result", ["result"], namespace=ns, registry=registry
        )
        self.events = Counter(
            "events_applied", "Events applied, by kind", ["kind"], namespace=ns, registry=registry
        )
        self.blocks = Counter(
            "blocks_applied", "Block events applied", namespace=ns, registry=registry
        )
        self.snapshots = Counter(
            "snapshots", "Snapshots seen, by result", ["result"], namespace=ns, registry=registry
        )
        self.purges = Counter("purges", "Hosts purged", namespace=ns, registry=registry)
        self.purged_entries = Counter(
            "purged_entries", "Entries removed by purges", namespace=ns, registry=registry
        )
        self.entries = Gauge(
            "entries", "(block, host) entries per medium", ["medium"], namespace=ns,
            registry=registry,
        )  # fmt: skip
        self.memory = Gauge(
            "memory_bytes", "Memory used by the index store", namespace=ns, registry=registry
        )
        self.lookup_seconds = Histogram(
            "lookup_seconds", "Prefix lookup latency", namespace=ns, registry=registry,
            buckets=LOOKUP_BUCKETS,
        )  # fmt: skip
        self.lookup_blocks = Histogram(
            "lookup_blocks", "Block keys per lookup", namespace=ns, registry=registry,
            buckets=(1, 8, 32, 128, 512, 2048, 8192, 32768),
        )  # fmt: skip
        self.redis_errors = Counter(
            "redis_errors", "Redis errors, by operation", ["op"], namespace=ns, registry=registry
        )
        for m in Medium:
            self.entries.labels(medium=m.value)
        for r in ("applied", "duplicate", "gap"):
            self.batches.labels(result=r)
        for k in ("stored", "removed", "cleared"):
            self.events.labels(kind=k)
        for r in ("replaced", "stale"):
            self.snapshots.labels(result=r)

    def record_batch(self, result: str, events: Iterable[Event], blocks: int) -> None:
        """Count one ``apply``: its result and, if applied, its events and blocks."""
        self.batches.labels(result=result).inc()
        if result == "applied":
            for ev in events:
                self.events.labels(kind=_KIND[type(ev)]).inc()
            self.blocks.inc(blocks)

    def record_stats(self, entries: Mapping[Medium, int], memory_bytes: int | None) -> None:
        """Publish the sizes found by ``stats``."""
        for m, n in entries.items():
            self.entries.labels(medium=m.value).set(n)
        if memory_bytes is not None:
            self.memory.set(memory_bytes)


_KIND: dict[type, str] = {BlockStored: "stored", BlockRemoved: "removed", AllCleared: "cleared"}


class MirrorMetrics:
    """A gateway replica's index mirror (:mod:`indexer.index.mirror`), ``kvindex_mirror_*``.

    Attributes:
        entries: (block, host) entries the mirror holds.
        hosts: Hosts the mirror follows.
        ready: 1 while lookups are answered from the mirror, 0 while they go to Redis.
        lag: Seconds from a batch's publication to the mirror applying it.
        batches: Stream messages seen, by ``result`` (applied, duplicate, gap,
            snapshot, stale, invalid).
        resyncs: Hosts (re)read from the Redis index, by ``reason`` (new, gap,
            drift, reset).
        purges: Hosts dropped because their heartbeat expired.
        lookups: Lookups by ``source`` (mirror, redis: the fallback).
        errors: Rounds that failed on Redis.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        ns = "kvindex_mirror"
        self.entries = Gauge("entries", "(block, host) entries held", namespace=ns,
                             registry=registry)  # fmt: skip
        self.hosts = Gauge("hosts", "Hosts followed", namespace=ns, registry=registry)
        self.ready = Gauge(
            "ready", "1 while lookups are served from the mirror", namespace=ns, registry=registry
        )
        self.lag = Histogram(
            "lag_seconds", "Batch publication to mirror apply", namespace=ns, registry=registry,
            buckets=(1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )  # fmt: skip
        self.batches = Counter(
            "messages", "Stream messages seen, by result", ["result"], namespace=ns,
            registry=registry,
        )  # fmt: skip
        self.resyncs = Counter(
            "resyncs", "Hosts read again from the Redis index, by reason", ["reason"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.purges = Counter("purges", "Hosts dropped as dead", namespace=ns, registry=registry)
        self.lookups = Counter(
            "lookups", "Lookups, by source", ["source"], namespace=ns, registry=registry
        )
        self.errors = Counter("errors", "Rounds failed on Redis", namespace=ns, registry=registry)
        for r in ("new", "gap", "drift", "reset"):
            self.resyncs.labels(reason=r)
        for s in ("mirror", "redis"):
            self.lookups.labels(source=s)
