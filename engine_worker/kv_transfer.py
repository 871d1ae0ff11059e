"""Binary KV block transfer between workers: the wire format, its validation, and the pool side.

A transfer is one stream (over the data socket, :mod:`engine_worker.kv_socket`, or an
HTTP response body)::

    b"KVX1" | u32 header length (big-endian) | header (msgpack) | block 0 | block 1 | ...

The header (:class:`TransferHeader`) names the model, block size, KV dtype,
per-block shape and byte size, the blocks' keys (a contiguous run of one
prefix chain), the parent key of the first, one xxh3-64 checksum per
block and, when not 0, how many blocks the source reads off its storage as
it streams them (``streamed``). Each block is ``block_bytes`` raw bytes, all
layers contiguous (:mod:`engine_worker.kv_layout`), in key order. Nothing is
ever unpickled: the header is msgpack decoded into a typed struct, the blocks
are bytes.

The receiver validates everything before a single block enters its pool
(:func:`read_transfer`): magic and header size, model, block size, dtype,
shape and byte size against its own layout, that the keys are a prefix of
what it asked for, the exact byte count (a truncated or overlong stream is
refused) and every checksum. A refused transfer raises :class:`TransferError`
whose ``reason`` labels the worker's failure metric; the caller recomputes.

Serving pins every requested block in one pool call, under the scheduler
lock (:func:`export_pinned`, :meth:`~engine_worker.engine.EngineLoop.pool_call`),
on whatever medium it sits: the scheduler cannot evict, move or overwrite a
pinned block's bytes until the transfer ends, so a transfer is never torn.
Blocks in host memory (HBM on a CPU worker, DRAM) are sent from where they
are; SSD blocks, and blocks in device memory (a GPU's HBM), are read by the
sender, off the engine thread and outside the lock, so a large read never holds
up the source's steps (a device copy still takes its turn on the GPU's default
stream, between the engine's kernels): one at a time as they are sent, after
the header (:meth:`Outgoing.stream_header`, :meth:`Outgoing.take`; over the data
socket or in an HTTP body), so that reading and sending overlap and a pull takes
about the longer of the two, not their sum, and a sender holds one block it read
at a time. The
checksums come from the pool, which keeps one per cached block
(:mod:`engine_worker.block_checksum`); only blocks cached without one (device
memory, SSD restored at start) are hashed, by the sender, and the pool
remembers them when the transfer closes. Requests are capped
at :data:`MAX_TRANSFER_BLOCKS` blocks; a client pulls longer runs in windows.
A receiver reserves fresh HBM blocks for the keys it lacks
(:func:`reserve_import`, as soon as it knows which: before it asks) and
receives each block straight into one, checking its checksum as it lands; only
when the whole transfer is valid are they cached under their keys, with those
checksums (:meth:`Reservation.commit`), so the pool announces them with
``stored`` events like any block it computed, then releases them to the free
queue like a finished request's prefix. A refused transfer gives them back
uncached (:meth:`Reservation.abort`): bytes that failed a check are never used.

Workers with the ``sim`` runner hold no bytes: their transfers carry the
header alone (``dtype`` ``"none"``, zero-byte blocks), which moves the blocks'
metadata, as the simulated pool needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import socket
import struct
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import msgspec

from engine_worker.block_checksum import block_checksum
from engine_worker.block_pool import Block, BlockPool
from engine_worker.kv_layout import DTYPE_SIZES, KVLayout
from indexer.media import Medium

if TYPE_CHECKING:
    from engine_worker.tiers import TierStorage

__all__ = [
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_TRANSFER_BLOCKS",
    "Expected",
    "Landing",
    "Outgoing",
    "Reservation",
    "SocketReader",
    "TransferError",
    "TransferHeader",
    "check_block",
    "checksum",
    "encode_transfer",
    "expected_for",
    "export_blocks",
    "export_pinned",
    "fresh_views",
    "import_blocks",
    "in_thread",
    "read_header",
    "read_transfer",
    "reserve_import",
    "transfer_chunks",
]

_T = TypeVar("_T")

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


class TransferHeader(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    """What precedes the blocks of a transfer (see the module docstring).

    ``streamed`` counts the blocks the source reads off its storage after sending this
    header, as it streams (0, left out of the encoding: every block was in memory).
    Those reads pace the stream, so a receiver does not take its time for the network's.
    """

    model: str
    block_size: int
    dtype: str
    block_shape: list[int]
    block_bytes: int
    parent: int | None
    keys: list[int]
    checksums: list[int]
    streamed: int = 0


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


#: xxh3-64 of one block's bytes (:func:`engine_worker.block_checksum.block_checksum`).
checksum = block_checksum


def check_block(header: TransferHeader, i: int, data: memoryview) -> None:
    """Refuse block ``i`` of a transfer unless ``data`` matches its checksum.

    Raises:
        TransferError: ``checksum``.
    """
    if block_checksum(data) != header.checksums[i]:
        raise TransferError("checksum", f"block {i} (key {header.keys[i]}) fails its checksum")


@dataclass(slots=True)
class Outgoing:
    """One transfer ready to send: the header and one payload per block.

    Every block is pinned in the source's pool until :meth:`close`. Blocks in host
    memory are sent in place; SSD and device-memory blocks are read, and checksums the
    pool did not know are computed, off the engine thread by the sender: all before
    the header (:meth:`finish`), or the unhashed ones before it (:meth:`stream_header`)
    and the rest one by one as they are sent (:meth:`take`). Call :meth:`close` once
    the bytes are sent, on the thread that owns the pool (a worker wraps it).
    """

    header: TransferHeader
    payload: list[memoryview | bytes]
    on_close: Callable[[], None]
    #: Blocks still to read (index -> reader), and blocks whose checksum is unknown.
    reads: dict[int, Callable[[], memoryview | bytes]] = field(default_factory=dict)
    unhashed: list[int] = field(default_factory=list)
    #: Blocks :meth:`finish` hashed (their checksums are news for the pool).
    hashed: list[int] = field(default_factory=list)
    #: Blocks read off the SSD (of ``reads``; the others are in device memory).
    from_ssd: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        """Bytes of block data."""
        return self.header.block_bytes * len(self.header.keys)

    def finish(self) -> None:
        """Read what is still to read and hash what is unhashed (blocking: storage I/O;
        call it on a sender thread, while the blocks are pinned, i.e. before
        :meth:`close`). Idempotent."""
        for i in list(self.reads):
            self._read(i)
        self._hash()

    def stream_header(self) -> TransferHeader:
        """The header to send before the SSD reads are done, for a sender that reads each
        block as it streams (:meth:`take`): the blocks whose checksum the pool lacks are
        read and hashed now (a header carries every checksum), the other reads are left,
        and the header counts those off the SSD (``streamed``: a device-memory copy
        goes at the pace of host memory). Blocking, as :meth:`finish`."""
        for i in self.unhashed:
            self._read(i)
        self._hash()
        streamed = len(self.from_ssd.intersection(self.reads))
        if not streamed:
            return self.header
        return msgspec.structs.replace(self.header, streamed=streamed)

    def take(self, i: int) -> memoryview | bytes:
        """Block ``i``'s bytes for the last time, read off storage now if they are still
        to read (blocking; while the blocks are pinned), and not kept: a sender that
        streams each block once holds one block it read at a time, not the transfer."""
        self._read(i)
        data, self.payload[i] = self.payload[i], b""
        return data

    def _read(self, i: int) -> None:
        read = self.reads.pop(i, None)
        if read is not None:
            self.payload[i] = read()

    def _hash(self) -> None:
        checksums = self.header.checksums
        for i in self.unhashed:
            checksums[i] = block_checksum(self.payload[i])
        self.hashed += self.unhashed
        self.unhashed = []

    def close(self) -> None:
        """Release the pinned blocks (idempotent)."""
        on_close, self.on_close = self.on_close, _nothing
        on_close()


def _nothing() -> None:
    return None


def export_pinned(
    pool: BlockPool,
    storage: TierStorage | None,
    model: str,
    block_size: int,
    keys: Sequence[int],
) -> Outgoing:
    """The longest cached run of ``keys`` (from the first), pinned, ready to send.

    Runs under the scheduler lock (a pool call) and reads no block: blocks in host
    memory are sent from where they are (zero-copy), SSD and device-memory blocks are
    left for the sender to read (:meth:`Outgoing.finish`, or :meth:`Outgoing.take` as
    it streams). Checksums are the pool's; a block cached without one is hashed by the
    sender, and :meth:`Outgoing.close` tells the pool. Serves fewer keys than asked
    (possibly none) when the pool lacks the rest.
    """
    if len(keys) > MAX_TRANSFER_BLOCKS:
        raise TransferError("count", f"{len(keys)} blocks asked, at most {MAX_TRANSFER_BLOCKS}")
    layout = storage.layout if storage is not None else None
    dtype, shape, size = _geometry(layout, block_size)
    blocks = pool.match_prefix(keys)
    payload: list[memoryview | bytes] = []
    reads: dict[int, Callable[[], memoryview | bytes]] = {}
    from_ssd: set[int] = set()
    unhashed: list[int] = []
    checksums: list[int] = []
    for i, block in enumerate(blocks):
        view = None if storage is None else storage.block_view(block.medium, block.block_id)
        if storage is not None and view is None:  # on the SSD or in device memory
            reads[i] = functools.partial(storage.read_payload, block.medium, block.block_id)
            if block.medium is Medium.SSD:
                from_ssd.add(i)
        data = b"" if view is None else view
        payload.append(data)
        value = block.checksum
        if value is None:
            if storage is None:
                value = block_checksum(data)
                pool.note_checksum(block, value)
            else:
                unhashed.append(i)
                value = 0
        checksums.append(value)
    pinned = pool.pin(blocks)
    header = TransferHeader(
        model=model,
        block_size=block_size,
        dtype=dtype,
        block_shape=list(shape),
        block_bytes=size,
        parent=blocks[0].parent if blocks else None,
        keys=[b.key for b in blocks if b.key is not None],
        checksums=checksums,
    )
    out = Outgoing(header, payload, _nothing, reads, unhashed, from_ssd=from_ssd)

    def release() -> None:
        for i in out.hashed:  # still cached under its key: the pool keeps what was learned
            block = pinned[i]
            if block.key == header.keys[i] and block.checksum is None:
                pool.note_checksum(block, header.checksums[i])
        pool.free(pinned[::-1])

    out.on_close = release
    return out


def export_blocks(
    pool: BlockPool,
    storage: TierStorage | None,
    model: str,
    block_size: int,
    keys: Sequence[int],
) -> tuple[TransferHeader, list[bytes]]:
    """:func:`export_pinned`, every block copied out (for senders that outlive the step)."""
    out = export_pinned(pool, storage, model, block_size, keys)
    try:
        out.finish()
        return out.header, [bytes(p) for p in out.payload]
    finally:
        out.close()


async def in_thread(
    fn: Callable[[], _T],
    executor: ThreadPoolExecutor | None = None,
    timeout_s: float | None = None,
    abort: Callable[[], None] | None = None,
) -> _T:
    """Run ``fn``, blocking I/O, on ``executor`` (the loop's default: None); within
    ``timeout_s``.

    On a timeout or a cancellation ``abort`` is called (e.g. a socket shut down, which
    ends the thread's blocking call) and the thread is waited for before the error
    propagates: the caller may release the memory the thread reads or writes as soon as
    this returns.
    """
    done = asyncio.get_running_loop().run_in_executor(executor, fn)
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(done)
    except BaseException:
        if abort is not None:
            abort()
        while not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([done])
        if not done.cancelled():
            done.exception()  # retrieved: an error after an abort is expected
        raise


def transfer_chunks(out: Outgoing) -> AsyncGenerator[memoryview | bytes, None]:
    """``out`` as the chunks of a stream (an HTTP body): the header, then each block,
    those still to read (SSD, device memory) read on a thread just before they go
    (:meth:`Outgoing.stream_header`, :meth:`Outgoing.take`), so the stream holds one
    block it read at a time, not the run. ``out`` is closed (its pins dropped) when the
    stream ends, however it ends, once no read is running; also when it is dropped
    without ever being read (a caller gone before the first chunk)."""

    async def chunks() -> AsyncGenerator[memoryview | bytes, None]:
        try:
            header = await in_thread(out.stream_header)
            yield encode_transfer(header)
            for i in range(len(header.keys)):
                if i in out.reads:  # on the SSD or in device memory: read it off the loop
                    yield await in_thread(functools.partial(out.take, i))
                else:
                    yield out.take(i)
        finally:
            out.close()

    stream = chunks()
    weakref.finalize(stream, out.close)  # never started, its finally would never run
    return stream


class _ChunkReader:
    """Exact-size reads over an async stream of chunks (an HTTP body)."""

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
        out = bytearray(n)
        await self.read_into(memoryview(out), what)
        return bytes(out)

    async def read_into(self, view: memoryview, what: str) -> None:
        n = len(view)
        await self._fill(n)
        have = len(self._buffer) - self._pos
        if have < n:
            raise TransferError("truncated", f"stream ended {n - have} bytes short in the {what}")
        view[:] = memoryview(self._buffer)[self._pos : self._pos + n]
        self._pos += n

    async def at_end(self) -> bool:
        await self._fill(1)
        return len(self._buffer) == self._pos


class SocketReader:
    """Exact-size reads from a non-blocking socket straight into the caller's buffers
    (the data path: no intermediate buffer, as a raw ``recv_into`` loop)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._head = b""

    def push_back(self, data: bytes) -> None:
        """Make ``data`` (already read) the next bytes read."""
        self._head = data + self._head

    async def read(self, n: int, what: str) -> bytes:
        out = bytearray(n)
        await self.read_into(memoryview(out), what)
        return bytes(out)

    async def read_into(self, view: memoryview, what: str) -> None:
        got, n = 0, len(view)
        if self._head:
            got = min(n, len(self._head))
            view[:got] = self._head[:got]
            self._head = self._head[got:]
        while got < n:
            k = await self._loop.sock_recv_into(self._sock, view[got:])
            if k == 0:
                short = f"stream ended {n - got} bytes short in the {what}"
                raise TransferError("truncated", short)
            got += k

    async def at_end(self) -> bool:
        return not self._head and await self._loop.sock_recv(self._sock, 1) == b""


#: Where the blocks of a validated header are received: one writable view per block.
Landing = Callable[[TransferHeader], Awaitable[Sequence[memoryview]]]


async def read_header(reader: _ChunkReader | SocketReader, expected: Expected) -> TransferHeader:
    """Read and validate the magic, length and header of a transfer (see :func:`read_transfer`).

    Raises:
        TransferError: As :func:`read_transfer`, for the header.
    """
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
    return header


def fresh_views(header: TransferHeader) -> list[memoryview]:
    """One new buffer per block of ``header`` (where blocks land by default)."""
    size = header.block_bytes
    whole = memoryview(bytearray(size * len(header.keys)))
    return [whole[i * size : (i + 1) * size] for i in range(len(header.keys))]


async def read_transfer(
    source: AsyncIterator[bytes] | SocketReader, expected: Expected, land: Landing | None = None
) -> tuple[TransferHeader, Sequence[memoryview]]:
    """Read and validate one transfer; nothing is returned unless all of it is valid.

    ``source`` is an HTTP body's chunks or a :class:`SocketReader`. Once the header
    is valid, ``land`` says where each block's bytes go (a receiver's own block
    memory: see :func:`reserve_import`); by default into fresh buffers. Each block is
    checked against its checksum as soon as it has arrived.

    Raises:
        TransferError: ``reason`` one of ``magic``, ``header``, ``model``, ``block_size``,
            ``dtype``, ``shape``, ``count``, ``keys``, ``truncated``, ``trailing``,
            ``checksum``.
    """
    reader = source if isinstance(source, SocketReader) else _ChunkReader(source)
    header = await read_header(reader, expected)
    views = await land(header) if land is not None else fresh_views(header)
    for i in range(len(header.keys)):
        await reader.read_into(views[i], f"block {i}")
        check_block(header, i, views[i])
    if not await reader.at_end():
        raise TransferError("trailing", "bytes after the last block")
    return header, views


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
    if not 0 <= h.streamed <= len(h.keys):
        raise TransferError("count", f"{h.streamed} blocks streamed of {len(h.keys)}")
    if tuple(h.keys) != e.keys[: len(h.keys)]:
        raise TransferError("keys", "the blocks served are not the ones asked for, in order")


class Reservation:
    """Room in a receiver's pool for the blocks of one transfer (:func:`reserve_import`).

    ``views[i]`` is where block ``i`` of the run is to be received: the memory of a
    fresh HBM block when the pool lacks the key (in place when HBM is host memory, else
    a staging buffer), a scratch buffer otherwise (received and checked, then dropped).
    A receiver that reserves before it asks learns from the header how many of the
    keys arrive and the parent of the first (:meth:`land`). Nothing is cached until
    :meth:`commit`; :meth:`abort` gives the fresh blocks back uncached. Both run under
    the scheduler lock (pool calls), once.
    """

    def __init__(self, pool: BlockPool, storage: TierStorage | None, parent: int | None,
                 keys: Sequence[int], checksums: Sequence[int] | None = None) -> None:  # fmt: skip
        todo = []
        held = []
        prev = parent
        for i, key in enumerate(keys):
            cached = pool.match_prefix([key])
            if not cached:
                todo.append((i, key, prev))
            elif cached[0].medium is Medium.HBM:
                held.append(cached[0])
            prev = key
        size = storage.layout.block_bytes if storage is not None else 0
        scratch = memoryview(bytearray(size))
        self.keys = tuple(keys)
        self.views: list[memoryview] = [scratch] * len(keys)
        # The run's blocks already here stay put while fresh blocks are taken for the rest.
        self._pinned = pool.pin(held)
        self._fresh = pool.allocate(min(len(todo), pool.num_free(Medium.HBM)))
        self._todo: list[tuple[Block, int, int, int | None, memoryview | None]] = []
        for block, (i, key, block_parent) in zip(self._fresh, todo, strict=False):
            view = storage.block_view(Medium.HBM, block.block_id) if storage is not None else None
            staged = None
            if view is None:
                view = staged = memoryview(bytearray(size))
            self.views[i] = view
            self._todo.append((block, i, key, block_parent, staged))
        self._pool = pool
        self._storage = storage
        self._parent = parent
        self._arriving = len(keys)
        self._checksums: Sequence[int] = checksums or ()
        self._done = False

    def land(self, header: TransferHeader) -> list[memoryview]:
        """Where the blocks of ``header`` go; they are the leading keys of the reservation
        (the rest stays uncached), the first a child of ``header.parent``, and their
        checksums, verified as they land, are cached with them.

        Raises:
            TransferError: ``keys``: the header's keys do not lead the reserved ones.
        """
        n = len(header.keys)
        if tuple(header.keys) != self.keys[:n]:
            raise TransferError("keys", "the blocks served are not the ones reserved, in order")
        self._parent, self._arriving, self._checksums = header.parent, n, header.checksums
        return self.views[:n]

    def commit(self) -> int:
        """Cache the received blocks (``stored`` events) and release them; how many."""
        if self._done:
            return 0
        self._done = True
        cached = 0
        try:
            for block, i, key, parent, staged in self._todo:
                if i >= self._arriving:
                    break
                if staged is not None and self._storage is not None:
                    self._storage.write_bytes(Medium.HBM, block.block_id, staged)
                if i == 0:
                    parent = self._parent
                sums = self._checksums
                value = sums[i] if i < len(sums) else None
                self._pool.cache_block(block, key, parent, checksum=value)
                cached += 1
        finally:
            self._release()
        return cached

    def abort(self) -> None:
        """Give the fresh blocks back uncached (their bytes are never used)."""
        if not self._done:
            self._done = True
            self._release()

    def _release(self) -> None:
        self._pool.free(self._fresh[::-1])
        self._pool.free(self._pinned[::-1])


def reserve_import(
    pool: BlockPool,
    storage: TierStorage | None,
    parent: int | None,
    keys: Sequence[int],
    checksums: Sequence[int] | None = None,
) -> Reservation:
    """Fresh HBM blocks for the keys of ``keys`` the pool lacks, in order, as many as fit
    now without evicting the run's blocks already in HBM (under the scheduler lock).

    ``parent`` is the parent of the first key; None when unknown yet (the header of
    the transfer names it: :meth:`Reservation.land`). ``checksums``, verified ones, are
    cached with the blocks (without them, or a header's, the storage computes them).
    """
    return Reservation(pool, storage, parent, keys, checksums)


def import_blocks(
    pool: BlockPool,
    storage: TierStorage | None,
    parent: int | None,
    keys: Sequence[int],
    blocks: Sequence[bytes | memoryview],
    checksums: Sequence[int] | None = None,
) -> int:
    """Cache transferred blocks in HBM as if computed here; returns how many were added.

    Runs under the scheduler lock. Keys the pool caches already (computed meanwhile)
    are skipped; the rest get fresh HBM blocks (evicting as an allocation does),
    their bytes, and their keys (``stored`` events), then go to the free queue
    as cached blocks. Imports only what fits in HBM now, in order, without evicting
    the run's blocks already in HBM. ``checksums`` (verified ones: a transfer's) are
    cached with the blocks; without them the storage computes them.
    """
    reservation = reserve_import(pool, storage, parent, keys, checksums)
    try:
        for view, data in zip(reservation.views, blocks, strict=True):
            if len(view):
                view[:] = data
    except BaseException:
        reservation.abort()
        raise
    return reservation.commit()
