"""Binary KV block transfer between workers: the wire format, its validation, and the pool side.

A transfer is one HTTP response body::

    b"KVX1" | u32 header length (big-endian) | header (msgpack) | block 0 | block 1 | ...

The header (:class:`TransferHeader`) names the model, block size, KV dtype,
per-block shape and byte size, the blocks' keys (a contiguous run of one
prefix chain), the parent key of the first, and one xxh3-64 checksum per
block. Each block is ``block_bytes`` raw bytes, all layers contiguous
(:mod:`engine_worker.kv_layout`), in key order. Nothing is ever unpickled:
the header is msgpack decoded into a typed struct, the blocks are bytes.

The receiver validates everything before a single block enters its pool
(:func:`read_transfer`): magic and header size, model, block size, dtype,
shape and byte size against its own layout, that the keys are a prefix of
what it asked for, the exact byte count (a truncated or overlong stream is
refused) and every checksum. A refused transfer raises :class:`TransferError`
whose ``reason`` labels the worker's failure metric; the caller recomputes.

Serving reads every requested block in one call on the engine thread, between
two steps (:func:`export_blocks`): the scheduler cannot evict or overwrite a
block while it is being copied out, so a transfer is never torn, and the
response streams from that copy. Requests are capped at
:data:`MAX_TRANSFER_BLOCKS` blocks; a client pulls longer runs in windows.
Imported blocks (:func:`import_blocks`) are written into fresh HBM blocks and
cached under their keys, so the pool announces them with ``stored`` events
like any block it computed, then released to the free queue like a finished
request's prefix.

Workers with the ``sim`` runner hold no bytes: their transfers carry the
header alone (``dtype`` ``"none"``, zero-byte blocks), which moves the blocks'
metadata, as the simulated pool needs.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import xxhash

from engine_worker.block_pool import BlockPool
from engine_worker.kv_layout import DTYPE_SIZES, KVLayout
from indexer.media import Medium

if TYPE_CHECKING:
    from engine_worker.tiers import TierStorage

__all__ = [
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_TRANSFER_BLOCKS",
    "Expected",
    "TransferError",
    "TransferHeader",
    "encode_transfer",
    "expected_for",
    "export_blocks",
    "import_blocks",
    "read_transfer",
]

MAGIC = b"KVX1"
_PREFIX = struct.Struct(">4sI")
#: Largest header accepted (keys and checksums of MAX_TRANSFER_BLOCKS blocks fit easily).
MAX_HEADER_BYTES = 1 << 20
#: Blocks one transfer serves at most; a client pulls longer runs in windows.
MAX_TRANSFER_BLOCKS = 4096
#: The dtype of a transfer from a worker without KV bytes (the sim runner).
NO_BYTES = "none"


class TransferError(Exception):
    """A transfer refused or failed; ``reason`` is a short label (metrics, logs)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class TransferHeader(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What precedes the blocks of a transfer (see the module docstring)."""

    model: str
    block_size: int
    dtype: str
    block_shape: list[int]
    block_bytes: int
    parent: int | None
    keys: list[int]
    checksums: list[int]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferHeader)


@dataclass(frozen=True, slots=True)
class Expected:
    """What a receiver accepts: its own model and layout, and the keys it asked for."""

    model: str
    block_size: int
    dtype: str
    block_shape: tuple[int, ...]
    block_bytes: int
    keys: tuple[int, ...]


def _geometry(layout: KVLayout | None, block_size: int) -> tuple[str, tuple[int, ...], int]:
    if layout is None:
        return NO_BYTES, (), 0
    if layout.block_size != block_size:
        raise ValueError(f"layout block size {layout.block_size} != {block_size}")
    return layout.dtype, layout.block_shape, layout.block_bytes


def expected_for(
    model: str, block_size: int, layout: KVLayout | None, keys: Sequence[int]
) -> Expected:
    """The :class:`Expected` of a worker with ``layout`` (None: no bytes) asking for ``keys``."""
    dtype, shape, size = _geometry(layout, block_size)
    return Expected(model, block_size, dtype, shape, size, tuple(keys))


def encode_transfer(header: TransferHeader) -> bytes:
    """The magic, length and header bytes that open a transfer."""
    body = _encoder.encode(header)
    return _PREFIX.pack(MAGIC, len(body)) + body


def checksum(block: bytes | memoryview) -> int:
    """xxh3-64 of one block's bytes."""
    return xxhash.xxh3_64_intdigest(block)


def export_blocks(
    pool: BlockPool,
    storage: TierStorage | None,
    model: str,
    block_size: int,
    keys: Sequence[int],
) -> tuple[TransferHeader, list[bytes]]:
    """The longest cached run of ``keys`` (from the first) as a header and block bytes.

    Runs on the engine thread, between steps: the blocks are copied out before
    the scheduler runs again. Serves fewer keys than asked (possibly none) when
    the pool lacks the rest.
    """
    if len(keys) > MAX_TRANSFER_BLOCKS:
        raise TransferError("count", f"{len(keys)} blocks asked, at most {MAX_TRANSFER_BLOCKS}")
    layout = storage.layout if storage is not None else None
    dtype, shape, size = _geometry(layout, block_size)
    blocks = pool.match_prefix(keys)
    datas: list[bytes] = []
    for block in blocks:
        datas.append(b"" if storage is None else storage.read_bytes(block.medium, block.block_id))
    header = TransferHeader(
        model=model,
        block_size=block_size,
        dtype=dtype,
        block_shape=list(shape),
        block_bytes=size,
        parent=blocks[0].parent if blocks else None,
        keys=[b.key for b in blocks if b.key is not None],
        checksums=[checksum(d) for d in datas],
    )
    return header, datas


class _Reader:
    """Exact-size reads over an async stream of chunks (one copy per read)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = bytearray()
        self._pos = 0
        self._done = False

    async def _fill(self, n: int) -> None:
        while len(self._buffer) - self._pos < n and not self._done:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                self._done = True
                break
            if self._pos and self._pos >= len(self._buffer) // 2:
                del self._buffer[: self._pos]
                self._pos = 0
            self._buffer += chunk

    async def read(self, n: int, what: str) -> bytes:
        await self._fill(n)
        have = len(self._buffer) - self._pos
        if have < n:
            raise TransferError("truncated", f"stream ended {n - have} bytes short in the {what}")
        out = bytes(memoryview(self._buffer)[self._pos : self._pos + n])
        self._pos += n
        return out

    async def at_end(self) -> bool:
        await self._fill(1)
        return len(self._buffer) == self._pos


class _StreamReader:
    """Exact-size reads over an asyncio stream (the raw TCP data path), after ``head``."""

    def __init__(self, stream: asyncio.StreamReader, head: bytes = b"") -> None:
        self._stream = stream
        self._head = head

    async def read(self, n: int, what: str) -> bytes:
        take, self._head = self._head[:n], self._head[n:]
        try:
            return take + await self._stream.readexactly(n - len(take)) if n > len(take) else take
        except asyncio.IncompleteReadError as exc:
            missing = n - len(exc.partial)
            raise TransferError(
                "truncated", f"stream ended {missing} bytes short in the {what}"
            ) from None

    async def at_end(self) -> bool:
        return await self._stream.read(1) == b""


async def read_transfer(
    source: AsyncIterator[bytes] | asyncio.StreamReader, expected: Expected, head: bytes = b""
) -> tuple[TransferHeader, list[bytes]]:
    """Read and validate one transfer; nothing is returned unless all of it is valid.

    ``source`` is an HTTP body's chunks or a socket's stream (whose first bytes,
    already read, are ``head``).

    Raises:
        TransferError: ``reason`` one of ``magic``, ``header``, ``model``, ``block_size``,
            ``dtype``, ``shape``, ``count``, ``keys``, ``truncated``, ``trailing``,
            ``checksum``.
    """
    reader: _Reader | _StreamReader
    if isinstance(source, asyncio.StreamReader):
        reader = _StreamReader(source, head)
    else:
        reader = _Reader(source)
    magic, length = _PREFIX.unpack(await reader.read(_PREFIX.size, "prefix"))
    if magic != MAGIC:
        raise TransferError("magic", f"not a KV transfer (magic {magic!r})")
    if length > MAX_HEADER_BYTES:
        raise TransferError("header", f"header of {length} bytes > {MAX_HEADER_BYTES}")
    try:
        header = _decoder.decode(await reader.read(length, "header"))
    except msgspec.MsgspecError as exc:
        raise TransferError("header", f"bad header: {exc}") from exc
    _check_header(header, expected)
    blocks = []
    for i, key in enumerate(header.keys):
        data = await reader.read(header.block_bytes, f"block {i}")
        if checksum(data) != header.checksums[i]:
            raise TransferError("checksum", f"block {i} (key {key}) fails its checksum")
        blocks.append(data)
    if not await reader.at_end():
        raise TransferError("trailing", "bytes after the last block")
    return header, blocks


def _check_header(h: TransferHeader, e: Expected) -> None:
    if h.model != e.model:
        raise TransferError("model", f"blocks of model {h.model!r}, this worker runs {e.model!r}")
    if h.block_size != e.block_size:
        raise TransferError("block_size", f"block size {h.block_size}, expected {e.block_size}")
    if h.dtype != e.dtype:
        raise TransferError("dtype", f"KV dtype {h.dtype!r}, expected {e.dtype!r}")
    if tuple(h.block_shape) != e.block_shape or h.block_bytes != e.block_bytes:
        raise TransferError(
            "shape",
            f"blocks {h.block_shape} of {h.block_bytes} bytes, "
            f"expected {list(e.block_shape)} of {e.block_bytes}",
        )
    elements = math.prod(h.block_shape) if h.block_shape else 0
    if h.block_bytes != elements * DTYPE_SIZES.get(h.dtype, 0):
        raise TransferError("shape", f"{h.block_bytes} bytes do not hold {h.block_shape}")
    if len(h.checksums) != len(h.keys) or len(h.keys) > len(e.keys):
        raise TransferError(
            "count", f"{len(h.keys)} keys, {len(h.checksums)} checksums, {len(e.keys)} asked"
        )
    if tuple(h.keys) != e.keys[: len(h.keys)]:
        raise TransferError("keys", "the blocks served are not the ones asked for, in order")


def import_blocks(
    pool: BlockPool,
    storage: TierStorage | None,
    parent: int | None,
    keys: Sequence[int],
    blocks: Sequence[bytes],
) -> int:
    """Cache transferred blocks in HBM as if computed here; returns how many were added.

    Runs on the engine thread. Keys the pool caches already (computed meanwhile)
    are skipped; the rest get fresh HBM blocks (evicting as an allocation does),
    their bytes, and their keys (``stored`` events), then go to the free queue
    as cached blocks. Imports only what fits in HBM now, in order, without evicting
    the run's blocks already in HBM.
    """
    todo = []
    held = []
    prev = parent
    for key, data in zip(keys, blocks, strict=True):
        cached = pool.match_prefix([key])
        if not cached:
            todo.append((key, prev, data))
        elif cached[0].medium is Medium.HBM:
            held.append(cached[0])
        prev = key
    # The run's blocks already here stay put while fresh blocks are taken for the rest.
    pinned = pool.acquire(held)
    fresh = []
    try:
        fresh = pool.allocate(min(len(todo), pool.num_free(Medium.HBM)))
        for block, (key, block_parent, data) in zip(fresh, todo, strict=False):
            if storage is not None:
                storage.write_bytes(Medium.HBM, block.block_id, data)
            pool.cache_block(block, key, block_parent)
    finally:
        pool.free(fresh[::-1])
        pool.free(pinned[::-1])
    return len(fresh)
