"""The worker's block pool: block metadata, prefix cache and LRU tiers (HBM -> DRAM -> SSD).

Follows vLLM v1's design (``vllm/v1/core/block_pool.py``): blocks are
metadata only (slot id, ref count, key); a key -> block map serves prefix
hits; unreferenced blocks wait in an O(1) LRU free queue and keep their
key until a new allocation pops them (*lazy eviction*); every transition
is queued as an event and drained by :meth:`BlockPool.take_events`, so
publishing stays outside the pool. Everything here is pure bookkeeping: no
clock and no I/O. The bytes, if any, live in an optional
:class:`~engine_worker.tiers.TierStorage`, which the pool drives with one
``copy_block`` per move; without one (the ``sim`` runner, the offline
simulator) the pool behaves identically on metadata alone.

Tiers are *exclusive*: a key lives on exactly one medium. Evicting a cached
HBM block demotes its bytes to the next configured slower tier, which may
push that tier's LRU block further down, until the lowest tier drops one::

    allocate() pops HBM head h (key K)
        DRAM head d (key K2) --> SSD head s (key K3): K3 dropped  removed{ssd K3}
        copy d -> s                                               removed{dram K2} stored{ssd K2}
        copy h -> d                                               removed{hbm K}   stored{dram K}
        h handed out empty

A prefix hit on DRAM/SSD promotes the block: a fresh HBM block is taken
(which may cascade as above), the bytes copied up and the lower slot freed.
HBM blocks carry the references of the requests using them. DRAM and SSD
slots sit in their medium's free queue, cached ones in LRU order and empty
ones at the head, except while a reader (a KV transfer) pins them
(:meth:`BlockPool.pin`): a pinned slot is out of its queue, so no eviction
reuses it and its bytes stay as they were until it is released. A pinned
lower-tier block a request promotes meanwhile hands its key to HBM as usual,
and its slot returns to the queue, empty, once the reader lets go.

A cached block's checksum (what a KV transfer sends with it,
:mod:`engine_worker.block_checksum`) is metadata like its key: taken from the
storage when the block is cached, moved with the key on every copy between
tiers (the copy is exact), dropped with the key. The bytes of a block holding a
key never change, so it stays right for as long as the key does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_worker.free_queue import Block, FreeBlockQueue
from indexer.events import AllCleared, BlockRemoved, BlockStored, Event
from indexer.media import MEDIA, Medium

if TYPE_CHECKING:
    from engine_worker.ssd_tier import SSDEntry
    from engine_worker.tiers import TierStorage

__all__ = ["Block", "BlockPool", "PoolError", "PoolExhaustedError", "PoolStats", "TierCapacity"]

_U64_MAX = 2**64 - 1


class PoolError(RuntimeError):
    """Bad use of the pool (double free, foreign block, bad capacity...); state is unchanged."""


class PoolExhaustedError(PoolError):
    """Not enough allocatable HBM blocks for the request; state is unchanged."""


@dataclass(frozen=True, slots=True)
class TierCapacity:
    """Blocks per medium; ``hbm >= 1``, the others ``>= 0`` (0 means the tier is absent)."""

    hbm: int
    dram: int = 0
    ssd: int = 0

    def __post_init__(self) -> None:
        for medium in MEDIA:
            n = self.of(medium)
            if (
                isinstance(n, bool)
                or not isinstance(n, int)
                or n < (1 if medium is Medium.HBM else 0)
            ):
                low = 1 if medium is Medium.HBM else 0
                raise PoolError(f"TierCapacity.{medium.value} must be an int >= {low}, got {n!r}")

    def of(self, medium: Medium) -> int:
        """Blocks on ``medium``."""
        return (
            self.hbm if medium is Medium.HBM else self.dram if medium is Medium.DRAM else self.ssd
        )


def _per_medium() -> dict[Medium, int]:
    return dict.fromkeys(MEDIA, 0)


@dataclass(slots=True)
class PoolStats:
    """Counters since the pool was built (blocks, not bytes).

    Attributes:
        allocations: Blocks handed out by ``allocate``.
        hits: Blocks acquired by ``acquire``, by the medium they were found on.
        stored: Keys cached by ``cache_block``.
        duplicates: ``cache_block`` calls refused because the key was already cached.
        demotions: Keys moved to a slower tier, by source medium.
        promotions: Keys moved up to HBM, by source medium.
        evictions: Keys dropped from the pool, by the medium they were dropped from
            (SSD, or the lowest configured tier).
    """

    allocations: int = 0
    hits: dict[Medium, int] = field(default_factory=_per_medium)
    stored: int = 0
    duplicates: int = 0
    demotions: dict[Medium, int] = field(default_factory=_per_medium)
    promotions: dict[Medium, int] = field(default_factory=_per_medium)
    evictions: dict[Medium, int] = field(default_factory=_per_medium)

    def copy(self) -> PoolStats:
        """An independent copy (the pool keeps counting in its own)."""
        return PoolStats(
            self.allocations,
            dict(self.hits),
            self.stored,
            self.duplicates,
            dict(self.demotions),
            dict(self.promotions),
            dict(self.evictions),
        )


def _check_key(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise PoolError(f"{what} must be an unsigned 64-bit int, got {value!r}")


class BlockPool:
    """Blocks of every medium, the prefix cache over them, and their events.

    Args:
        capacity: Blocks per medium.
        storage: The tensors and slot file holding the bytes, or None for the
            metadata-only mode (same behaviour, no bytes). Its capacity must
            equal ``capacity``. Keys its SSD manifest restores are cached on
            SSD at once and announced as ``stored{ssd}`` events.
        enable_caching: When False, ``cache_block`` is a no-op and nothing is
            ever matched, demoted or restored (the SSD manifest is left as is).

    Not thread-safe: one scheduler thread owns the pool. An I/O error from the
    storage in the middle of a move propagates and leaves the pool in an
    undefined state (the worker should restart; the SSD journal stays valid).
    """

    def __init__(
        self,
        capacity: TierCapacity,
        storage: TierStorage | None = None,
        *,
        enable_caching: bool = True,
    ) -> None:
        if not isinstance(capacity, TierCapacity):
            raise PoolError(f"capacity must be a TierCapacity, got {type(capacity).__name__}")
        if storage is not None and storage.capacity != capacity:
            raise PoolError(f"storage capacity {storage.capacity} != pool capacity {capacity}")
        self._capacity = capacity
        self._storage = storage
        self._caching = enable_caching
        # Slots are materialized on first use: a never-used slot is empty and sits,
        # conceptually, at the head of its free queue. A 1M-block tier costs nothing
        # until it fills (the simulator builds dozens of such pools per run).
        self._blocks: dict[Medium, list[Block]] = {m: [] for m in MEDIA}
        self._queues = {m: FreeBlockQueue() for m in MEDIA}
        self._fresh = {m: capacity.of(m) for m in MEDIA}
        self._empty = {m: capacity.of(m) for m in MEDIA}
        self._lower = {
            m: tuple(low for low in MEDIA[m.rank + 1 :] if capacity.of(low) > 0) for m in MEDIA
        }
        self._cached: dict[int, Block] = {}
        self._events: list[Event] = []
        self._stats = PoolStats()
        #: Whether ``stored`` events from :meth:`cache_block` carry the block's token ids
        #: (set by the worker when a consumer needs them: vLLM-format events).
        self.event_token_ids = False
        if storage is not None and enable_caching:
            self._restore(storage.restored_ssd())

    # ------------------------------------------------------------------ queries

    def num_free(self, medium: Medium = Medium.HBM) -> int:
        """Blocks of ``medium`` allocatable now: empty ones plus cached ones not in use."""
        return len(self._queues[medium]) + self._fresh[medium]

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        if n < 0:
            raise PoolError(f"cannot allocate a negative number of blocks ({n})")
        return n <= len(self._queues[Medium.HBM]) + self._fresh[Medium.HBM]

    def match_prefix(self, keys: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest prefix of ``keys``, in order, on any medium.

        Stops at the first key not cached. Pure: no reference, LRU order or event changes.
        """
        if not self._caching:
            return []
        cached = self._cached
        out: list[Block] = []
        for key in keys:
            block = cached.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def cached_block(self, key: int) -> Block | None:
        """The block holding ``key`` on any medium, or None."""
        return self._cached.get(key)

    def in_use(self, key: int) -> bool:
        """Whether ``key``'s block sits in HBM referenced by a request (or pinned): a
        request matching it shares it instead of taking it out of the free queue."""
        block = self._cached.get(key)
        return block is not None and block.medium is Medium.HBM and block.ref_cnt > 0

    def usage(self) -> dict[Medium, int]:
        """Blocks holding data (in use or cached) per medium."""
        return {m: self._capacity.of(m) - self._empty[m] for m in MEDIA}

    def capacity(self) -> TierCapacity:
        """Blocks per medium."""
        return self._capacity

    def snapshot(self) -> dict[Medium, list[int]]:
        """Every cached key per medium (what a resync sends to the index)."""
        out: dict[Medium, list[int]] = {m: [] for m in MEDIA}
        for key, block in self._cached.items():
            out[block.medium].append(key)
        return out

    def stats(self) -> PoolStats:
        """A copy of the pool's counters."""
        return self._stats.copy()

    # ---------------------------------------------------------------- mutations

    def allocate(self, n: int) -> list[Block]:
        """Hand out ``n`` empty HBM blocks with ``ref_cnt == 1``.

        Blocks come from the head of the HBM free queue; one still holding a
        cached key is evicted at this moment (demoted down the tiers, or
        dropped), with events.

        Raises:
            PoolExhaustedError: Fewer than ``n`` blocks are allocatable; nothing changed.
            PoolError: ``n`` is not a non-negative int.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PoolError(f"allocate needs a non-negative int, got {n!r}")
        free = len(self._queues[Medium.HBM]) + self._fresh[Medium.HBM]
        if n > free:
            raise PoolExhaustedError(f"need {n} HBM blocks, {free} allocatable")
        self._stats.allocations += n
        take = self._take_hbm
        return [take() for _ in range(n)]

    def acquire(self, blocks: Sequence[Block]) -> list[Block]:
        """Take one reference on each matched block; return the HBM blocks for the block table.

        HBM blocks gain a reference (leaving the free queue if they were
        unused). DRAM/SSD blocks are promoted: a fresh HBM block is taken, the
        bytes copied up and the lower slot freed (events ``removed{lower}``
        then ``stored{hbm}``). Every block being acquired is pinned before the
        first promotion, so the eviction cascade a promotion may cause never
        evicts one of them.

        If every slot of the lower tiers is being promoted, an HBM block evicted
        to make room has nowhere to go and is dropped.

        Call it right after :meth:`match_prefix`: a matched block evicted by a
        mutation in between is refused, but one evicted *and re-cached under
        another key* cannot be told apart.

        Args:
            blocks: Blocks from :meth:`match_prefix` (any subsequence, each at most once).

        Returns:
            One HBM block per input block, in the same order.

        Raises:
            PoolExhaustedError: HBM cannot take the promotions; nothing changed.
            PoolError: A block is foreign, repeated or no longer cached under its key
                (evicted since it was matched); nothing changed.
        """
        hbm_queue = self._queues[Medium.HBM]
        seen: set[int] = set()
        unused_hbm = promotions = 0
        cached = self._cached
        for block in blocks:
            if block.key is None or cached.get(block.key) is not block or not self._owns(block):
                raise PoolError(f"{block!r} is not a cached block of this pool (stale match?)")
            if id(block) in seen:
                raise PoolError(f"block {block.block_id} ({block.medium}) acquired twice")
            seen.add(id(block))
            if block.medium is not Medium.HBM:
                promotions += 1
            elif block.ref_cnt == 0:
                unused_hbm += 1
        allocatable = len(hbm_queue) + self._fresh[Medium.HBM] - unused_hbm
        if promotions > allocatable:
            raise PoolExhaustedError(
                f"promoting {promotions} blocks needs {promotions} HBM blocks, "
                f"{allocatable} allocatable"
            )
        for block in blocks:
            if block.medium is Medium.HBM:
                if block.ref_cnt == 0:
                    hbm_queue.remove(block)
                block.ref_cnt += 1
            elif block.ref_cnt == 0:  # a reader's pin already took it out of its queue
                self._queues[block.medium].remove(block)
            self._stats.hits[block.medium] += 1
        return [b if b.medium is Medium.HBM else self._promote(b) for b in blocks]

    def pin(self, blocks: Sequence[Block]) -> list[Block]:
        """Take one reference on cached blocks, on any medium, so that nothing evicts,
        moves or overwrites their bytes while another party reads them (a KV transfer,
        outside the pool's thread); counted as no hit.

        A pinned DRAM/SSD block leaves its free queue, so no demotion reuses its slot.
        A request may still promote it (:meth:`acquire`): the key moves to HBM and the
        slot, keyless, waits out of its queue with its bytes intact until released.
        Release pins with :meth:`free`.

        Raises:
            PoolError: A block is not a cached block of this pool, or is repeated;
                nothing changed.
        """
        seen: set[int] = set()
        cached = self._cached
        for block in blocks:
            if block.key is None or cached.get(block.key) is not block or not self._owns(block):
                raise PoolError(f"{block!r} is not a cached block of this pool")
            if id(block) in seen:
                raise PoolError(f"block {block.block_id} ({block.medium}) pinned twice")
            seen.add(id(block))
        queues = self._queues
        for block in blocks:
            if block.ref_cnt == 0:
                queues[block.medium].remove(block)
            block.ref_cnt += 1
        return list(blocks)

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block (a request's HBM blocks, or pinned ones).

        A block reaching zero keeps its key (still matchable) and goes to the
        tail of its medium's free queue, evicted last; an uncached one goes to the
        head, reused first. Pass a request's blocks in reverse order so that its
        tail blocks are evicted before its prefix, as vLLM does.

        Raises:
            PoolError: A block is not a block of this pool, or would drop below
                zero references (double free); nothing changed.
        """
        all_blocks = self._blocks
        for done, block in enumerate(blocks):
            slots = all_blocks.get(block.medium) if type(block) is Block else None
            bid = block.block_id if slots is not None else -1
            ours = slots is not None and 0 <= bid < len(slots) and slots[bid] is block
            if not ours or block.ref_cnt <= 0:
                for undo in blocks[:done]:
                    undo.ref_cnt += 1
                if ours:
                    raise PoolError(
                        f"double free of {block.medium} block {bid} (ref_cnt {block.ref_cnt})"
                    )
                raise PoolError(f"{block!r} is not a block of this pool")
            block.ref_cnt -= 1
        queues = self._queues
        for block in blocks:
            queue = queues[block.medium]
            if block.ref_cnt == 0 and block not in queue:
                if block.key is None:
                    queue.appendleft(block)
                    self._empty[block.medium] += 1
                else:
                    queue.append(block)

    def cache_block(
        self,
        block: Block,
        key: int,
        parent: int | None,
        token_ids: list[int] | None = None,
        checksum: int | None = None,
    ) -> None:
        """Cache a full HBM block in use under ``key`` (event ``stored{[key], parent, hbm}``).

        ``token_ids`` (the block's tokens) go into the event when
        :attr:`event_token_ids` is set; callers that do not know them pass None.
        ``checksum`` is the block's checksum when the caller has verified it (a
        received block); otherwise the storage computes it now, if its bytes are in
        host memory (:meth:`TierStorage.checksum`).

        If ``key`` is already cached on some medium (another request computed
        the same block), the block stays uncached and no event is queued: it is
        simply reused once freed. Re-caching a block under its own key is a
        no-op. With caching disabled this does nothing.

        Raises:
            PoolError: The block is not an in-use HBM block of this pool, already holds
                another key, or ``key`` / ``parent`` / ``checksum`` is not a u64; nothing
                changed.
        """
        if not self._owns(block) or block.medium is not Medium.HBM:
            raise PoolError(f"only HBM blocks of this pool can be cached, got {block!r}")
        if block.ref_cnt < 1:
            raise PoolError(f"HBM block {block.block_id} is not in use; cache it before freeing")
        _check_key(key, "key")
        if parent is not None:
            _check_key(parent, "parent")
        if checksum is not None:
            _check_key(checksum, "checksum")
        if not self._caching or block.key == key:
            return
        if block.key is not None:
            raise PoolError(f"HBM block {block.block_id} is already cached under {block.key}")
        if key in self._cached:
            self._stats.duplicates += 1
            return
        block.key, block.parent = key, parent
        if checksum is None and self._storage is not None:
            checksum = self._storage.checksum(Medium.HBM, block.block_id)
        block.checksum = checksum
        self._cached[key] = block
        tokens = token_ids if self.event_token_ids else None
        self._events.append(BlockStored([key], parent, Medium.HBM, tokens))
        self._stats.stored += 1

    def note_checksum(self, block: Block, checksum: int) -> None:
        """Remember the checksum of a cached block's bytes, computed by a reader (a KV
        transfer of a block cached before its checksum was known: device memory, SSD
        restored at start).

        Raises:
            PoolError: The block is not a cached block of this pool, or ``checksum`` is
                not a u64; nothing changed.
        """
        if block.key is None or self._cached.get(block.key) is not block or not self._owns(block):
            raise PoolError(f"{block!r} is not a cached block of this pool")
        _check_key(checksum, "checksum")
        block.checksum = checksum

    def clear_cache(self) -> bool:
        """Forget every cached key on every medium, and queue ``cleared{}``.

        Always succeeds, unlike vLLM's ``reset_prefix_cache`` which refuses while
        blocks are in use: a block in use keeps its bytes for the request using
        it but loses its key, so nothing computed before the clear (e.g. with
        old weights) can ever be matched again. The SSD manifest is emptied too.

        Returns:
            True if any key was cached (the event is queued either way).
        """
        had_keys = bool(self._cached)
        for block in self._cached.values():
            block.key = block.parent = block.checksum = None
        self._cached.clear()
        for m in MEDIA:
            self._empty[m] = len(self._queues[m]) + self._fresh[m]
        if self._storage is not None:
            self._storage.record_cleared()
        self._events.append(AllCleared())
        return had_keys

    def take_events(self) -> list[Event]:
        """Drain the events queued since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def verify(self) -> None:
        """Check every internal invariant (O(capacity)); for tests and debugging.

        Raises:
            PoolError: Naming the first invariant found broken.
        """
        keyed = 0
        for m in MEDIA:
            queue, blocks = self._queues[m], self._blocks[m]
            if len(blocks) + self._fresh[m] != self._capacity.of(m) or self._fresh[m] < 0:
                raise PoolError(f"{m}: {len(blocks)} slots made + {self._fresh[m]} unused "
                                f"!= capacity {self._capacity.of(m)}")  # fmt: skip
            queued = list(queue)
            if len(queued) != len(queue) or len({id(b) for b in queued}) != len(queued):
                raise PoolError(f"{m} free queue length or links are corrupt")
            prev: Block | None = None
            for b in queued:
                if (
                    b.prev_free is not prev
                    or b.medium is not m
                    or self._blocks[m][b.block_id] is not b
                ):
                    raise PoolError(f"{m} free queue holds a foreign or mislinked block")
                prev = b
            in_queue = {id(b) for b in queued}
            for b in blocks:
                if b.ref_cnt < 0:
                    raise PoolError(f"{m} block {b.block_id} has ref_cnt {b.ref_cnt}")
                if (b.ref_cnt == 0) != (id(b) in in_queue):
                    raise PoolError(f"{m} block {b.block_id}: queued iff unreferenced is broken")
                if b.key is None and b.checksum is not None:
                    raise PoolError(f"{m} block {b.block_id} keeps a checksum without a key")
                if b.key is not None:
                    keyed += 1
                    if self._cached.get(b.key) is not b:
                        raise PoolError(
                            f"{m} block {b.block_id} holds key {b.key} not mapped to it"
                        )
            empty = sum(1 for b in queued if b.key is None) + self._fresh[m]
            if empty != self._empty[m]:
                raise PoolError(f"{m} empty count {self._empty[m]} != actual {empty}")
        if keyed != len(self._cached):
            raise PoolError(f"{len(self._cached)} keys mapped but {keyed} blocks hold a key")

    # ---------------------------------------------------------------- internals

    def _owns(self, block: object) -> bool:
        if not isinstance(block, Block):
            return False
        blocks = self._blocks.get(block.medium)
        return (
            blocks is not None
            and 0 <= block.block_id < len(blocks)
            and blocks[block.block_id] is block
        )

    def _pop(self, medium: Medium) -> Block:
        """The next free slot of ``medium``: a never-used one if any, else the queue head."""
        if self._fresh[medium]:
            blocks = self._blocks[medium]
            block = Block(len(blocks), medium)
            blocks.append(block)
            self._fresh[medium] -= 1
            return block
        return self._queues[medium].popleft()

    def _materialize(self, medium: Medium) -> None:
        """Create every never-used slot of ``medium`` now, queued as empty slots."""
        blocks, queue = self._blocks[medium], self._queues[medium]
        while self._fresh[medium]:
            block = Block(len(blocks), medium)
            blocks.append(block)
            queue.appendleft(block)
            self._fresh[medium] -= 1

    def _take_hbm(self) -> Block:
        """Pop the HBM free queue head, evicting its key if it has one; return it referenced."""
        block = self._pop(Medium.HBM)
        if block.key is None:
            self._empty[Medium.HBM] -= 1
        else:
            self._evict(block)
        block.ref_cnt = 1
        return block

    def _lower_slot(self, medium: Medium) -> Block | None:
        """An emptied slot on the nearest configured tier below ``medium`` that has one unpinned."""
        for low in self._lower[medium]:
            if len(self._queues[low]) or self._fresh[low]:
                slot = self._pop(low)
                if slot.key is None:
                    self._empty[low] -= 1
                else:
                    self._evict(slot)
                return slot
        return None

    def _evict(self, block: Block) -> None:
        """Move ``block``'s key and bytes down a tier, or drop them; leaves ``block`` empty."""
        key, parent, src = block.key, block.parent, block.medium
        assert key is not None
        target = self._lower_slot(src)
        storage = self._storage
        self._events.append(BlockRemoved(keys=[key], medium=src))
        if target is None:
            del self._cached[key]
            if storage is not None:
                storage.record_freed(src, block.block_id)
            self._stats.evictions[src] += 1
        else:
            dst = target.medium
            if storage is not None:
                storage.copy_block(src, block.block_id, dst, target.block_id)
                storage.record_freed(src, block.block_id)
                storage.record_stored(dst, target.block_id, key, parent)
            target.key, target.parent, target.checksum = key, parent, block.checksum
            self._cached[key] = target
            self._queues[dst].append(target)
            self._events.append(BlockStored(keys=[key], parent=parent, medium=dst))
            self._stats.demotions[src] += 1
        block.key = block.parent = block.checksum = None

    def _promote(self, lower: Block) -> Block:
        """Move a pinned DRAM/SSD block's key and bytes into a fresh HBM block."""
        key, parent, src = lower.key, lower.parent, lower.medium
        assert key is not None
        block = self._take_hbm()
        if self._storage is not None:
            self._storage.copy_block(src, lower.block_id, Medium.HBM, block.block_id)
            self._storage.record_freed(src, lower.block_id)
        block.key, block.parent, block.checksum = key, parent, lower.checksum
        lower.key = lower.parent = lower.checksum = None
        if lower.ref_cnt == 0:  # else a reader still holds the slot: freed once it is done
            self._queues[src].appendleft(lower)
            self._empty[src] += 1
        self._cached[key] = block
        self._events.append(BlockRemoved(keys=[key], medium=src))
        self._events.append(BlockStored(keys=[key], parent=parent, medium=Medium.HBM))
        self._stats.promotions[src] += 1
        return block

    def _restore(self, entries: Iterable[SSDEntry]) -> None:
        """Cache the keys the SSD manifest holds, oldest first, and announce them."""
        self._materialize(Medium.SSD)
        queue, slots = self._queues[Medium.SSD], self._blocks[Medium.SSD]
        for entry in entries:
            slot = slots[entry.slot]
            queue.remove(slot)
            queue.append(slot)
            slot.key, slot.parent = entry.key, entry.parent
            self._cached[entry.key] = slot
            self._empty[Medium.SSD] -= 1
            self._events.append(
                BlockStored(keys=[entry.key], parent=entry.parent, medium=Medium.SSD)
            )
