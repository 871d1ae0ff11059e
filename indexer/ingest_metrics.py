"""Prometheus metrics of the ingester (``kvindex_ingest_`` names, injected registry).

The index counts what its own calls did (:class:`indexer.metrics.IndexMetrics`:
``kvindex_batches_total`` and friends); these count what only the ingester
knows: stream messages, snapshot requests, held batches, dead hosts, leases,
apply lag and decode errors. Both may share one ``CollectorRegistry``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["LAG_BUCKETS", "IngestMetrics"]

#: Apply lag buckets (seconds from a batch's timestamp to its apply): 1 ms .. 60 s.
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngestMetrics:
    """The ingester's counters, gauges and histograms.

    Attributes:
        batches: Batches consumed, by ``result`` (applied, duplicate, gap, held).
        events: Events in applied batches.
        blocks: Block events in applied batches.
        snapshots: Snapshot messages consumed, by ``result`` (applied, stale).
        snapshot_requests: Snapshot requests written to control streams, by ``reason``
            (gap; retry of an unanswered one; quiet: the check of a quiet host; tail:
            the heartbeat names batches the stream did not deliver).
        held_dropped: Held batches dropped because a host's hold buffer was full.
        decode_errors: Stream entries skipped as undecodable or invalid.
        dead_hosts: Hosts purged because their heartbeat expired.
        purged_entries: Entries those purges removed.
        apply_lag: Seconds from a batch's ``ts`` to its apply.
        redis_errors: Redis errors of the ingester's own calls, by ``op``.
        hosts_owned: Hosts this replica consumes.
        hosts_pending: Owned hosts waiting for a snapshot.
        leases: Lease changes, by ``change`` (acquired, released, lost).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ns, sub = "kvindex", "ingest"

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, namespace=ns, subsystem=sub, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, namespace=ns, subsystem=sub, registry=registry)

        self.batches = counter("batches", "Batches consumed, by result", ("result",))
        self.events = counter("events_applied", "Events in applied batches")
        self.blocks = counter("blocks_applied", "Block events in applied batches")
        self.snapshots = counter("snapshots", "Snapshots consumed, by result", ("result",))
        self.snapshot_requests = counter(
            "snapshot_requests", "Snapshot requests sent, by reason", ("reason",)
        )
        self.held_dropped = counter("held_dropped", "Held batches dropped (hold buffer full)")
        self.decode_errors = counter("decode_errors", "Stream entries skipped as invalid")
        self.dead_hosts = counter("dead_hosts", "Hosts purged after their heartbeat expired")
        self.purged_entries = counter("purged_entries", "Entries removed by dead-host purges")
        self.apply_lag = Histogram(
            "apply_lag_seconds", "Seconds from a batch's timestamp to its apply",
            namespace=ns, subsystem=sub, registry=registry, buckets=LAG_BUCKETS,
        )  # fmt: skip
        self.redis_errors = counter("redis_errors", "Redis errors, by operation", ("op",))
        self.hosts_owned = gauge("hosts_owned", "Hosts this replica consumes")
        self.hosts_pending = gauge("hosts_pending", "Owned hosts waiting for a snapshot")
        self.leases = counter("lease_changes", "Host lease changes, by change", ("change",))
        for r in ("applied", "duplicate", "gap", "held"):
            self.batches.labels(result=r)
        for r in ("applied", "stale"):
            self.snapshots.labels(result=r)
        for r in ("gap", "retry", "quiet", "tail"):
            self.snapshot_requests.labels(reason=r)
        for c in ("acquired", "released", "lost"):
            self.leases.labels(change=c)

    def batch_count(self, result: str) -> int:
        """Batches counted with ``result`` so far (tests and benchmarks read it)."""
        value = self.registry.get_sample_value("kvindex_ingest_batches_total", {"result": result})
        return int(value or 0)
