"""KV block transfer: the wire format refuses every bad transfer; good ones enter the pool."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import pytest
import torch

from engine_worker.block_pool import BlockPool, PoolExhaustedError, TierCapacity
from engine_worker.kv_layout import KVLayout
from engine_worker.kv_socket import KvSocketServer, fetch_blocks
from engine_worker.kv_transfer import (
    MAGIC,
    Outgoing,
    TransferError,
    TransferHeader,
    checksum,
    encode_transfer,
    expected_for,
    export_blocks,
    export_pinned,
    fresh_views,
    import_blocks,
    read_transfer,
    reserve_import,
    transfer_chunks,
)
from engine_worker.ssd_tier import ManifestError
from engine_worker.tiers import TierError, TierStorage
from indexer.events import BlockStored
from indexer.keys import block_keys, root_parent
from indexer.media import Medium

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="bfloat16")
ROOT = root_parent("m")
KEYS = block_keys(list(range(24)), LAYOUT.block_size, ROOT)  # 6 full blocks


def storage_and_pool(hbm: int = 16, dram: int = 8) -> tuple[TierStorage, BlockPool]:
    capacity = TierCapacity(hbm=hbm, dram=dram)
    storage = TierStorage(LAYOUT, capacity)
    return storage, BlockPool(capacity, storage)


def fill(
    pool: BlockPool, storage: TierStorage, keys: list[int], seed: int = 0, parent: int = ROOT
) -> None:
    """Cache ``keys`` as one request would (random bytes per block), then release them."""
    gen = torch.Generator().manual_seed(seed)
    blocks = pool.allocate(len(keys))
    for block, key in zip(blocks, keys, strict=True):
        data = torch.randn(LAYOUT.block_shape, generator=gen).to(storage.dtype)
        storage.write_block(Medium.HBM, block.block_id, data)
        pool.cache_block(block, key, parent)
        parent = key
    pool.free(blocks[::-1])


def fill_one_by_one(pool: BlockPool, storage: TierStorage) -> None:
    """Cache ``KEYS`` one block per request: each pushes the ones before down the tiers."""
    for i in range(len(KEYS)):
        fill(pool, storage, KEYS[i : i + 1], seed=i, parent=KEYS[i - 1] if i else ROOT)


@contextlib.contextmanager
def on_every_tier(tmp_path: Path) -> Iterator[tuple[TierStorage, BlockPool]]:
    """A pool over HBM 5, DRAM 2 and SSD 8 whose ``KEYS`` sit 2 on each tier (SSD first)."""
    capacity = TierCapacity(hbm=5, dram=2, ssd=8)
    with TierStorage(LAYOUT, capacity, ssd_path=tmp_path / "ssd") as storage:
        pool = BlockPool(capacity, storage)
        fill_one_by_one(pool, storage)
        fill(pool, storage, block_keys(list(range(400, 412)), 4, ROOT), seed=7)
        media = [b.medium for b in pool.match_prefix(KEYS)]
        assert media == [Medium.SSD] * 2 + [Medium.DRAM] * 2 + [Medium.HBM] * 2
        yield storage, pool


SMALL_HBM = TierCapacity(hbm=2, dram=0, ssd=8)


def cached_before_a_restart(tmp_path: Path) -> tuple[list[bytes], list[int | None]]:
    """Cache ``KEYS`` one by one over :data:`SMALL_HBM` (the leading 4 end on the SSD in
    ``tmp_path``), then close: reopened, the SSD journal knows their keys, not their
    checksums. Returns each block's bytes and checksum before the restart."""
    with TierStorage(LAYOUT, SMALL_HBM, ssd_path=tmp_path / "ssd") as storage:
        pool = BlockPool(SMALL_HBM, storage)
        fill_one_by_one(pool, storage)
        blocks = pool.match_prefix(KEYS)
        return [storage.read_bytes(b.medium, b.block_id) for b in blocks], [
            b.checksum for b in blocks
        ]


async def chunks_of(data: bytes, size: int = 37) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def wire(header: TransferHeader, blocks: list[bytes]) -> bytes:
    return encode_transfer(header) + b"".join(blocks)


def source(keys: list[int] = KEYS) -> tuple[TransferHeader, list[bytes]]:
    storage, pool = storage_and_pool()
    fill(pool, storage, keys)
    return export_blocks(pool, storage, "m", LAYOUT.block_size, keys)


EXPECTED = expected_for("m", LAYOUT.block_size, LAYOUT, KEYS)


async def test_a_transfer_round_trips_and_enters_the_receivers_pool_as_cached_blocks() -> None:
    header, blocks = source()
    assert header.keys == KEYS
    assert header.parent == ROOT
    assert all(len(b) == LAYOUT.block_bytes for b in blocks)
    got_header, got = await read_transfer(chunks_of(wire(header, blocks)), EXPECTED)
    assert [bytes(b) for b in got] == blocks

    storage, pool = storage_and_pool()
    assert import_blocks(pool, storage, got_header.parent, got_header.keys, got) == len(KEYS)
    events = pool.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.keys[0] for e in stored] == KEYS
    assert [e.parent for e in stored] == [ROOT, *KEYS[:-1]]
    assert all(e.medium is Medium.HBM for e in stored)
    # Cached and free, like a finished request's prefix: nothing is held.
    assert pool.num_free(Medium.HBM) == 16
    matched = pool.match_prefix(KEYS)
    assert len(matched) == len(KEYS)
    again, _ = export_blocks(pool, storage, "m", LAYOUT.block_size, KEYS)
    assert again.checksums == header.checksums
    pool.verify()


async def test_serving_reads_from_any_medium_and_stops_at_the_first_missing_block() -> None:
    storage, pool = storage_and_pool(hbm=4, dram=8)
    fill(pool, storage, KEYS[:3])
    fill(pool, storage, KEYS[3:], seed=1, parent=KEYS[2])  # the first ones went to DRAM
    media = [b.medium for b in pool.match_prefix(KEYS)]
    assert Medium.DRAM in media
    assert Medium.HBM in media
    header, blocks = export_blocks(pool, storage, "m", LAYOUT.block_size, KEYS)
    assert header.keys == KEYS
    # Serving does not promote or reorder anything.
    assert [b.medium for b in pool.match_prefix(KEYS)] == media
    # A receiver that asks for more than the source holds gets the run it has.
    other = block_keys(list(range(100, 108)), LAYOUT.block_size, KEYS[-1])
    header, blocks = export_blocks(pool, storage, "m", LAYOUT.block_size, [*KEYS[2:], *other])
    assert header.keys == KEYS[2:]
    assert header.parent == KEYS[1]
    assert len(blocks) == 4


async def test_import_skips_blocks_the_receiver_computed_meanwhile_and_what_does_not_fit() -> None:
    header, blocks = source()
    storage, pool = storage_and_pool(hbm=4, dram=0)
    fill(pool, storage, KEYS[:1], seed=9)
    added = import_blocks(pool, storage, header.parent, header.keys, blocks)
    # Key 0 was there and stays; of HBM's 4 blocks 3 are left for the import.
    assert added == 3
    assert len(pool.match_prefix(KEYS)) == 4
    pool.verify()


def _mutations() -> list[tuple[str, Callable[[TransferHeader, list[bytes]], bytes]]]:
    def header_with(**changes: object) -> Callable[[TransferHeader, list[bytes]], bytes]:
        return lambda h, b: wire(msgspec.structs.replace(h, **changes), b)

    def flip(h: TransferHeader, b: list[bytes]) -> bytes:
        data = bytearray(wire(h, b))
        data[-5] ^= 0x40
        return bytes(data)

    return [
        ("checksum", flip),
        ("model", header_with(model="other")),
        ("block_size", header_with(block_size=8)),
        ("dtype", header_with(dtype="float16")),
        ("shape", header_with(block_shape=[3, 2, 4, 2, 8])),
        ("count", header_with(checksums=[0])),
        ("count", header_with(streamed=len(KEYS) + 1)),
        ("count", header_with(streamed=-1)),
        ("keys", header_with(keys=KEYS[1:] + KEYS[:1])),
        ("truncated", lambda h, b: wire(h, b)[:-3]),
        ("trailing", lambda h, b: wire(h, b) + b"x"),
        ("magic", lambda h, b: b"NOPE" + wire(h, b)[4:]),
        ("header", lambda h, b: MAGIC + (2**31).to_bytes(4, "big")),
        ("header", lambda h, b: MAGIC + (3).to_bytes(4, "big") + b"\xc1\xc1\xc1"),
        ("truncated", lambda h, b: wire(h, b)[:6]),
    ]


@pytest.mark.parametrize(("reason", "mutate"), _mutations())
async def test_a_bad_transfer_is_refused_with_its_reason(
    reason: str, mutate: Callable[[TransferHeader, list[bytes]], bytes]
) -> None:
    header, blocks = source()
    with pytest.raises(TransferError) as caught:
        await read_transfer(chunks_of(mutate(header, blocks)), EXPECTED)
    assert caught.value.reason == reason


@pytest.mark.parametrize(("reason", "mutate"), _mutations())
async def test_a_bad_transfer_on_the_data_socket_is_refused_with_its_reason(
    reason: str, mutate: Callable[[TransferHeader, list[bytes]], bytes]
) -> None:
    header, blocks = source()
    payload = mutate(header, blocks)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame = await reader.readexactly(8)
        await reader.readexactly(int.from_bytes(frame[4:], "big"))
        writer.write(payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TransferError) as caught:
            await fetch_blocks("127.0.0.1", port, None, KEYS, None, EXPECTED, 10.0)
        assert caught.value.reason == reason
    finally:
        server.close()
        await server.wait_closed()


async def test_the_receiver_checks_its_own_layout_not_the_senders_claim() -> None:
    header, blocks = source()
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    with pytest.raises(TransferError, match="dtype"):
        await read_transfer(chunks_of(wire(header, blocks)), expected_for("m", 4, other, KEYS))
    # A worker without KV bytes (sim runner) takes metadata-only transfers, and only those.
    sim = expected_for("m", 4, None, KEYS)
    with pytest.raises(TransferError, match="dtype"):
        await read_transfer(chunks_of(wire(header, blocks)), sim)
    pool = BlockPool(TierCapacity(hbm=8))
    bare = export_blocks(pool, None, "m", 4, KEYS)[0]
    assert bare.keys == []
    assert bare.dtype == "none"


def test_block_bytes_round_trip_on_every_medium(tmp_path: Path) -> None:
    capacity = TierCapacity(hbm=4, dram=4, ssd=4)
    storage = TierStorage(LAYOUT, capacity, ssd_path=tmp_path / "ssd")
    gen = torch.Generator().manual_seed(3)
    try:
        for medium in (Medium.HBM, Medium.DRAM, Medium.SSD):
            block = torch.randn(LAYOUT.block_shape, generator=gen).to(storage.dtype)
            storage.write_block(medium, 2, block)
            data = storage.read_bytes(medium, 2)
            assert len(data) == LAYOUT.block_bytes
            storage.write_bytes(medium, 1, data)
            assert torch.equal(storage.read_block(medium, 1), block)
        with pytest.raises(TierError, match="bytes"):
            storage.write_bytes(Medium.HBM, 0, b"short")
    finally:
        storage.close()


def test_blocks_being_sent_are_pinned_in_place_until_the_transfer_closes() -> None:
    storage, pool = storage_and_pool(hbm=8, dram=0)
    fill(pool, storage, KEYS)
    out = export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS)
    hbm = pool.match_prefix(KEYS)
    # Sent from the tensor itself: the views are the blocks' memory.
    assert [bytes(p) for p in out.payload] == [storage.read_bytes(Medium.HBM, b.block_id)
                                               for b in hbm]  # fmt: skip
    assert out.header.checksums == [checksum(p) for p in out.payload]
    # The pool cannot take them while they are sent: only the 2 other blocks are free,
    # and allocating those evicts nothing of the run.
    assert pool.num_free(Medium.HBM) == 2
    taken = pool.allocate(2)
    assert len(pool.match_prefix(KEYS)) == len(KEYS)
    pool.free(taken)
    out.close()
    out.close()  # idempotent
    assert pool.num_free(Medium.HBM) == 8
    assert pool.stats().hits == {m: 0 for m in Medium}  # reading is not a hit
    pool.verify()


def test_ssd_blocks_are_read_by_the_sender_and_stay_pinned_until_the_transfer_closes(
    tmp_path: Path,
) -> None:
    # The pool call that takes a transfer reads nothing off the SSD (a large read there
    # held up the source's next step); the sender reads it afterwards, on its own thread,
    # while the pool goes on. Pinned, no demotion can reuse those slots meanwhile.
    with on_every_tier(tmp_path) as (storage, pool):
        blocks = pool.match_prefix(KEYS)
        truth = [storage.read_bytes(b.medium, b.block_id) for b in blocks]
        out = export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS)
        assert sorted(out.reads) == [0, 1]  # left for the sender
        assert out.header.checksums == [b.checksum for b in blocks]
        # The source goes on meanwhile: a request promotes the pinned SSD and DRAM blocks
        # out from under the transfer, and new blocks push through every tier.
        hit = pool.acquire(pool.match_prefix(KEYS)[:3])
        assert [b.medium for b in pool.match_prefix(KEYS)[:3]] == [Medium.HBM] * 3
        pool.free(hit[::-1])
        fill(pool, storage, block_keys(list(range(500, 512)), 4, ROOT), seed=9)
        pool.verify()
        out.finish()
        assert out.reads == {}
        assert [bytes(p) for p in out.payload] == truth
        assert out.header.checksums == [checksum(t) for t in truth]
        out.close()
        # Every pin is gone: each tier's slots are free or cached again.
        assert [pool.num_free(m) for m in (Medium.HBM, Medium.DRAM, Medium.SSD)] == [5, 2, 8]
        pool.verify()


class DeviceHBM(TierStorage):
    """A source whose HBM is not host memory, as on a GPU: no view of its bytes in place
    (:meth:`read_bytes` copies a block out, as it does from a CUDA tensor)."""

    def block_view(self, medium: Medium, block_id: int) -> memoryview | None:
        return None if medium is Medium.HBM else super().block_view(medium, block_id)


def test_device_memory_blocks_are_copied_by_the_sender_not_in_the_pool_call() -> None:
    # A GPU's HBM blocks were copied to host memory inside the pool call, under the
    # scheduler lock: for a PD hand-off of a long prompt the prefill worker's engine could
    # not schedule its next step until the copy was done. Pinned, the blocks cannot change
    # until the sender has copied them.
    capacity = TierCapacity(hbm=8, dram=0)
    storage = DeviceHBM(LAYOUT, capacity)
    pool = BlockPool(capacity, storage)
    fill(pool, storage, KEYS)
    blocks = pool.match_prefix(KEYS)
    assert [b.checksum for b in blocks] == [None] * len(KEYS)  # device memory: unhashed
    truth = [storage.read_bytes(Medium.HBM, b.block_id) for b in blocks]
    out = export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS)
    assert sorted(out.reads) == list(range(len(KEYS)))  # nothing copied in the pool call
    # The engine goes on: it takes the 2 other blocks and writes them; none of the run.
    with pytest.raises(PoolExhaustedError):
        pool.allocate(3)
    taken = pool.allocate(2)
    for b in taken:
        storage.write_block(
            Medium.HBM, b.block_id, torch.ones(LAYOUT.block_shape).to(storage.dtype)
        )
    pool.free(taken)
    header = out.stream_header()  # copies and hashes them: the header needs the sums
    assert header.streamed == 0  # a copy out of device memory is not an SSD read
    assert header.checksums == [checksum(t) for t in truth]
    assert [bytes(out.take(i)) for i in range(len(KEYS))] == truth
    out.close()
    assert [b.checksum for b in pool.match_prefix(KEYS)] == header.checksums  # learned
    assert pool.num_free(Medium.HBM) == 8
    # Known now: the next transfer copies each block as it is sent, after the header.
    again = export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS)
    assert (again.unhashed, sorted(again.reads)) == ([], list(range(len(KEYS))))
    assert again.stream_header().streamed == 0
    assert [bytes(again.take(i)) for i in range(len(KEYS))] == truth
    again.close()
    pool.verify()


async def test_the_data_socket_sends_the_header_first_and_reads_ssd_blocks_as_they_go(
    tmp_path: Path,
) -> None:
    # Read in full before the header, a peer's SSD copy took the reads plus the network to
    # pull, where the router prices the longer of the two (cost_model.pull_seconds). The
    # sender now sends the header first, counting the reads to come (``streamed``), and
    # reads each block just before it goes; a block whose checksum the pool lacks is read
    # before the header, which carries every checksum.
    truth, _ = cached_before_a_restart(tmp_path)
    ssd = 4  # after a restart the SSD holds the leading 4 blocks, their checksums unknown
    header_in = threading.Event()
    # (block, whether the header had arrived, the blocks read before it still held)
    reads: list[tuple[int, bool, list[int]]] = []
    wait = False
    with TierStorage(LAYOUT, SMALL_HBM, ssd_path=tmp_path / "ssd") as storage:
        pool = BlockPool(SMALL_HBM, storage)
        assert [b.medium for b in pool.match_prefix(KEYS)] == [Medium.SSD] * ssd

        async def export(keys: Sequence[int], release: str | None) -> Outgoing:
            out = export_pinned(pool, storage, "m", LAYOUT.block_size, keys)
            for i, read in list(out.reads.items()):

                def watched(
                    i: int = i, read: Callable[[], memoryview | bytes] = read, out: Outgoing = out
                ) -> memoryview | bytes:
                    # Did the header get there first? (Given the time to, once it can.)
                    first = header_in.wait(5.0) if wait else header_in.is_set()
                    reads.append((i, first, [j for j in range(i) if len(out.payload[j])]))
                    return read()

                out.reads[i] = watched
            return out

        async def land(h: TransferHeader) -> Sequence[memoryview]:
            header_in.set()
            return fresh_views(h)

        server = KvSocketServer(export, None, "127.0.0.1")
        await server.start()
        expected = expected_for("m", LAYOUT.block_size, LAYOUT, KEYS[:ssd])
        try:
            # Checksums unknown: all read, and hashed, before the header.
            header, got, _ = await fetch_blocks(
                "127.0.0.1", server.port, None, KEYS[:ssd], None, expected, 10.0
            )
            assert header.streamed == 0
            assert [bytes(g) for g in got] == truth[:ssd]
            assert reads == [(i, False, list(range(i))) for i in range(ssd)]
            # Learned when that transfer closed: now every read waits for its turn.
            assert [b.checksum for b in pool.match_prefix(KEYS)] == header.checksums
            reads.clear()
            wait = True
            header, got, _ = await fetch_blocks(
                "127.0.0.1", server.port, None, KEYS[:ssd], None, expected, 10.0, land
            )
            assert header.streamed == ssd
            # One block read at a time: each is let go once sent.
            assert reads == [(i, True, []) for i in range(ssd)]
            assert [bytes(g) for g in got] == truth[:ssd]
            assert [checksum(t) for t in truth[:ssd]] == header.checksums
        finally:
            await server.stop()
        assert pool.num_free(Medium.SSD) == 8  # no pin left: every slot is evictable again
        pool.verify()


@pytest.mark.parametrize(
    "error", [OSError(5, "Input/output error"), ManifestError("short read of SSD slot 3")]
)
async def test_a_read_that_fails_mid_stream_cuts_the_transfer_and_lets_every_pin_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    # The header is out before the SSD reads: a read that fails after it can only cut the
    # stream short. The receiver refuses it (and recomputes); the source unpins all and
    # says why in its log.
    caplog.set_level(logging.INFO, logger="engine_worker.kv_socket")
    with on_every_tier(tmp_path) as (storage, pool):

        def broken() -> memoryview:
            raise error

        async def export(keys: Sequence[int], release: str | None) -> Outgoing:
            out = export_pinned(pool, storage, "m", LAYOUT.block_size, keys)
            out.reads[1] = broken
            return out

        server = KvSocketServer(export, None, "127.0.0.1")
        await server.start()
        try:
            with pytest.raises(TransferError) as caught:
                await fetch_blocks("127.0.0.1", server.port, None, KEYS, None, EXPECTED, 10.0)
            assert caught.value.reason == "truncated"
        finally:
            await server.stop()
        assert repr(error) in caplog.text
        assert [pool.num_free(m) for m in (Medium.HBM, Medium.DRAM, Medium.SSD)] == [5, 2, 8]
        assert len(pool.match_prefix(KEYS)) == len(KEYS)  # nothing lost at the source
        pool.verify()


async def test_a_streamed_body_lets_every_pin_go_however_it_ends(tmp_path: Path) -> None:
    # POST /kv/blocks streams a transfer as an HTTP body (transfer_chunks). Read whole, it
    # is the transfer, its SSD blocks read as they go; cut after its header (a caller
    # gone), or dropped before its first chunk was asked for, the source still lets go
    # of every block it pinned.
    with on_every_tier(tmp_path) as (storage, pool):
        media = (Medium.HBM, Medium.DRAM, Medium.SSD)
        idle = [pool.num_free(m) for m in media]
        truth = [storage.read_bytes(b.medium, b.block_id) for b in pool.match_prefix(KEYS)]

        def body() -> AsyncGenerator[memoryview | bytes, None]:
            return transfer_chunks(export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS))

        def pinned() -> bool:
            return [pool.num_free(m) for m in media] != idle

        whole = b"".join([bytes(chunk) async for chunk in body()])
        header, got = await read_transfer(chunks_of(whole, 1000), EXPECTED)
        assert header.streamed == 2
        assert [bytes(g) for g in got] == truth
        assert not pinned()
        cut = body()
        assert bytes(await anext(cut)) == encode_transfer(header)
        assert pinned()
        await cut.aclose()
        assert not pinned()
        dropped = body()
        assert pinned()
        del dropped
        gc.collect()
        assert not pinned()
        pool.verify()


def test_a_header_of_blocks_all_in_memory_encodes_as_before_streamed_existed() -> None:
    # ``streamed`` is left out when 0, so a receiver built before it still reads every
    # transfer of in-memory blocks (only a streamed one is refused there, and recomputed).
    header, _ = source()
    fields = msgspec.msgpack.decode(encode_transfer(header)[8:])
    assert sorted(fields) == sorted(f for f in TransferHeader.__struct_fields__ if f != "streamed")
    streamed = msgspec.msgpack.decode(
        encode_transfer(msgspec.structs.replace(header, streamed=2))[8:]
    )
    assert streamed["streamed"] == 2


async def test_a_refused_reservation_gives_its_blocks_back_uncached() -> None:
    header, blocks = source()
    storage, pool = storage_and_pool(hbm=8, dram=0)
    reservation = reserve_import(pool, storage, header.parent, header.keys)
    assert pool.num_free(Medium.HBM) == 2
    for view, data in zip(reservation.views, blocks, strict=True):
        view[:] = data
    reservation.abort()
    assert reservation.commit() == 0  # once only
    assert pool.match_prefix(KEYS) == []
    assert pool.num_free(Medium.HBM) == 8
    assert not [e for e in pool.take_events() if isinstance(e, BlockStored)]
    pool.verify()


async def test_the_data_socket_serves_transfers_and_refuses_bad_tokens_and_requests() -> None:
    storage, pool = storage_and_pool()
    fill(pool, storage, KEYS)
    sent = []

    async def export(keys: Sequence[int], release: str | None) -> Outgoing:
        out = export_pinned(pool, storage, "m", LAYOUT.block_size, keys)
        sent.append(out)
        return out

    server = KvSocketServer(export, "secret", "127.0.0.1")
    await server.start()
    port = server.port
    try:
        # Received straight into the blocks the receiver reserved, then cached.
        to_storage, to_pool = storage_and_pool()
        reservations = []

        async def land(h: TransferHeader) -> Sequence[memoryview]:
            reservations.append(reserve_import(to_pool, to_storage, h.parent, h.keys))
            return reservations[-1].views

        header, blocks, _ = await fetch_blocks(
            "127.0.0.1", port, "secret", KEYS, None, EXPECTED, 10.0, land
        )
        assert header.keys == KEYS
        assert [checksum(b) for b in blocks] == header.checksums
        assert reservations[0].commit() == len(KEYS)
        moved = to_pool.match_prefix(KEYS)
        assert [to_storage.read_bytes(Medium.HBM, b.block_id) for b in moved] == [
            storage.read_bytes(Medium.HBM, b.block_id) for b in pool.match_prefix(KEYS)
        ]
        # The source pinned them while sending, and let go once sent.
        assert len(sent) == 1
        assert pool.num_free(Medium.HBM) == 16
        with pytest.raises(TransferError) as caught:
            await fetch_blocks("127.0.0.1", port, "wrong", KEYS, None, EXPECTED, 10.0)
        assert caught.value.reason == "auth"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"KVE1")
        assert b"not a KV transfer request" in answer
    finally:
        await server.stop()
    with pytest.raises(TransferError) as gone:
        await fetch_blocks("127.0.0.1", port, "secret", KEYS, None, EXPECTED, 2.0)
    assert gone.value.reason == "http"


async def test_blocks_go_with_the_pools_checksums_so_bytes_changed_at_rest_are_refused() -> None:
    storage, pool = storage_and_pool(hbm=8, dram=0)
    fill(pool, storage, KEYS)
    blocks = pool.match_prefix(KEYS)
    kept = [b.checksum for b in blocks]
    assert kept == [checksum(storage.read_bytes(Medium.HBM, b.block_id)) for b in blocks]
    # The sender hashes nothing: it sends what the pool took when the blocks were cached...
    out = export_pinned(pool, storage, "m", LAYOUT.block_size, KEYS)
    assert out.header.checksums == kept
    out.close()
    # ... so bytes that changed under a cached key (a fault) are sent with the checksum
    # of what was cached, and the receiver refuses them; nothing enters its pool.
    storage.write_block(Medium.HBM, blocks[3].block_id, torch.zeros(LAYOUT.block_shape,
                                                                  dtype=storage.dtype))  # fmt: skip
    header, payload = export_blocks(pool, storage, "m", LAYOUT.block_size, KEYS)
    to_storage, to_pool = storage_and_pool(hbm=8, dram=0)
    reservation = reserve_import(to_pool, to_storage, None, KEYS)

    async def land(h: TransferHeader) -> Sequence[memoryview]:
        return reservation.land(h)

    with pytest.raises(TransferError) as caught:
        await read_transfer(chunks_of(wire(header, payload)), EXPECTED, land)
    assert caught.value.reason == "checksum"
    assert "block 3" in str(caught.value)
    reservation.abort()
    assert to_pool.match_prefix(KEYS) == []
    assert to_pool.num_free(Medium.HBM) == 8
    to_pool.verify()


def test_a_block_cached_without_a_checksum_is_hashed_once_when_first_sent(
    tmp_path: Path,
) -> None:
    _, sums = cached_before_a_restart(tmp_path)
    # After a restart, the SSD journal knows keys, not checksums.
    with TierStorage(LAYOUT, SMALL_HBM, ssd_path=tmp_path / "ssd") as storage:
        pool = BlockPool(SMALL_HBM, storage)
        restored = pool.match_prefix(KEYS)
        ssd = [i for i, b in enumerate(restored) if b.medium is Medium.SSD]
        assert ssd
        assert all(restored[i].checksum is None for i in ssd)
        header, payload = export_blocks(pool, storage, "m", LAYOUT.block_size, KEYS)
        assert header.checksums == [checksum(p) for p in payload]
        assert [header.checksums[i] for i in ssd] == [sums[i] for i in ssd]
        assert [b.checksum for b in pool.match_prefix(KEYS)] == header.checksums
        pool.verify()


async def test_blocks_reserved_before_asking_keep_only_what_the_source_serves() -> None:
    storage, pool = storage_and_pool()
    fill(pool, storage, KEYS[:4])

    async def export(keys: Sequence[int], release: str | None) -> Outgoing:
        return export_pinned(pool, storage, "m", LAYOUT.block_size, keys)

    server = KvSocketServer(export, None, "127.0.0.1")
    await server.start()
    try:
        to_storage, to_pool = storage_and_pool(hbm=8, dram=0)
        fill(to_pool, to_storage, KEYS[1:2], seed=5, parent=KEYS[0])  # held already
        reservation = reserve_import(to_pool, to_storage, None, KEYS)  # parent: unknown yet
        assert to_pool.num_free(Medium.HBM) == 8 - 6  # 5 fresh + the held one pinned

        async def land(h: TransferHeader) -> Sequence[memoryview]:
            return reservation.land(h)

        header, _, _ = await fetch_blocks(
            "127.0.0.1", server.port, None, KEYS, None, EXPECTED, 10.0, land
        )
        assert header.keys == KEYS[:4]
        assert reservation.commit() == 3  # keys 0, 2, 3; key 1 was there
        stored = [e for e in to_pool.take_events() if isinstance(e, BlockStored)]
        assert [(e.keys[0], e.parent) for e in stored][-3:] == [
            (KEYS[0], ROOT), (KEYS[2], KEYS[1]), (KEYS[3], KEYS[2])
        ]  # fmt: skip
        moved = to_pool.match_prefix(KEYS)
        assert len(moved) == 4
        # The checksums verified on arrival are the ones the receiver keeps.
        for i in (0, 2, 3):
            data = to_storage.read_bytes(Medium.HBM, moved[i].block_id)
            assert moved[i].checksum == header.checksums[i] == checksum(data)
        # The blocks reserved for keys 4 and 5, which never came, are free and uncached.
        assert to_pool.num_free(Medium.HBM) == 8
        to_pool.verify()
    finally:
        await server.stop()


async def test_a_stalled_source_is_cut_off_at_the_deadline_and_leaves_nothing_behind() -> None:
    header, blocks = source()
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame = await reader.readexactly(8)
        await reader.readexactly(int.from_bytes(frame[4:], "big"))
        writer.write(encode_transfer(header) + blocks[0] + blocks[1][:10])
        await writer.drain()
        await release.wait()  # and never sends the rest
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    storage, pool = storage_and_pool(hbm=8, dram=0)
    reservation = reserve_import(pool, storage, None, KEYS)

    async def land(h: TransferHeader) -> Sequence[memoryview]:
        return reservation.land(h)

    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TransferError) as caught:
            await fetch_blocks("127.0.0.1", port, None, KEYS, None, EXPECTED, 0.5, land)
        assert caught.value.reason == "http"
        # The receiving thread is done once the call returns: giving the blocks back is safe.
        assert asyncio.get_running_loop().time() - started < 5.0
        reservation.abort()
        assert pool.match_prefix(KEYS) == []
        assert pool.num_free(Medium.HBM) == 8
        pool.verify()
    finally:
        release.set()
        server.close()
        await server.wait_closed()


async def test_a_receiver_that_stops_reading_is_cut_off_and_the_blocks_unpinned() -> None:
    big = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16)  # 1 MiB blocks
    capacity = TierCapacity(hbm=40)
    storage = TierStorage(big, capacity)
    pool = BlockPool(capacity, storage)
    keys = block_keys(list(range(32 * 16)), 16, ROOT)
    blocks = pool.allocate(len(keys))
    parent = ROOT
    for block, key in zip(blocks, keys, strict=True):
        pool.cache_block(block, key, parent)
        parent = key
    pool.free(blocks[::-1])
    closed = asyncio.Event()

    async def export(asked: Sequence[int], release: str | None) -> Outgoing:
        out = export_pinned(pool, storage, "m", 16, asked)
        unpin = out.on_close

        def close() -> None:
            unpin()
            closed.set()

        out.on_close = close
        return out

    server = KvSocketServer(export, None, "127.0.0.1", send_timeout_s=0.5)
    await server.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = msgspec.msgpack.encode({"keys": keys})
        writer.write(b"KVQ1" + len(body).to_bytes(4, "big") + body)
        await writer.drain()
        # 32 MiB cannot all fit in the socket buffers of a receiver that reads nothing.
        await asyncio.wait_for(closed.wait(), 10.0)
        assert pool.num_free(Medium.HBM) == 40
        pool.verify()
        writer.close()
    finally:
        await server.stop()
