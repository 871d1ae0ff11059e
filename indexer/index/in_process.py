"""The async :class:`~indexer.index.base.KVIndex` face of an index that lives in this process.

:class:`~indexer.index.memory.MemoryIndex` and :class:`~indexer.index.bitmap.BitmapIndex`
keep their state in Python objects and implement pure ``*_sync`` methods;
this base class wraps them into the async interface and counts into
``metrics`` the way every index does, so the two cannot count differently.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from indexer.events import EventBatch, Snapshot
from indexer.index.base import ApplyResult, Cursor, IndexStats, check_keys
from indexer.media import Medium
from indexer.metrics import IndexMetrics
from indexer.views import PrefixMatch

__all__ = ["InProcessIndex"]


class InProcessIndex:
    """Async wrappers over the ``*_sync`` core a subclass provides."""

    metrics: IndexMetrics | None

    def apply_sync(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (the subclass's core)."""
        raise NotImplementedError

    def replace_sync(self, snapshot: Snapshot) -> bool:
        """Replace a host's entries (the subclass's core)."""
        raise NotImplementedError

    def purge_sync(self, host: str) -> int:
        """Drop a host (the subclass's core)."""
        raise NotImplementedError

    def match_sync(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Longest prefixes per host (the subclass's core)."""
        raise NotImplementedError

    def cursor_sync(self, host: str) -> Cursor | None:
        """A host's cursor (the subclass's core)."""
        raise NotImplementedError

    def hosts_sync(self) -> list[str]:
        """Hosts with a cursor, sorted (the subclass's core)."""
        raise NotImplementedError

    def entries_sync(self, host: str) -> dict[Medium, set[int]]:
        """A host's blocks per medium (the subclass's core)."""
        raise NotImplementedError

    def stats_sync(self) -> IndexStats:
        """Entries per medium and hosts (the subclass's core)."""
        raise NotImplementedError

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """See :meth:`apply_sync`."""
        result = self.apply_sync(batch)
        if self.metrics is not None:
            self.metrics.record_batch(result.status.value, batch.events, result.blocks)
        return result

    async def replace(self, snapshot: Snapshot) -> bool:
        """See :meth:`replace_sync`."""
        done = self.replace_sync(snapshot)
        if self.metrics is not None:
            self.metrics.snapshots.labels(result="replaced" if done else "stale").inc()
        return done

    async def purge(self, host: str) -> int:
        """See :meth:`purge_sync`."""
        n = self.purge_sync(host)
        if self.metrics is not None:
            self.metrics.purges.inc()
            self.metrics.purged_entries.inc(n)
        return n

    async def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """See :meth:`match_sync`; raises InvalidKeyError for a key that is not a u64."""
        check_keys(keys)
        if self.metrics is None:
            return self.match_sync(keys)
        start = time.perf_counter()
        out = self.match_sync(keys)
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        self.metrics.lookup_blocks.observe(len(keys))
        return out

    async def cursor(self, host: str) -> Cursor | None:
        """See :meth:`cursor_sync`."""
        return self.cursor_sync(host)

    async def hosts(self) -> list[str]:
        """See :meth:`hosts_sync`."""
        return self.hosts_sync()

    async def entries(self, host: str) -> dict[Medium, set[int]]:
        """See :meth:`entries_sync`."""
        return self.entries_sync(host)

    async def stats(self) -> IndexStats:
        """See :meth:`stats_sync`."""
        stats = self.stats_sync()
        if self.metrics is not None:
            self.metrics.record_stats(stats.entries, None)
        return stats

    async def close(self) -> None:
        """Nothing to release."""
