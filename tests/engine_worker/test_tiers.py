"""Tier storage: bytes survive every move and a restart; the SSD journal refuses corruption."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_worker.block_checksum import block_checksum
from engine_worker.block_pool import BlockPool, PoolError, TierCapacity
from engine_worker.kv_layout import KVLayout
from engine_worker.ssd_tier import (
    HEADER_SIZE,
    MANIFEST_FILE,
    RECORD_SIZE,
    SLOTS_FILE,
    ManifestError,
)
from engine_worker.tiers import TierError, TierStorage
from indexer.events import BlockStored
from indexer.keys import block_keys, root_parent
from indexer.media import MEDIA, Medium

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
ROOT = root_parent("tier-model")
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="bfloat16")


def random_block(layout: KVLayout, seed: int) -> torch.Tensor:
    """Arbitrary bytes (NaN patterns included) shaped as one block."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8, generator=gen)
    return raw.view(getattr(torch, layout.dtype)).view(layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compute(pool: BlockPool, storage: TierStorage, tokens: list[int], seed: int) -> list[int]:
    """Run one request with fresh random KV bytes per new block, then free it."""
    keys = block_keys(tokens, 1, ROOT)
    hit = pool.acquire(pool.match_prefix(keys))
    blocks = hit + pool.allocate(len(keys) - len(hit))
    for i in range(len(hit), len(keys)):
        storage.write_block(HBM, blocks[i].block_id, random_block(storage.layout, seed + i))
        pool.cache_block(blocks[i], keys[i], keys[i - 1] if i else ROOT)
    pool.free(blocks[::-1])
    return keys


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def opened() -> Iterator[list[TierStorage]]:
    """Closes every storage a test opened, even when it fails."""
    storages: list[TierStorage] = []
    yield storages
    for s in storages:
        s.close()


def open_pool(
    opened: list[TierStorage],
    ssd_dir: Path,
    cap: TierCapacity,
    layout: KVLayout = LAYOUT,
    device: str = "cpu",
) -> tuple[BlockPool, TierStorage]:
    storage = TierStorage(layout, cap, device=device, ssd_path=ssd_dir)
    opened.append(storage)
    return BlockPool(cap, storage), storage


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_bytes_survive_demotion_to_ssd_promotion_and_restart(
    dtype: str, device: str, ssd_dir: Path, opened: list[TierStorage]
) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype)
    cap = TierCapacity(hbm=1, dram=1, ssd=2)
    pool, storage = open_pool(opened, ssd_dir, cap, layout, device)
    assert storage.hbm.device.type == device
    (k1,) = compute(pool, storage, [1], seed=10)
    (hbm_block,) = pool.match_prefix([k1])
    original = storage.read_block(HBM, hbm_block.block_id)
    assert same_bytes(original, random_block(layout, 10))

    compute(pool, storage, [2], seed=20)
    (on_dram,) = pool.match_prefix([k1])
    assert on_dram.medium is DRAM
    assert same_bytes(storage.read_block(DRAM, on_dram.block_id), original)

    compute(pool, storage, [3], seed=30)
    (on_ssd,) = pool.match_prefix([k1])
    assert on_ssd.medium is SSD
    assert same_bytes(storage.read_block(SSD, on_ssd.block_id), original)

    (promoted,) = pool.acquire([on_ssd])
    assert promoted.medium is HBM
    assert same_bytes(storage.read_block(HBM, promoted.block_id), original)
    pool.free([promoted])
    compute(pool, storage, [4], seed=40)
    compute(pool, storage, [5], seed=50)
    snapshot = pool.snapshot()
    assert k1 in snapshot[SSD]
    storage.close()

    pool, storage = open_pool(opened, ssd_dir, cap, layout, device)
    events = pool.take_events()
    assert {k for e in events if isinstance(e, BlockStored) for k in e.keys} == set(snapshot[SSD])
    assert all(isinstance(e, BlockStored) and e.medium is SSD for e in events)
    assert all(e.parent == ROOT for e in events if isinstance(e, BlockStored))
    assert pool.snapshot()[HBM] == pool.snapshot()[DRAM] == []
    assert set(pool.snapshot()[SSD]) == set(snapshot[SSD])
    (restored,) = pool.acquire(pool.match_prefix([k1]))
    assert same_bytes(storage.read_block(HBM, restored.block_id), original)
    pool.verify()


def block_bytes(seed: int) -> bytes:
    """The bytes :func:`compute` writes into a block with ``seed``."""
    return random_block(LAYOUT, seed).contiguous().view(torch.uint8).numpy().tobytes()


def checksums_by_key(pool: BlockPool, storage: TierStorage) -> dict[int, int | None]:
    """Each cached key's remembered checksum, after checking it against the bytes."""
    out: dict[int, int | None] = {}
    for medium, keys in pool.snapshot().items():
        for key in keys:
            (block,) = pool.match_prefix([key])
            assert block.medium is medium
            if block.checksum is not None:
                assert block.checksum == block_checksum(storage.read_bytes(medium, block.block_id))
            out[key] = block.checksum
    pool.verify()  # among others: no block without a key keeps a checksum
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_blocks_checksum_follows_its_bytes_and_goes_with_its_key(
    device: str, ssd_dir: Path, opened: list[TierStorage]
) -> None:
    """What a KV transfer sends as a block's checksum is never stale: taken when the
    block is cached (host memory), carried by every exact copy between tiers, dropped
    when the key is, recomputed when the slot is reused for other bytes."""
    cap = TierCapacity(hbm=1, dram=1, ssd=1)
    pool, storage = open_pool(opened, ssd_dir, cap, device=device)
    (k1,) = compute(pool, storage, [1], seed=10)
    first = block_checksum(block_bytes(10))
    sums = checksums_by_key(pool, storage)
    # Known at once in host memory; a device tensor's is left to the sender, which stages it.
    assert sums == {k1: first if device == "cpu" else None}

    compute(pool, storage, [2], seed=20)  # k1 -> DRAM
    compute(pool, storage, [3], seed=30)  # k1 -> SSD, 2 -> DRAM
    (on_ssd,) = pool.match_prefix([k1])
    assert on_ssd.medium is SSD
    assert checksums_by_key(pool, storage)[k1] == sums[k1]
    (promoted,) = pool.acquire([on_ssd])  # 3 -> DRAM, 2 -> SSD
    assert promoted.medium is HBM
    assert promoted.checksum == sums[k1]
    assert on_ssd.checksum is None  # the SSD slot lost the key, and the checksum with it
    pool.free([promoted])
    checksums_by_key(pool, storage)

    # k1's HBM slot and then its DRAM and SSD slots are reused for other keys and bytes:
    # each now names the new bytes, and k1, dropped, names nothing.
    for token, seed in ((4, 40), (5, 50), (6, 60)):
        compute(pool, storage, [token], seed=seed)
    after = checksums_by_key(pool, storage)
    assert k1 not in after
    if device == "cpu":
        assert all(v is not None for v in after.values())
        assert sums[k1] not in after.values()

    assert pool.clear_cache()
    checksums_by_key(pool, storage)
    (k7,) = compute(pool, storage, [7], seed=70)
    assert checksums_by_key(pool, storage) == {
        k7: block_checksum(block_bytes(70)) if device == "cpu" else None
    }


def test_a_checksum_noted_by_a_reader_is_kept_and_checked(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    cap = TierCapacity(hbm=2)
    pool, storage = open_pool(opened, ssd_dir, cap)
    (k1,) = compute(pool, storage, [1], seed=10)
    (block,) = pool.match_prefix([k1])
    pool.note_checksum(block, 12345)
    assert block.checksum == 12345
    with pytest.raises(PoolError, match="unsigned 64-bit"):
        pool.note_checksum(block, -1)
    (empty,) = pool.allocate(1)
    with pytest.raises(PoolError, match="not a cached block"):
        pool.note_checksum(empty, 1)
    with pytest.raises(PoolError, match="unsigned 64-bit"):
        pool.cache_block(empty, 99, k1, checksum=2**64)
    assert empty.key is None
    pool.cache_block(empty, 99, k1, checksum=7)  # a verified checksum is taken as given
    assert empty.checksum == 7
    pool.free([empty])
    pool.verify()


def test_copy_read_and_write_reach_every_medium(ssd_dir: Path, opened: list[TierStorage]) -> None:
    cap = TierCapacity(hbm=2, dram=2, ssd=2)
    storage = TierStorage(LAYOUT, cap, ssd_path=ssd_dir)
    opened.append(storage)
    data = random_block(LAYOUT, 1)
    storage.write_block(HBM, 1, data)
    hops = [(HBM, 1, DRAM, 0), (DRAM, 0, SSD, 1), (SSD, 1, SSD, 0), (SSD, 0, HBM, 0)]
    hops += [(HBM, 0, DRAM, 1), (DRAM, 1, DRAM, 0), (DRAM, 0, HBM, 1)]
    for src, src_id, dst, dst_id in hops:
        storage.copy_block(src, src_id, dst, dst_id)
        assert same_bytes(storage.read_block(dst, dst_id), data), (src, dst)
    assert storage.hbm.shape == (2, *LAYOUT.block_shape)
    assert storage.hbm.dtype == torch.bfloat16


def test_storage_rejects_bad_blocks_and_ids(ssd_dir: Path, opened: list[TierStorage]) -> None:
    cap = TierCapacity(hbm=1, dram=1, ssd=1)
    storage = TierStorage(LAYOUT, cap, ssd_path=ssd_dir)
    opened.append(storage)
    with pytest.raises(TierError):
        storage.write_block(HBM, 0, torch.zeros(LAYOUT.block_shape, dtype=torch.float32))
    with pytest.raises(TierError):
        storage.write_block(DRAM, 0, torch.zeros((1, *LAYOUT.block_shape), dtype=torch.bfloat16))
    for medium in MEDIA:
        with pytest.raises(TierError):
            storage.read_block(medium, 1)
        with pytest.raises(TierError):
            storage.copy_block(HBM, 0, medium, -1)
    with pytest.raises(TierError):
        TierStorage(LAYOUT, TierCapacity(hbm=1, ssd=1))
    with pytest.raises(ManifestError, match="in use"):
        TierStorage(LAYOUT, cap, ssd_path=ssd_dir)
    other = TierStorage(LAYOUT, TierCapacity(hbm=2))
    with pytest.raises(PoolError, match="capacity"):
        BlockPool(cap, other)


def fill_ssd(opened: list[TierStorage], ssd_dir: Path, n: int) -> tuple[list[int], TierCapacity]:
    """Leave keys 0..n-1 on SSD (pushed down from a one-block HBM) and close the storage."""
    cap = TierCapacity(hbm=1, ssd=n + 1)
    pool, storage = open_pool(opened, ssd_dir, cap)
    keys = [compute(pool, storage, [t], seed=t)[0] for t in range(n + 1)]
    assert set(pool.snapshot()[SSD]) == set(keys[:n])
    storage.close()
    return keys[:n], cap


def restored_keys(opened: list[TierStorage], ssd_dir: Path, cap: TierCapacity) -> set[int]:
    pool, storage = open_pool(opened, ssd_dir, cap)
    pool.verify()
    keys = set(pool.snapshot()[SSD])
    storage.close()
    return keys


def test_a_truncated_last_record_is_ignored_as_a_crash_mid_write(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    keys, cap = fill_ssd(opened, ssd_dir, 3)
    journal = ssd_dir / MANIFEST_FILE
    size = journal.stat().st_size
    os.truncate(journal, size - RECORD_SIZE // 2)  # the last SET was half written
    assert restored_keys(opened, ssd_dir, cap) == set(keys[:2])
    assert (journal.stat().st_size - HEADER_SIZE) % RECORD_SIZE == 0
    assert restored_keys(opened, ssd_dir, cap) == set(keys[:2])


def test_a_corrupt_record_is_refused_and_files_are_left_alone(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    keys, cap = fill_ssd(opened, ssd_dir, 3)
    journal = ssd_dir / MANIFEST_FILE
    good = journal.read_bytes()
    bad = bytearray(good)
    bad[HEADER_SIZE + RECORD_SIZE + 9] ^= 0x40
    journal.write_bytes(bytes(bad))
    with pytest.raises(ManifestError, match="checksum"):
        TierStorage(LAYOUT, cap, ssd_path=ssd_dir)
    assert journal.read_bytes() == bytes(bad)
    journal.write_bytes(good)
    assert restored_keys(opened, ssd_dir, cap) == set(keys)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1])
def test_a_truncated_header_is_refused(cut: int, ssd_dir: Path, opened: list[TierStorage]) -> None:
    _, cap = fill_ssd(opened, ssd_dir, 1)
    os.truncate(ssd_dir / MANIFEST_FILE, cut)
    with pytest.raises(ManifestError, match="header"):
        TierStorage(LAYOUT, cap, ssd_path=ssd_dir)


def test_a_journal_from_another_layout_or_geometry_is_refused(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    keys, cap = fill_ssd(opened, ssd_dir, 2)
    other_layout = KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16"
    )
    with pytest.raises(ManifestError, match="another KV layout"):
        TierStorage(other_layout, cap, ssd_path=ssd_dir)
    other_dtype = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float16")
    with pytest.raises(ManifestError, match="another KV layout"):
        TierStorage(other_dtype, cap, ssd_path=ssd_dir)
    with pytest.raises(ManifestError, match="another KV layout"):
        TierStorage(LAYOUT, TierCapacity(hbm=1, ssd=cap.ssd + 1), ssd_path=ssd_dir)
    assert restored_keys(opened, ssd_dir, cap) == set(keys)


def test_a_slot_file_of_the_wrong_size_is_refused(ssd_dir: Path, opened: list[TierStorage]) -> None:
    _, cap = fill_ssd(opened, ssd_dir, 1)
    os.truncate(ssd_dir / SLOTS_FILE, LAYOUT.block_bytes)
    with pytest.raises(ManifestError, match="bytes"):
        TierStorage(LAYOUT, cap, ssd_path=ssd_dir)


def test_clear_cache_empties_the_ssd_journal(ssd_dir: Path, opened: list[TierStorage]) -> None:
    _, cap = fill_ssd(opened, ssd_dir, 2)
    pool, storage = open_pool(opened, ssd_dir, cap)
    assert pool.clear_cache() is True
    storage.close()
    assert restored_keys(opened, ssd_dir, cap) == set()


def test_a_pool_without_caching_neither_restores_nor_rewrites_the_journal(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    keys, cap = fill_ssd(opened, ssd_dir, 2)
    journal = (ssd_dir / MANIFEST_FILE).read_bytes()
    storage = TierStorage(LAYOUT, cap, ssd_path=ssd_dir)
    opened.append(storage)
    pool = BlockPool(cap, storage, enable_caching=False)
    assert pool.take_events() == []
    assert pool.snapshot()[SSD] == []
    pool.free(pool.allocate(1))
    storage.close()
    assert (ssd_dir / MANIFEST_FILE).read_bytes() == journal
    assert restored_keys(opened, ssd_dir, cap) == set(keys)


def test_the_journal_is_compacted_and_still_restores_exactly(
    ssd_dir: Path, opened: list[TierStorage]
) -> None:
    small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=1)
    cap = TierCapacity(hbm=1, ssd=4)
    pool, storage = open_pool(opened, ssd_dir, cap, small)
    journal = ssd_dir / MANIFEST_FILE
    largest = 0
    for t in range(1500):  # every request pushes one key down and drops one from SSD
        compute(pool, storage, [t], seed=t)
        largest = max(largest, journal.stat().st_size)
    assert largest < HEADER_SIZE + RECORD_SIZE * (2 * cap.ssd + 1024 + 2)
    on_ssd = pool.snapshot()[SSD]
    contents = {k: storage.read_block(SSD, pool.match_prefix([k])[0].block_id) for k in on_ssd}
    storage.close()
    pool, storage = open_pool(opened, ssd_dir, cap, small)
    assert set(pool.snapshot()[SSD]) == set(on_ssd)
    for key, data in contents.items():
        (block,) = pool.acquire(pool.match_prefix([key]))
        assert same_bytes(storage.read_block(HBM, block.block_id), data)
        pool.free([block])
