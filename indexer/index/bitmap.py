"""An in-memory index whose lookup costs O(matched prefix), whatever the host count.

The table a gateway replica's :class:`~indexer.index.mirror.IndexMirror`
keeps; a :class:`~indexer.index.base.KVIndex` in its own right, with the
same cursor rules as every backend (the conformance suite runs it).

Layout: every host gets a *slot*, a bit position (the lowest free one, so
bitmaps stay as wide as the hosts present, not as the hosts ever seen)::

    held[key]  = OR of 1 << slot over the hosts holding key (any medium)
    dram[key]  = the same, for the hosts holding it on dram (absent if none)
    ssd[key]   = the same, for ssd (hbm is what is left)
    rev[slot]  = {key: medium rank}   the host's blocks: purge, snapshot, entries

The lookup walks the chain keeping ``alive``, the hosts whose prefix is
still going: one dict probe and one AND per key; a host's prefix ends where
its bit drops out. Per-medium counts are kept as *runs*: ``dram[key] &
alive`` is compared with the previous key's, and only a host whose bit
flips (its run on dram starts or ends) is touched. A chain's blocks sit on
a medium in a few runs (hbm, then dram, then ssd as a cache ages), so the
walk costs O(prefix) int operations plus O(hosts x runs), independent of
how many hosts keep matching; at 512 keys and 64 hosts that is about a
tenth of a millisecond where a per-host walk
(:func:`~indexer.index.prefix.longest_prefixes`) costs milliseconds.
"""

from __future__ import annotations

import heapq
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
    check_keys,
    snapshot_is_stale,
)
from indexer.index.in_process import InProcessIndex
from indexer.media import MEDIA, Medium
from indexer.metrics import IndexMetrics
from indexer.views import PrefixMatch

__all__ = ["BitmapIndex"]


def _flip(changed: int, now: int, at: int, starts: dict[int, int], counts: dict[int, int]) -> None:
    """Hosts in ``changed`` start (bit set in ``now``) or end a run at chain index ``at``."""
    while changed:
        low = changed & -changed
        changed ^= low
        slot = low.bit_length() - 1
        if now & low:
            starts[slot] = at
        else:
            counts[slot] = counts.get(slot, 0) + at - starts.pop(slot)


class BitmapIndex(InProcessIndex):
    """A :class:`~indexer.index.base.KVIndex` in this process, bitmaps per block key.

    The ``*_sync`` methods are the pure core (no I/O, no clock); the async
    methods wrap them and count into ``metrics``.

    Args:
        metrics: Where to count (nothing if None).
    """

    def __init__(self, metrics: IndexMetrics | None = None) -> None:
        self.metrics = metrics
        self._held: dict[int, int] = {}
        # Indexed by medium rank; rank 0 (hbm) is implied and has no dict.
        self._media: tuple[dict[int, int], ...] = ({}, {}, {})
        self._rev: dict[int, dict[int, int]] = {}
        self._cursors: dict[int, Cursor] = {}
        self._slots: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0
        self._per_medium = [0] * len(MEDIA)

    # -- slots --------------------------------------------------------------

    def _slot(self, host: str) -> int:
        slot = self._slots.get(host)
        if slot is None:
            slot = heapq.heappop(self._free) if self._free else self._next
            if slot == self._next:
                self._next += 1
            self._slots[host] = slot
            self._names[slot] = host
            self._rev[slot] = {}
        return slot

    def _release(self, host: str) -> None:
        slot = self._slots.pop(host)
        del self._names[slot]
        del self._rev[slot]
        self._cursors.pop(slot, None)
        heapq.heappush(self._free, slot)

    # -- entry updates ------------------------------------------------------

    def _unset(self, table: dict[int, int], key: int, bit: int) -> None:
        rest = table[key] & ~bit
        if rest:
            table[key] = rest
        else:
            del table[key]

    def _store(self, bit: int, held: dict[int, int], key: int, rank: int) -> None:
        old = held.get(key)
        if old == rank:
            return
        if old is None:
            self._held[key] = self._held.get(key, 0) | bit
        else:
            self._per_medium[old] -= 1
            if old:
                self._unset(self._media[old], key, bit)
        if rank:
            table = self._media[rank]
            table[key] = table.get(key, 0) | bit
        held[key] = rank
        self._per_medium[rank] += 1

    def _remove(self, bit: int, held: dict[int, int], key: int, rank: int) -> None:
        if held.get(key) != rank:
            return
        del held[key]
        self._unset(self._held, key, bit)
        if rank:
            self._unset(self._media[rank], key, bit)
        self._per_medium[rank] -= 1

    def _clear(self, slot: int) -> int:
        held = self._rev[slot]
        bit = 1 << slot
        for key, rank in held.items():
            self._unset(self._held, key, bit)
            if rank:
                self._unset(self._media[rank], key, bit)
            self._per_medium[rank] -= 1
        n = len(held)
        held.clear()
        return n

    # -- synchronous core ---------------------------------------------------

    def apply_sync(self, batch: EventBatch) -> ApplyResult:
        """Apply ``batch`` if it is next in its host's order (see :func:`batch_order`).

        Raises:
            InvalidKeyError: a key is not a u64 (checked first: nothing changes).
            TypeError: not an EventBatch, or an unknown event.
        """
        check_events(batch)
        slot = self._slots.get(batch.host)
        cursor = None if slot is None else self._cursors.get(slot)
        status = batch_order(cursor, batch.epoch, batch.seq)
        if status is not ApplyStatus.APPLIED:
            return ApplyResult(status, 0, cursor)
        slot = self._slot(batch.host)
        held, bit = self._rev[slot], 1 << slot
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                self._clear(slot)
                continue
            rank = Medium(ev.medium).rank
            op = self._store if isinstance(ev, BlockStored) else self._remove
            for key in ev.keys:
                op(bit, held, key, rank)
        cursor = self._cursors[slot] = (batch.epoch, batch.seq)
        return ApplyResult(status, batch_blocks(batch), cursor)

    def load(self, host: str, blocks: dict[Medium, set[int]], cursor: Cursor | None) -> None:
        """Set the host's entries and cursor as read elsewhere (a mirror's bootstrap).

        Unlike :meth:`replace_sync` this never refuses: the caller read both
        from the shared index in one consistent read. With no cursor and no
        blocks the host is forgotten.
        """
        for keys in blocks.values():
            check_keys(list(keys))
        if host in self._slots:
            self._clear(self._slots[host])
        if cursor is None and not any(blocks.values()):
            if host in self._slots:
                self._release(host)
            return
        slot = self._slot(host)
        held, bit = self._rev[slot], 1 << slot
        for medium, keys in blocks.items():
            rank = Medium(medium).rank
            for key in keys:
                self._store(bit, held, key, rank)
        if cursor is None:
            self._cursors.pop(slot, None)
        else:
            self._cursors[slot] = cursor

    def replace_sync(self, snapshot: Snapshot) -> bool:
        """Replace the host's entries with ``snapshot`` unless it is stale."""
        check_events(snapshot)
        slot = self._slots.get(snapshot.host)
        cursor = None if slot is None else self._cursors.get(slot)
        if snapshot_is_stale(cursor, snapshot.epoch, snapshot.seq):
            return False
        slot = self._slot(snapshot.host)
        self._clear(slot)
        held, bit = self._rev[slot], 1 << slot
        for medium, keys in snapshot.blocks.items():
            rank = Medium(medium).rank
            for key in keys:
                self._store(bit, held, key, rank)
        self._cursors[slot] = (snapshot.epoch, snapshot.seq)
        return True

    def purge_sync(self, host: str) -> int:
        """Remove the host's entries and cursor and free its slot; entries removed."""
        slot = self._slots.get(host)
        if slot is None:
            return 0
        n = self._clear(slot)
        self._release(host)
        return n

    def match_sync(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Longest prefix of ``keys`` per host, by medium (hosts with none are absent).

        Keys are not validated here (an invalid key is held by nobody).
        """
        if not keys:
            return {}
        held, dram, ssd = self._held, self._media[1], self._media[2]
        alive = held.get(keys[0], 0)
        if not alive:
            return {}
        ended: list[tuple[int, int]] = []  # (hosts, prefix length where they stopped)
        starts: tuple[dict[int, int], dict[int, int]] = ({}, {})
        counts: tuple[dict[int, int], dict[int, int]] = ({}, {})
        on_dram = on_ssd = 0
        n = 0
        for key in keys:
            still = held.get(key, 0) & alive
            if still != alive:
                ended.append((alive ^ still, n))
                alive = still
                if not alive:
                    break
            d = dram.get(key, 0) & alive
            if d != on_dram:
                _flip(d ^ on_dram, d, n, starts[0], counts[0])
                on_dram = d
            s = ssd.get(key, 0) & alive
            if s != on_ssd:
                _flip(s ^ on_ssd, s, n, starts[1], counts[1])
                on_ssd = s
            n += 1
        if alive:
            ended.append((alive, n))
        _flip(on_dram, 0, n, starts[0], counts[0])
        _flip(on_ssd, 0, n, starts[1], counts[1])
        out: dict[str, PrefixMatch] = {}
        names, in_dram, in_ssd = self._names, counts[0], counts[1]
        for hosts, length in ended:
            while hosts:
                low = hosts & -hosts
                hosts ^= low
                slot = low.bit_length() - 1
                nd, ns = in_dram.get(slot, 0), in_ssd.get(slot, 0)
                name = names[slot]
                out[name] = PrefixMatch(name, length, (length - nd - ns, nd, ns))
        return out

    def cursor_sync(self, host: str) -> Cursor | None:
        """The host's cursor, or None."""
        slot = self._slots.get(host)
        return None if slot is None else self._cursors.get(slot)

    def hosts_sync(self) -> list[str]:
        """Hosts with a cursor, sorted."""
        return sorted(self._names[slot] for slot in self._cursors)

    def entries_sync(self, host: str) -> dict[Medium, set[int]]:
        """The host's blocks per medium (every medium present, possibly empty)."""
        out: dict[Medium, set[int]] = {m: set() for m in MEDIA}
        slot = self._slots.get(host)
        for key, rank in (self._rev[slot] if slot is not None else {}).items():
            out[MEDIA[rank]].add(key)
        return out

    def stats_sync(self) -> IndexStats:
        """Entries per medium and hosts with a cursor."""
        return IndexStats(dict(zip(MEDIA, self._per_medium, strict=True)), len(self._cursors))
