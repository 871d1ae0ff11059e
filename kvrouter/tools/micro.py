"""Micro benchmarks of block keys and the block pool, each against a trivial baseline.

Every row is measured side by side in one run and reported as a ratio
(ours / baseline), because absolute figures on a shared machine mean little:

1. Key hashing: keys/s of ``indexer.keys.block_keys`` over a 32K-token prompt
   (B=16) against raw ``xxh3_64`` over the same token bytes, in the same
   block-sized pieces and as one buffer.
2. Pool bookkeeping at 1M HBM blocks (metadata only): allocate+free ops/s,
   and request churn with caching and eviction (with and without DRAM/SSD
   tiers), against a plain list of free ids (and an ``OrderedDict`` LRU).
3. Tier moves through the pool with real bytes (SmolLM2-135M block geometry):
   GB/s of HBM->DRAM demotion, the HBM->DRAM->SSD cascade and SSD/DRAM->HBM
   promotion, against raw ``copy_`` / ``os.pwrite`` / ``os.preadv`` of the
   same bytes. The SSD file is page-cache hot: this measures our overhead,
   not the disk.

Each timing is the best of ``--repeat`` runs; torch runs single-threaded.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import typer
import xxhash

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.kv_layout import KVLayout
from engine_worker.tiers import TierStorage
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from kvrouter.tools.table import Row, RowFormat, report

__all__ = ["FORMAT", "main", "run"]

#: SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, bf16, 16-token blocks (360 KiB per block).
SMOLLM2_LAYOUT = KVLayout(
    num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bfloat16"
)


_Thunk = Callable[[], None]
#: A tier move: name, timed pool operation, its untimed setup, the raw baseline, its name.
_Move = tuple[str, _Thunk, _Thunk, _Thunk, str]

FORMAT = RowFormat("kvrouter micro benchmarks (ours vs baseline, one run)", digits=3)


def best_time(
    fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None
) -> float:
    """Best wall time of ``repeat`` runs of ``fn`` (``setup`` runs untimed before each)."""
    best = float("inf")
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_hashing(repeat: int) -> list[Row]:
    """Keys/s of ``block_keys`` against raw xxh3 over the same bytes."""
    block_size, num_tokens = 16, 32 * 1024
    tokens = np.random.default_rng(0).integers(0, 2**17, num_tokens, dtype=np.uint32).tolist()
    root = root_parent("bench-model")
    n = num_tokens // block_size
    data = np.asarray(tokens, dtype="<u4").tobytes()
    stride = 4 * block_size
    digest = xxhash.xxh3_64_intdigest

    def pieces() -> None:
        for i in range(n):
            digest(data[i * stride : (i + 1) * stride])

    repeat *= 10  # a 32K-token prompt hashes in about a millisecond
    ours = n / best_time(lambda: block_keys(tokens, block_size, root), repeat)
    raw_pieces = n / best_time(pieces, repeat)
    raw_whole = n / best_time(lambda: digest(data), repeat)
    return [
        Row("block_keys, 32K tokens, B=16", "keys/s", ours, raw_pieces, "raw xxh3 per block"),
        Row("block_keys, 32K tokens, B=16", "keys/s", ours, raw_whole, "raw xxh3 whole buffer"),
    ]


def bench_pool(num_blocks: int, repeat: int) -> list[Row]:
    """Allocate+free and caching churn at ``num_blocks`` HBM blocks, metadata only."""
    per_request = 16
    rounds = num_blocks // per_request
    build_start = time.perf_counter()
    pool = BlockPool(TierCapacity(hbm=num_blocks))
    build_s = time.perf_counter() - build_start

    def fill_and_drain() -> None:
        held = [pool.allocate(per_request) for _ in range(rounds)]
        for blocks in held:
            pool.free(blocks[::-1])

    free_ids = list(range(num_blocks))

    def list_fill_and_drain() -> None:
        held = []
        for _ in range(rounds):
            held.append([free_ids.pop() for _ in range(per_request)])
        for ids in held:
            free_ids.extend(reversed(ids))

    ops = 2 * rounds * per_request
    ours = ops / best_time(fill_and_drain, repeat)
    base = ops / best_time(list_fill_and_drain, repeat)
    rows = [
        Row(f"allocate+free, {num_blocks:,} HBM blocks", "ops/s", ours, base, "list of free ids")
    ]

    churn_requests = max(rounds // 16, 1)
    counter = itertools.count()

    def fill(target: BlockPool) -> None:
        """Cache a key in every block of every tier, so that each later allocation evicts."""
        cap = target.capacity()
        for _ in range(-(-(cap.hbm + cap.dram + cap.ssd) // cap.hbm)):
            blocks = target.allocate(target.num_free())
            for block in blocks:
                target.cache_block(block, next(counter), None)
            target.free(blocks[::-1])
            target.take_events()

    def churn(target: BlockPool) -> Callable[[], None]:
        def go() -> None:
            for _ in range(churn_requests):
                blocks = target.allocate(per_request)
                parent = 0
                for block in blocks:
                    key = next(counter)
                    target.cache_block(block, key, parent)
                    parent = key
                target.free(blocks[::-1])
                target.take_events()

        return go

    lru: OrderedDict[int, int] = OrderedDict()
    lru_free = list(range(num_blocks))

    def lru_churn() -> None:
        for _ in range(churn_requests):
            ids = []
            for _ in range(per_request):
                if lru_free:
                    ids.append(lru_free.pop())
                else:
                    ids.append(lru.popitem(last=False)[1])
            for block_id in ids:
                lru[next(counter)] = block_id

    fill(pool)
    while lru_free:
        lru_churn()
    ops = churn_requests * per_request
    base = ops / best_time(lru_churn, repeat)
    ours = ops / best_time(churn(pool), repeat)
    rows.append(Row("churn: allocate+cache+evict+free", "blocks/s", ours, base, "OrderedDict LRU"))

    small = num_blocks // 16
    tiered = BlockPool(TierCapacity(hbm=small, dram=small, ssd=2 * small))
    fill(tiered)
    ours = ops / best_time(churn(tiered), repeat)
    name = f"churn, HBM->DRAM->SSD demotion ({4 * small:,} blocks)"
    rows.append(Row(name, "blocks/s", ours, base, "OrderedDict LRU"))
    list_s = best_time(lambda: list(range(num_blocks)), repeat)
    rows.append(Row(f"build pool of {num_blocks:,} blocks", "s", build_s, list_s, "list(range(n))"))
    return rows


def bench_tiers(num_blocks: int, repeat: int, workdir: Path) -> list[Row]:
    """GB/s of block moves through the pool against raw copies of the same bytes."""
    layout = SMOLLM2_LAYOUT
    n = num_blocks
    gigabytes = n * layout.block_bytes / 1e9
    rows: list[Row] = []
    cap = TierCapacity(hbm=n, dram=n, ssd=n)
    with TierStorage(layout, cap, ssd_path=workdir / "ssd") as storage:
        hbm, dram = storage.hbm, storage.dram
        hbm_bytes = hbm.view(n, -1).view(torch.uint8)
        dram_bytes = dram.view(n, -1).view(torch.uint8)
        hbm_bytes.copy_(torch.randint(0, 256, hbm_bytes.shape, dtype=torch.uint8))
        pools: list[BlockPool] = []
        keys = iter(range(1, 2**62))

        def cached_pool(levels: int, flush: bool) -> None:
            """A fresh pool: ``levels`` rounds of n cached blocks, each pushing the last one down.

            With ``flush``, n uncached blocks are allocated and freed last, pushing every
            level down once more and leaving HBM empty.
            """
            pool = BlockPool(cap, storage)
            pool.clear_cache()
            for _ in range(levels):
                blocks = pool.allocate(n)
                for b in blocks:
                    pool.cache_block(b, next(keys), None)
                pool.free(blocks)
            if flush:
                pool.free(pool.allocate(n))
            pools[:] = [pool]

        def demote() -> None:
            pools[0].free(pools[0].allocate(n))

        def promote(medium: Medium) -> Callable[[], None]:
            def go() -> None:
                pool = pools[0]
                pool.acquire(pool.match_prefix(pool.snapshot()[medium]))

            return go

        fd = os.open(workdir / "raw.bin", os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, n * layout.block_bytes)
        dram_np, hbm_np = dram_bytes.numpy(), hbm_bytes.numpy()
        try:

            def raw_hbm_to_dram() -> None:
                for i in range(n):
                    dram[i].copy_(hbm[i])

            def raw_dram_to_hbm() -> None:
                for i in range(n):
                    hbm[i].copy_(dram[i])

            def raw_cascade() -> None:
                for i in range(n):
                    os.pwrite(fd, dram_np[i].data, i * layout.block_bytes)
                    dram[i].copy_(hbm[i])

            def raw_ssd_to_hbm() -> None:
                for i in range(n):
                    os.preadv(fd, [hbm_np[i].data], i * layout.block_bytes)

            raw_cascade()  # allocate the raw file's pages, as the slot file's are
            moves: list[_Move] = [
                (
                    "demote HBM->DRAM",
                    demote,
                    lambda: cached_pool(1, False),
                    raw_hbm_to_dram,
                    "copy_",
                ),
                (
                    "demote HBM->DRAM->SSD",
                    demote,
                    lambda: cached_pool(2, False),
                    raw_cascade,
                    "pwrite + copy_",
                ),
                (
                    "promote DRAM->HBM",
                    promote(Medium.DRAM),
                    lambda: cached_pool(1, True),
                    raw_dram_to_hbm,
                    "copy_",
                ),
                (
                    "promote SSD->HBM",
                    promote(Medium.SSD),
                    lambda: cached_pool(2, True),
                    raw_ssd_to_hbm,
                    "preadv",
                ),
            ]
            size = f"{n} x {layout.block_bytes // 1024} KiB"
            for name, fn, setup, raw, raw_name in moves:
                ours = gigabytes / best_time(fn, repeat, setup)
                base = gigabytes / best_time(raw, repeat)
                rows.append(Row(f"{name}, {size}", "GB/s", ours, base, raw_name))
        finally:
            os.close(fd)
    return rows


def run(num_blocks: int = 1_000_000, tier_blocks: int = 256, repeat: int = 3) -> list[Row]:
    """Run every benchmark and return its rows.

    Torch runs single-threaded: a block-sized copy gains nothing from intra-op
    threads, and on a shared machine their spin-waits dominate the timing.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(num_blocks, tier_blocks, repeat)
    finally:
        torch.set_num_threads(threads)


def _run(num_blocks: int, tier_blocks: int, repeat: int) -> list[Row]:
    rows = bench_hashing(repeat)
    rows += bench_pool(num_blocks, repeat)
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        rows += bench_tiers(tier_blocks, repeat, Path(tmp))
    return rows


def main(
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the rows as JSON here.")
    ] = None,
    num_blocks: Annotated[
        int, typer.Option(help="HBM blocks of the metadata-only pool.")
    ] = 1_000_000,
    tier_blocks: Annotated[int, typer.Option(help="Blocks moved per tier benchmark.")] = 256,
    repeat: Annotated[int, typer.Option(help="Runs per timing; the best is kept.")] = 3,
) -> None:
    """Measure key hashing, pool bookkeeping and tier bandwidth against baselines."""
    started = time.perf_counter()
    rows = run(num_blocks, tier_blocks, repeat)
    footer = f"torch {torch.__version__}"
    report(rows, FORMAT, started=started, json_path=json_path, footer=footer, width=150)


if __name__ == "__main__":
    typer.run(main)
