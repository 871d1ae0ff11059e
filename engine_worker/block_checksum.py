"""The checksum of one KV block's bytes: what a transfer carries per block.

``xxh3_64`` (seed 0) of the block's raw bytes, all layers, as they sit in
memory (:mod:`engine_worker.kv_layout`). A sender names one per block in the
transfer header and the receiver recomputes it on every block that lands
(:mod:`engine_worker.kv_transfer`).

NOTE: a cached block's bytes never change while it holds its key (a hit is
never written again: the scheduler recomputes a fully cached prompt's last
block into a fresh one), so the pool keeps the checksum beside the key
(:attr:`~engine_worker.free_queue.Block.checksum`), taken when the block is
cached, carried along when the bytes are copied to another tier, and dropped
with the key. A sender therefore reads each block once, to send it, instead
of hashing all of them before its first byte (~20 ms for 94 MB at the ~4 GB/s
memory speed of a busy host). A stale checksum can only make a receiver refuse
a transfer, never accept wrong bytes.
"""

from __future__ import annotations

import xxhash

__all__ = ["block_checksum"]


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of one block's bytes (releases the GIL while it hashes)."""
    return xxhash.xxh3_64_intdigest(data)
