"""Stateful property tests: random request traffic keeps the pool, its events and its bytes exact.

A hypothesis state machine drives a pool the way a scheduler would (match,
acquire, allocate, cache, free, clear) under memory pressure, plus readers
pinning cached blocks on any medium (a KV transfer being sent), bad use and,
with storage, worker restarts over the same SSD directory. After every step it
checks what a user of the pool relies on:

* reference counts match the requests and readers holding each block, never negative;
* free + in use = capacity per medium, and usage counts exactly the blocks holding data;
* a pinned block's bytes stay what they were when pinned, whatever moves meanwhile;
* every cached key resolves to a block holding that key, on one medium only;
* replaying every drained event into ``{medium: set(keys)}`` gives ``snapshot()``;
* with real tensors, every cached key's bytes are exactly those written when it was computed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine_worker.block_pool import Block, BlockPool, PoolError, PoolExhaustedError, TierCapacity
from engine_worker.kv_layout import KVLayout
from engine_worker.tiers import TierStorage
from indexer.keys import block_keys, root_parent
from indexer.media import MEDIA, Medium
from tests.engine_worker.event_replay import EventReplay

ROOT = root_parent("prop-model")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=2, dtype="float32")
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5)


class PoolMachine(RuleBasedStateMachine):
    """Random traffic against one pool; subclasses decide whether bytes exist."""

    with_storage = False
    requests = Bundle("requests")
    readers = Bundle("readers")

    def __init__(self) -> None:
        super().__init__()
        self.replay = EventReplay()
        self.refs: Counter[int] = Counter()
        self.known: dict[int, Block] = {}
        self.generation = 0
        self.content: dict[int, torch.Tensor] = {}
        self.storage: TierStorage | None = None
        self.tmp: Path | None = None
        self.gen = torch.Generator().manual_seed(0)
        self.pinned: list[tuple[list[Block], list[bytes]]] = []
        self.chains: list[list[int]] = []

    @initialize(hbm=st.integers(1, 6), dram=st.integers(0, 3), ssd=st.integers(0, 3))
    def build(self, hbm: int, dram: int, ssd: int) -> None:
        self.cap = TierCapacity(hbm, dram, ssd)
        if self.with_storage:
            self.tmp = Path(tempfile.mkdtemp(prefix="kvpool-"))
        self.pool = self._open()

    def _open(self) -> BlockPool:
        if self.with_storage:
            self.storage = TierStorage(LAYOUT, self.cap, ssd_path=self.tmp)
        return BlockPool(self.cap, self.storage)

    def teardown(self) -> None:
        if self.storage is not None:
            self.storage.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _hold(self, blocks: list[Block]) -> None:
        self.refs.update(id(b) for b in blocks)
        self.known.update((id(b), b) for b in blocks)

    def _release(self, blocks: list[Block]) -> None:
        self.refs.subtract(id(b) for b in blocks)

    @rule(target=requests, tokens=prompts, extra=st.booleans())
    def run_request(self, tokens: list[int], extra: bool) -> tuple[int, list[Block]]:
        keys = block_keys(tokens, 1, ROOT)
        self.chains.append(keys)
        match = self.pool.match_prefix(keys)
        assert [b.key for b in match] == keys[: len(match)]
        try:
            hit = self.pool.acquire(match)
        except PoolExhaustedError:
            return self.generation, []
        assert [b.key for b in hit] == keys[: len(hit)]
        assert all(b.medium is Medium.HBM for b in hit)
        self._hold(hit)
        want = len(keys) - len(hit) + int(extra)
        if not self.pool.can_allocate(want):
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(want)
            self.pool.free(hit[::-1])
            self._release(hit)
            return self.generation, []
        new = self.pool.allocate(want)
        self._hold(new)
        blocks = hit + new
        for i in range(len(hit), len(keys)):
            data = torch.rand(LAYOUT.block_shape, generator=self.gen)
            if self.storage is not None:
                self.storage.write_block(Medium.HBM, blocks[i].block_id, data)
            self.pool.cache_block(blocks[i], keys[i], keys[i - 1] if i else ROOT)
            if blocks[i].key == keys[i]:
                self.content[keys[i]] = data
        return self.generation, blocks

    @rule(request=consumes(requests))
    def finish_request(self, request: tuple[int, list[Block]]) -> None:
        generation, blocks = request
        if generation != self.generation and blocks:
            with pytest.raises(PoolError):
                self.pool.free(blocks[::-1])
            return
        self.pool.free(blocks[::-1])
        self._release(blocks)

    @rule(target=readers, pick=st.integers(0, 1 << 16))
    def pin_reader(self, pick: int) -> tuple[int, list[Block], list[bytes]]:
        """Pin a run some request computed, wherever it sits now, as a KV transfer's
        sender does."""
        keys = self.chains[pick % len(self.chains)] if self.chains else []
        blocks = self.pool.match_prefix(keys)
        self.pool.pin(blocks)
        self._hold(blocks)
        seen = [self._bytes(b) for b in blocks]
        self.pinned.append((blocks, seen))
        return self.generation, blocks, seen

    @rule(reader=consumes(readers))
    def unpin_reader(self, reader: tuple[int, list[Block], list[bytes]]) -> None:
        generation, blocks, seen = reader
        if generation != self.generation:
            if blocks:
                with pytest.raises(PoolError):
                    self.pool.free(blocks)
            return
        assert [self._bytes(b) for b in blocks] == seen
        self.pool.free(blocks)
        self._release(blocks)
        self.pinned.remove((blocks, seen))

    def _bytes(self, block: Block) -> bytes:
        if self.storage is None:
            return b""
        return self.storage.read_bytes(block.medium, block.block_id)

    @rule(n=st.integers(1, 8))
    def pressure(self, n: int) -> None:
        """Allocate and free at once, pushing cached blocks down the tiers (as many as
        are allocatable when ``n`` are not)."""
        if not self.pool.can_allocate(n):
            with pytest.raises(PoolExhaustedError):
                self.pool.allocate(n)
            n = self.pool.num_free(Medium.HBM)
        self.pool.free(self.pool.allocate(n))

    @rule()
    def clear(self) -> None:
        self.pool.clear_cache()

    @rule(request=requests)
    def double_free(self, request: tuple[int, list[Block]]) -> None:
        blocks = request[1]
        if not blocks:
            return
        victim = blocks[0]
        extra = [victim] * (victim.ref_cnt + 1)
        with pytest.raises(PoolError):
            self.pool.free(extra)

    @rule(tokens=prompts)
    def bad_use(self, tokens: list[int]) -> None:
        with pytest.raises(PoolError):
            self.pool.free([Block(0, Medium.HBM, ref_cnt=1)])
        for block in self.pool.match_prefix(block_keys(tokens, 1, ROOT)):
            if block.medium is not Medium.HBM:
                with pytest.raises(PoolError):
                    self.pool.cache_block(block, 1, None)

    @precondition(lambda self: self.with_storage and self.cap.ssd > 0)
    @rule()
    def restart(self) -> None:
        """Drop every in-flight request and reopen the pool over the same SSD directory."""
        on_ssd = set(self.pool.snapshot()[Medium.SSD])
        assert self.storage is not None
        self.storage.close()
        self.refs.clear()
        self.known.clear()
        self.pinned.clear()
        self.generation += 1
        self.pool = self._open()
        self.replay = EventReplay()
        assert set(self.pool.snapshot()[Medium.SSD]) == on_ssd
        assert not self.pool.snapshot()[Medium.HBM]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.verify()
        self.replay.apply(pool.take_events())
        snap = pool.snapshot()
        assert self.replay.matches(snap)
        all_keys = [k for m in MEDIA for k in snap[m]]
        assert len(all_keys) == len(set(all_keys))
        for m in MEDIA:
            for key in snap[m]:
                (block,) = pool.match_prefix([key])
                assert (block.medium, block.key) == (m, key)
                if self.storage is not None:
                    stored = self.storage.read_block(m, block.block_id)
                    assert torch.equal(stored, self.content[key])
        for block_id, block in self.known.items():
            assert block.ref_cnt == self.refs[block_id] >= 0
        for blocks, seen in self.pinned:
            assert [self._bytes(b) for b in blocks] == seen
        in_use = {i for i, c in self.refs.items() if c > 0}
        for m in MEDIA:
            held = {i for i in in_use if self.known[i].medium is m}
            assert pool.num_free(m) + len(held) == self.cap.of(m)
            # A pinned slot holds data (the bytes being read) even once its key moved on.
            holding = held | {id(pool.match_prefix([k])[0]) for k in snap[m]}
            assert pool.usage()[m] == len(holding)


class MetadataPoolMachine(PoolMachine):
    with_storage = False


class TensorPoolMachine(PoolMachine):
    with_storage = True


_fast = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

MetadataPoolMachine.TestCase.settings = settings(_fast, max_examples=250)
TensorPoolMachine.TestCase.settings = settings(_fast, max_examples=30)

TestMetadataPool = MetadataPoolMachine.TestCase
TestTensorPool = TensorPoolMachine.TestCase
