"""The in-memory index: tests, the embedded default and the offline simulator.

Pure Python, no I/O and no clock in its synchronous core (``*_sync``
methods, which the simulator calls on its hot path); the async methods of
:class:`~indexer.index.base.KVIndex` wrap them and add metrics.

Layout: ``key -> {host_id: medium rank}`` (a small dict per block, so a
lookup costs one dict probe per key plus one per surviving host) and the
reverse ``host_id -> {key: rank}`` that makes a purge O(the host's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from indexer.events import AllCleared, BlockStored, EventBatch, Snapshot
from indexer.index.base import (
    ApplyResult,
    ApplyStatus,
    Cursor,
    IndexStats,
    batch_blocks,
    batch_order,
    check_events,
    snapshot_is_stale,
)
from indexer.index.in_process import InProcessIndex
from indexer.index.prefix import longest_prefixes, to_matches
from indexer.media import MEDIA, Medium
from indexer.metrics import IndexMetrics
from indexer.registry import InMemoryHostRegistry
from indexer.views import PrefixMatch

__all__ = ["MemoryIndex"]


class MemoryIndex(InProcessIndex):
    """A :class:`~indexer.index.base.KVIndex` held in this process.

    Args:
        registry: Host ids (a fresh one if None).
        metrics: Where to count (nothing if None).
    """

    def __init__(
        self, registry: InMemoryHostRegistry | None = None, metrics: IndexMetrics | None = None
    ) -> None:
        self.registry = registry or InMemoryHostRegistry()
        self.metrics = metrics
        self._fwd: dict[int, dict[int, int]] = {}
        self._rev: dict[int, dict[int, int]] = {}
        self._cursors: dict[int, Cursor] = {}
        self._per_medium = [0] * len(MEDIA)

    # -- synchronous core -------------------------------------------------

    def _store(self, hid: int, held: dict[int, int], key: int, rank: int) -> None:
        old = held.get(key)
        if old == rank:
            return
        holders = self._fwd.get(key)
        if holders is None:
            self._fwd[key] = {hid: rank}
        else:
            holders[hid] = rank
        held[key] = rank
        if old is not None:
            self._per_medium[old] -= 1
        self._per_medium[rank] += 1

    def _remove(self, hid: int, held: dict[int, int], key: int, rank: int) -> None:
        if held.get(key) != rank:
            return
        del held[key]
        holders = self._fwd[key]
        del holders[hid]
        if not holders:
            del self._fwd[key]
        self._per_medium[rank] -= 1

    def _clear(self, hid: int) -> int:
        held = self._rev.get(hid)
        if not held:
            return 0
        per_medium = self._per_medium
        for key, rank in held.items():
            holders = self._fwd[key]
            del holders[hid]
            if not holders:
                del self._fwd[key]
            per_medium[rank] -= 1
        n = len(held)
        held.clear()
        return n

    def apply_sync(self, batch: EventBatch) -> ApplyResult:
        """Apply ``batch`` if it is next in its host's order (see :func:`batch_order`).

        Raises:
            InvalidKeyError: a key is not a u64 (checked first: nothing changes).
            TypeError: not an EventBatch, or an unknown event.
        """
        check_events(batch)
        hid = self.registry.id_of(batch.host)
        assert hid is not None
        cursor = self._cursors.get(hid)
        status = batch_order(cursor, batch.epoch, batch.seq)
        if status is not ApplyStatus.APPLIED:
            return ApplyResult(status, 0, cursor)
        held = self._rev.setdefault(hid, {})
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                self._clear(hid)
                continue
            medium = ev.medium if isinstance(ev.medium, Medium) else Medium(ev.medium)
            rank = medium.rank
            op = self._store if isinstance(ev, BlockStored) else self._remove
            for key in ev.keys:
                op(hid, held, key, rank)
        cursor = self._cursors[hid] = (batch.epoch, batch.seq)
        return ApplyResult(status, batch_blocks(batch), cursor)

    def replace_sync(self, snapshot: Snapshot) -> bool:
        """Replace the host's entries with ``snapshot`` unless it is stale."""
        check_events(snapshot)
        hid = self.registry.id_of(snapshot.host)
        assert hid is not None
        if snapshot_is_stale(self._cursors.get(hid), snapshot.epoch, snapshot.seq):
            return False
        self._clear(hid)
        held = self._rev.setdefault(hid, {})
        for medium, keys in snapshot.blocks.items():
            rank = Medium(medium).rank
            for key in keys:
                self._store(hid, held, key, rank)
        self._cursors[hid] = (snapshot.epoch, snapshot.seq)
        return True

    def purge_sync(self, host: str) -> int:
        """Remove the host's entries and cursor; returns entries removed."""
        hid = self.registry.id_of(host, create=False)
        if hid is None:
            return 0
        n = self._clear(hid)
        self._rev.pop(hid, None)
        self._cursors.pop(hid, None)
        return n

    def match_sync(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Longest prefix of ``keys`` per host, by medium (hosts with none are absent).

        The hot path of the simulator: keys are not validated here (an invalid
        key is simply held by nobody); :meth:`match` validates them.
        """
        fwd = self._fwd
        counts = longest_prefixes(fwd.get(k) for k in keys)
        names = {hid: self.registry.name_of(hid) for hid in counts}
        return to_matches(counts, names)

    def cursor_sync(self, host: str) -> Cursor | None:
        """The host's cursor, or None."""
        hid = self.registry.id_of(host, create=False)
        return None if hid is None else self._cursors.get(hid)

    def entries_sync(self, host: str) -> dict[Medium, set[int]]:
        """The host's blocks per medium (every medium present, possibly empty)."""
        out: dict[Medium, set[int]] = {m: set() for m in MEDIA}
        hid = self.registry.id_of(host, create=False)
        held = self._rev.get(hid) if hid is not None else None
        for key, rank in (held or {}).items():
            out[MEDIA[rank]].add(key)
        return out

    def hosts_sync(self) -> list[str]:
        """Hosts with a cursor, sorted."""
        return sorted(self.registry.name_of(hid) for hid in self._cursors)

    def stats_sync(self) -> IndexStats:
        """Entries per medium and hosts with a cursor."""
        entries = dict(zip(MEDIA, self._per_medium, strict=True))
        return IndexStats(entries, len(self._cursors), None)
