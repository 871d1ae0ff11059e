"""Block keys: the one hash that names a block of KV cache everywhere.

Contract (DESIGN.md, "Block keys"): only full blocks are keyed. The key of
block ``i`` is::

    xxh3_64(le64(parent) ++ le32(token_0) ++ ... ++ le32(token_{B-1}), seed=0)

where ``parent`` is the key of block ``i - 1`` and, for the first block, the
*root parent*::

    xxh3_64(utf8(model + "\\0" + lora_name + "\\0" + cache_salt), seed=0)

Keys are unsigned 64-bit integers. Because every key folds in its parent,
two prompts share the key of block ``i`` only if they share all tokens of
blocks ``0..i``: a key names a whole prefix, not a chunk of text.

Every component (worker, indexer, router, simulator) calls these functions;
nothing re-implements them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

__all__ = [
    "BlockKeyError",
    "block_keys",
    "chained_prefix",
    "hash_block",
    "num_full_blocks",
    "root_parent",
]

_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF


class BlockKeyError(ValueError):
    """Raised for inputs that cannot be keyed (bad block size, token out of u32 range)."""


def root_parent(model: str, lora_name: str = "", cache_salt: str = "") -> int:
    """Return the parent key of a sequence's first block.

    Args:
        model: The served model name; part of the key so two models never share blocks.
        lora_name: The LoRA adapter name, or "" for the base model.
        cache_salt: A per-tenant salt, or "" for none (isolates tenants' caches).
    """
    data = f"{model}\0{lora_name}\0{cache_salt}".encode()
    return xxhash.xxh3_64_intdigest(data, seed=0)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """Number of full blocks in ``num_tokens`` tokens; a trailing partial block gets no key."""
    if block_size <= 0:
        raise BlockKeyError(f"block_size must be positive, got {block_size}")
    return num_tokens // block_size


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        buf = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise BlockKeyError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if buf.itemsize != 4:  # pragma: no cover - every platform we support has 4-byte "I"
        buf = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts only
        buf.byteswap()
    return buf.tobytes()


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Key of one full block given its parent key and exactly its tokens."""
    if not 0 <= parent <= _U64_MAX:
        raise BlockKeyError(f"parent key must be an unsigned 64-bit integer, got {parent}")
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + _token_bytes(token_ids), seed=0)


def block_keys(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Keys of every full block of ``token_ids``, chained from ``parent``.

    Args:
        token_ids: The sequence's tokens (each in ``[0, 2**32)``).
        block_size: Tokens per block (``B``); one value per model in a cluster.
        parent: ``root_parent(...)`` for a sequence's start, or the key of the
            block just before ``token_ids[0]`` to extend an existing chain.

    Returns:
        One key per full block, in order; the trailing partial block has none.
    """
    n = num_full_blocks(len(token_ids), block_size)
    if n == 0:
        return []
    if not 0 <= parent <= _U64_MAX:
        raise BlockKeyError(f"parent key must be an unsigned 64-bit integer, got {parent}")
    data = _token_bytes(token_ids[: n * block_size])
    stride = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    for i in range(n):
        parent = digest(parent.to_bytes(8, "little") + data[i * stride : (i + 1) * stride], seed=0)
        keys.append(parent)
    return keys


def chained_prefix(n: int, holds: Callable[[int], bool]) -> int:
    """How many of blocks ``0..n-1`` of a key chain have a property that, held by a
    block, every block before it has too (``holds(i)`` for block ``i``).

    Keys name whole prefixes, so much of what is true of a block is true of its
    ancestors: a request holding block ``i`` holds blocks ``0..i``, a chain recorded
    whole is recorded up to every key. Such a property holds on a prefix of the chain,
    and a binary search finds its end in ``log2(n)`` calls.
    """
    lo, hi = 0, max(n, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo
