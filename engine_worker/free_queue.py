"""Block metadata and the LRU free queue of one medium's blocks (an intrusive linked list).

Every block with no reference sits in its medium's free queue, ordered by
eviction priority: the head is evicted (or handed out) first, the tail last.
A freed block that still holds a cached key goes to the tail (most recently
used); a block with nothing worth keeping goes to the head, so allocation
uses it before evicting anything.

The links live inside the blocks themselves (``prev_free`` / ``next_free``),
as in vLLM v1's ``FreeKVCacheBlockQueue``, so that taking a block *out of
the middle* -- a prefix hit on a cached block that is waiting to be evicted
-- is O(1) without any lookup::

    head -> [b7] <-> [b2] <-> [b9] <-> [b4] <- tail
            evict first              most recently used

A ``collections.deque`` cannot remove from the middle in O(1), and an
``OrderedDict`` costs a hash lookup and a node allocation per operation;
the intrusive list costs four pointer writes. Membership is O(1) too: a
block is queued iff it has a neighbour or is the lone head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from indexer.media import Medium

__all__ = ["Block", "FreeBlockQueue", "FreeQueueError"]


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one slot of one medium; never holds a tensor.

    Attributes:
        block_id: Slot index inside its medium's storage; HBM ids go in block tables.
        medium: The medium this slot belongs to (fixed for the slot's life).
        ref_cnt: Requests using the block (HBM only) plus readers pinning it (any medium).
        key: Block key once the block is full and cached, else None.
        parent: Key of the block before it (the root parent for a first block).
        checksum: xxh3-64 of the block's bytes while it holds ``key``, when known (see
            :mod:`engine_worker.block_checksum`); None otherwise.
        prev_free: Previous block in the medium's free queue (intrusive link).
        next_free: Next block in the medium's free queue (intrusive link).
    """

    block_id: int
    medium: Medium
    ref_cnt: int = 0
    key: int | None = None
    parent: int | None = None
    checksum: int | None = None
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeQueueError(RuntimeError):
    """Bad use of the queue: popping an empty queue, queueing a block twice, removing a stranger."""


class FreeBlockQueue:
    """O(1) append / appendleft / popleft / remove over blocks' intrusive links.

    Args:
        blocks: Initial content, head first.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head: Block | None = None
        self._tail: Block | None = None
        self._len = 0
        prev: Block | None = None
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None or self._head is block:
                raise FreeQueueError(f"block {block.block_id} is already queued")
            block.prev_free = prev
            if prev is None:
                self._head = block
            else:
                prev.next_free = block
            prev = block
            self._len += 1
        self._tail = prev

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        """Blocks from head (evicted first) to tail (most recently used)."""
        node = self._head
        while node is not None:
            yield node
            node = node.next_free

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None or block.next_free is not None or self._head is block

    def head(self) -> Block | None:
        """The block the next ``popleft`` returns, or None when empty."""
        return self._head

    def append(self, block: Block) -> None:
        """Queue ``block`` at the tail (evicted last)."""
        if block.prev_free is not None or block.next_free is not None or self._head is block:
            raise FreeQueueError(f"block {block.block_id} is already queued")
        tail = self._tail
        block.prev_free = tail
        if tail is None:
            self._head = block
        else:
            tail.next_free = block
        self._tail = block
        self._len += 1

    def appendleft(self, block: Block) -> None:
        """Queue ``block`` at the head (handed out or evicted first)."""
        if block.prev_free is not None or block.next_free is not None or self._head is block:
            raise FreeQueueError(f"block {block.block_id} is already queued")
        head = self._head
        block.next_free = head
        if head is None:
            self._tail = block
        else:
            head.prev_free = block
        self._head = block
        self._len += 1

    def popleft(self) -> Block:
        """Unlink and return the head block."""
        block = self._head
        if block is None:
            raise FreeQueueError("pop from an empty free queue")
        nxt = block.next_free
        self._head = nxt
        if nxt is None:
            self._tail = None
        else:
            nxt.prev_free = None
            block.next_free = None
        self._len -= 1
        return block

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from wherever it sits in the queue."""
        if block not in self:
            raise FreeQueueError(f"block {block.block_id} is not queued")
        prev, nxt = block.prev_free, block.next_free
        if (prev is None and self._head is not block) or (nxt is None and self._tail is not block):
            raise FreeQueueError(f"block {block.block_id} is linked into another queue")
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1
