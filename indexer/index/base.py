"""The global KV index interface, shared by every backend.

An index maps (block key, host) to the medium the host holds the block on.
Workers' event batches change it, snapshots replace a host's part of it,
and the router asks it, for a prompt's chain of block keys, which hosts
hold how long a prefix on which media.

Ordering (DESIGN.md, "Events"): the index keeps a cursor ``(epoch, seq)``
per host and applies a batch only if it is the next one
(:func:`batch_order`). The rules, shared by every backend:

==============================  =============  =================================
host cursor                     batch          result
==============================  =============  =================================
none (never seen, purged,       seq 1          applied: an epoch's first batch
Redis restarted)                               starts from an empty cache
                                               (engine_worker/publisher.py
                                               numbers batches from 1)
none                            any other seq  gap: only a snapshot can help
(E, s)                          (E, s + 1)     applied
(E, s)                          (E, <= s)      duplicate, nothing changes
(E, s)                          (E, > s + 1)   gap, nothing changes
(E, s)                          (E' != E, any) gap (a restarted worker)
==============================  =============  =================================

A snapshot ``(E, S)`` always replaces the host's entries and sets the
cursor to ``(E, S)``, unless the cursor is ``(E, s)`` with ``s > S`` (an
older snapshot of the same epoch, ignored).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from indexer.events import AllCleared, BlockRemoved, BlockStored, EventBatch, Snapshot
from indexer.media import MEDIA, Medium
from indexer.views import PrefixMatch

__all__ = [
    "ApplyResult",
    "ApplyStatus",
    "IndexStats",
    "IndexUnavailableError",
    "InvalidKeyError",
    "KVIndex",
    "KVIndexError",
    "batch_blocks",
    "batch_order",
    "check_events",
    "check_keys",
    "snapshot_is_stale",
]

Cursor = tuple[int, int]


class KVIndexError(RuntimeError):
    """The index could not do what was asked (see the subclasses)."""


class IndexUnavailableError(KVIndexError):
    """The index's store (Redis) could not be reached or answered with an error."""


class InvalidKeyError(KVIndexError, ValueError):
    """A block key is not an unsigned 64-bit integer (nothing was changed)."""


_U64_MAX = (1 << 64) - 1
_MEDIA = frozenset(MEDIA)


def check_keys(keys: Sequence[int]) -> None:
    """Raise :class:`InvalidKeyError` unless every key is an int in ``[0, 2**64)``."""
    # C-speed passes (type set, min, max): this runs for every event the index applies.
    if not keys:
        return
    if not set(map(type, keys)) <= {int} or min(keys) < 0 or max(keys) > _U64_MAX:
        bad = next((k for k in keys if type(k) is not int or not 0 <= k <= _U64_MAX), keys[0])
        raise InvalidKeyError(f"block keys must be integers in [0, 2**64), got {bad!r}")


def check_events(message: EventBatch | Snapshot) -> None:
    """Validate a batch's or snapshot's keys and types before anything is changed.

    Raises:
        TypeError: not an EventBatch/Snapshot, or an event of an unknown kind.
        InvalidKeyError: a key is not a u64.
    """
    if isinstance(message, Snapshot):
        for medium, keys in message.blocks.items():
            Medium(medium)
            check_keys(keys)
        return
    if not isinstance(message, EventBatch):
        raise TypeError(f"expected an EventBatch, got {type(message).__name__}")
    for ev in message.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            # Structs built in Python are not validated: check the medium cheaply.
            if ev.medium not in _MEDIA:
                raise ValueError(f"unknown medium {ev.medium!r}")
            check_keys(ev.keys)
        elif not isinstance(ev, AllCleared):
            raise TypeError(f"unknown event {type(ev).__name__}")


class ApplyStatus(StrEnum):
    """What :meth:`KVIndex.apply` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of applying one batch.

    Attributes:
        status: applied, duplicate (already applied: nothing changed) or gap
            (not next in order: nothing changed; ask the worker for a snapshot).
        blocks: Block events applied (keys of the batch's stored/removed events;
            0 unless applied).
        cursor: The host's cursor after the call (None if it has none).
    """

    status: ApplyStatus
    blocks: int = 0
    cursor: Cursor | None = None


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size of the index.

    Attributes:
        entries: (block, host) entries per medium.
        hosts: Hosts with a cursor.
        memory_bytes: Memory the store uses (Redis ``used_memory``, summed over
            nodes), None for the in-memory backend.
    """

    entries: dict[Medium, int] = field(default_factory=lambda: dict.fromkeys(MEDIA, 0))
    hosts: int = 0
    memory_bytes: int | None = None

    @property
    def total(self) -> int:
        """All (block, host) entries."""
        return sum(self.entries.values())


def batch_order(cursor: Cursor | None, epoch: int, seq: int) -> ApplyStatus:
    """Where batch ``(epoch, seq)`` stands against a host's cursor (table in the module doc)."""
    if cursor is None:
        return ApplyStatus.APPLIED if seq == 1 else ApplyStatus.GAP
    cur_epoch, cur_seq = cursor
    if cur_epoch != epoch:
        return ApplyStatus.GAP
    if seq <= cur_seq:
        return ApplyStatus.DUPLICATE
    return ApplyStatus.APPLIED if seq == cur_seq + 1 else ApplyStatus.GAP


def snapshot_is_stale(cursor: Cursor | None, epoch: int, seq: int) -> bool:
    """Whether snapshot ``(epoch, seq)`` is older than the cursor of the same epoch."""
    return cursor is not None and cursor[0] == epoch and seq < cursor[1]


def batch_blocks(batch: EventBatch) -> int:
    """Block events in a batch (keys of its stored/removed events)."""
    return sum(0 if isinstance(ev, AllCleared) else len(ev.keys) for ev in batch.events)


@runtime_checkable
class KVIndex(Protocol):
    """One interface for every backend (in-memory, Redis, Redis Cluster)."""

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one host's batch if it is next in that host's order; atomic per host
        (per node on a cluster, where a replay after a crash finishes the job)."""
        ...

    async def replace(self, snapshot: Snapshot) -> bool:
        """Replace the host's entries with ``snapshot``; False if it was stale and ignored."""
        ...

    async def purge(self, host: str) -> int:
        """Remove every entry of ``host`` and its cursor in O(its blocks); entries removed."""
        ...

    async def match(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        """Per host holding a prefix of the chain ``keys``, its longest prefix by medium."""
        ...

    async def cursor(self, host: str) -> Cursor | None:
        """The host's ``(epoch, seq)``, or None."""
        ...

    async def hosts(self) -> list[str]:
        """Hosts with a cursor, sorted."""
        ...

    async def entries(self, host: str) -> dict[Medium, set[int]]:
        """Every block ``host`` holds, per medium (every medium present), in O(its blocks).

        Read from the per-host reverse index; the audit compares it with what the
        worker itself reports.
        """
        ...

    async def stats(self) -> IndexStats:
        """Entries per medium, hosts and memory used."""
        ...

    async def close(self) -> None:
        """Release connections (an index passed a client does not close it)."""
        ...
