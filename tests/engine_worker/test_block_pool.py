"""The block pool in metadata-only mode: allocation, prefix hits, LRU tiers, events, bad use."""

from __future__ import annotations

import pytest

from engine_worker.block_pool import (
    Block,
    BlockPool,
    PoolError,
    PoolExhaustedError,
    TierCapacity,
)
from indexer.events import AllCleared, BlockRemoved, BlockStored
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from tests.engine_worker.event_replay import EventReplay

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
ROOT = root_parent("test-model")


def chain(*tokens: int) -> list[int]:
    """Block keys of a prompt with one token per block."""
    return block_keys(list(tokens), 1, ROOT)


def run_request(pool: BlockPool, keys: list[int]) -> list[Block]:
    """Compute a request: reuse its cached prefix, allocate and cache the rest."""
    hit = pool.acquire(pool.match_prefix(keys))
    new = pool.allocate(len(keys) - len(hit))
    blocks = hit + new
    for i in range(len(hit), len(keys)):
        pool.cache_block(blocks[i], keys[i], keys[i - 1] if i else ROOT)
    return blocks


def finish(pool: BlockPool, blocks: list[Block]) -> None:
    pool.free(blocks[::-1])


def state(pool: BlockPool) -> tuple[object, ...]:
    """Everything a caller can observe, to prove that a failed call changed nothing."""
    return (
        pool.snapshot(),
        pool.usage(),
        [pool.num_free(m) for m in (HBM, DRAM, SSD)],
        pool.stats(),
    )


def test_allocate_hands_out_distinct_fresh_hbm_blocks() -> None:
    pool = BlockPool(TierCapacity(hbm=4))
    blocks = pool.allocate(3)
    assert len({b.block_id for b in blocks}) == 3
    assert all(b.medium is HBM and b.ref_cnt == 1 and b.key is None for b in blocks)
    assert pool.num_free() == 1
    assert pool.usage()[HBM] == 3
    assert pool.can_allocate(1)
    assert not pool.can_allocate(2)
    assert pool.allocate(0) == []
    pool.verify()


def test_allocating_beyond_capacity_raises_and_changes_nothing() -> None:
    pool = BlockPool(TierCapacity(hbm=3, dram=1))
    finish(pool, run_request(pool, chain(1, 2)))
    pool.take_events()
    before = state(pool)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(4)
    assert state(pool) == before
    assert pool.take_events() == []
    pool.verify()
    with pytest.raises(PoolError):
        pool.allocate(-1)


def test_freed_cached_blocks_stay_matchable_and_match_is_pure() -> None:
    pool = BlockPool(TierCapacity(hbm=8))
    keys = chain(1, 2, 3)
    blocks = run_request(pool, keys)
    finish(pool, blocks)
    events = pool.take_events()
    assert events == [
        BlockStored(keys=[keys[0]], parent=ROOT, medium=HBM),
        BlockStored(keys=[keys[1]], parent=keys[0], medium=HBM),
        BlockStored(keys=[keys[2]], parent=keys[1], medium=HBM),
    ]
    match = pool.match_prefix([*chain(1, 2), *chain(9)])
    assert match == blocks[:2]
    assert pool.match_prefix(chain(1, 2, 3, 4)) == blocks
    assert pool.match_prefix(chain(5)) == []
    assert all(b.ref_cnt == 0 for b in blocks)
    assert pool.take_events() == []
    assert pool.num_free() == 8


def test_eviction_takes_empty_blocks_first_then_least_recently_used_tail_first() -> None:
    pool = BlockPool(TierCapacity(hbm=4))
    a = chain(1, 2, 3)
    finish(pool, run_request(pool, a))
    pool.take_events()
    pool.allocate(1)  # the one never-used block goes first: nothing evicted
    assert pool.take_events() == []
    pool.allocate(1)  # then the request's tail block, freed first (reverse order)
    assert pool.take_events() == [BlockRemoved(keys=[a[2]], medium=HBM)]
    assert len(pool.match_prefix(a)) == 2
    assert pool.stats().evictions[HBM] == 1


def test_a_hit_refreshes_recency() -> None:
    pool = BlockPool(TierCapacity(hbm=2))
    a, b = chain(1), chain(2)
    finish(pool, run_request(pool, a))
    finish(pool, run_request(pool, b))
    finish(pool, run_request(pool, a))  # a is now the most recently used
    pool.take_events()
    pool.allocate(1)
    assert pool.take_events() == [BlockRemoved(keys=b, medium=HBM)]


def test_eviction_cascades_down_the_tiers_with_ordered_events() -> None:
    pool = BlockPool(TierCapacity(hbm=1, dram=1, ssd=1))
    k1, k2, k3, k4 = (chain(t)[0] for t in (1, 2, 3, 4))
    for k in (k1, k2, k3):
        finish(pool, run_request(pool, [k]))
    assert pool.snapshot() == {HBM: [k3], DRAM: [k2], SSD: [k1]}
    pool.take_events()
    finish(pool, run_request(pool, [k4]))
    assert pool.take_events() == [
        BlockRemoved(keys=[k1], medium=SSD),
        BlockRemoved(keys=[k2], medium=DRAM),
        BlockStored(keys=[k2], parent=ROOT, medium=SSD),
        BlockRemoved(keys=[k3], medium=HBM),
        BlockStored(keys=[k3], parent=ROOT, medium=DRAM),
        BlockStored(keys=[k4], parent=ROOT, medium=HBM),
    ]
    stats = pool.stats()
    assert (stats.demotions[HBM], stats.demotions[DRAM], stats.evictions[SSD]) == (3, 2, 1)
    pool.verify()


def test_without_dram_an_evicted_block_goes_straight_to_ssd() -> None:
    pool = BlockPool(TierCapacity(hbm=1, ssd=2))
    k1, k2 = chain(1)[0], chain(2)[0]
    finish(pool, run_request(pool, [k1]))
    finish(pool, run_request(pool, [k2]))
    assert pool.snapshot() == {HBM: [k2], DRAM: [], SSD: [k1]}


def test_hbm_hit_shares_the_block_between_requests() -> None:
    pool = BlockPool(TierCapacity(hbm=4))
    keys = chain(1, 2)
    first = run_request(pool, keys)
    second = run_request(pool, [*keys, *chain(1, 2, 3)[2:]])
    assert second[:2] == first
    assert [b.ref_cnt for b in first] == [2, 2]
    finish(pool, first)
    assert [b.ref_cnt for b in first] == [1, 1]
    assert pool.num_free() == 1
    assert pool.stats().hits[HBM] == 2
    pool.verify()


def test_a_dram_hit_is_promoted_to_hbm() -> None:
    pool = BlockPool(TierCapacity(hbm=1, dram=2))
    k1, k2 = chain(1)[0], chain(2)[0]
    finish(pool, run_request(pool, [k1]))
    finish(pool, run_request(pool, [k2]))
    pool.take_events()
    (matched,) = pool.match_prefix([k1])
    assert matched.medium is DRAM
    (block,) = pool.acquire([matched])
    assert block.medium is HBM
    assert (block.key, block.ref_cnt) == (k1, 1)
    assert pool.take_events() == [
        BlockRemoved(keys=[k2], medium=HBM),
        BlockStored(keys=[k2], parent=ROOT, medium=DRAM),
        BlockRemoved(keys=[k1], medium=DRAM),
        BlockStored(keys=[k1], parent=ROOT, medium=HBM),
    ]
    assert pool.snapshot() == {HBM: [k1], DRAM: [k2], SSD: []}
    assert pool.stats().promotions[DRAM] == 1
    pool.verify()


def test_promotions_never_evict_the_blocks_being_acquired() -> None:
    # Both DRAM slots hold the prefix being promoted, so the first HBM victim has
    # nowhere to go and is dropped; the second lands in the slot the first promotion freed.
    pool = BlockPool(TierCapacity(hbm=2, dram=2))
    prefix = chain(1, 2)
    x, y = chain(7)[0], chain(8)[0]
    finish(pool, run_request(pool, prefix))
    finish(pool, run_request(pool, [x]))
    finish(pool, run_request(pool, [y]))
    assert pool.snapshot() == {HBM: [x, y], DRAM: prefix, SSD: []}
    blocks = pool.acquire(pool.match_prefix(prefix))
    assert [b.key for b in blocks] == prefix
    assert all(b.medium is HBM and b.ref_cnt == 1 for b in blocks)
    assert sorted(pool.snapshot()[HBM]) == sorted(prefix)
    assert len(pool.snapshot()[DRAM]) == 1
    assert pool.stats().evictions[HBM] == 1
    pool.verify()


def test_a_matched_unused_hbm_block_is_pinned_while_others_promote() -> None:
    pool = BlockPool(TierCapacity(hbm=2, dram=2))
    keys = chain(1, 2)
    finish(pool, run_request(pool, keys))  # keys[1] then keys[0] freed: keys[1] is the LRU
    other = chain(5)
    finish(pool, run_request(pool, other))  # evicts keys[1] to DRAM
    assert pool.snapshot() == {HBM: [keys[0], other[0]], DRAM: [keys[1]], SSD: []}
    # keys[0] is now the HBM LRU head; promoting keys[1] must evict `other`, not keys[0].
    blocks = pool.acquire(pool.match_prefix(keys))
    assert [b.key for b in blocks] == keys
    assert pool.snapshot() == {HBM: keys, DRAM: other, SSD: []}
    pool.verify()


def test_acquire_beyond_hbm_raises_and_changes_nothing() -> None:
    pool = BlockPool(TierCapacity(hbm=2, dram=2))
    keys = chain(1, 2)
    finish(pool, run_request(pool, keys))
    held = pool.allocate(2)  # pushes both cached blocks down to DRAM
    match = pool.match_prefix(keys)
    assert [b.medium for b in match] == [DRAM, DRAM]
    pool.take_events()
    before = state(pool)
    with pytest.raises(PoolExhaustedError):
        pool.acquire(match)
    assert state(pool) == before
    assert pool.take_events() == []
    pool.free(held[1:])
    with pytest.raises(PoolExhaustedError):
        pool.acquire(match)
    assert state(pool) != before
    pool.verify()


def test_acquiring_a_stale_or_repeated_match_raises() -> None:
    pool = BlockPool(TierCapacity(hbm=1))
    keys = chain(1)
    finish(pool, run_request(pool, keys))
    match = pool.match_prefix(keys)
    with pytest.raises(PoolError):
        pool.acquire([match[0], match[0]])
    assert match[0].ref_cnt == 0
    pool.free(pool.allocate(1))  # evicts the matched block
    with pytest.raises(PoolError):
        pool.acquire(match)
    pool.verify()


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(TierCapacity(hbm=4))
    a, b = pool.allocate(2)
    pool.free([b])
    before = state(pool)
    with pytest.raises(PoolError, match="double free"):
        pool.free([a, b])
    with pytest.raises(PoolError, match="double free"):
        pool.free([a, a])
    assert a.ref_cnt == 1
    assert state(pool) == before
    pool.verify()


def test_freeing_a_foreign_or_unpinned_lower_tier_block_raises() -> None:
    pool = BlockPool(TierCapacity(hbm=1, dram=1))
    other = BlockPool(TierCapacity(hbm=1))
    (mine,) = pool.allocate(1)
    for bad in (other.allocate(1)[0], Block(0, HBM, ref_cnt=1), Block(0, DRAM, ref_cnt=1)):
        with pytest.raises(PoolError, match="not a block of this pool"):
            pool.free([mine, bad])
        assert mine.ref_cnt == 1
    with pytest.raises(PoolError):
        pool.free([mine, "block 0"])  # type: ignore[list-item]
    assert mine.ref_cnt == 1
    # A lower-tier block of this pool carries no reference unless a reader pinned it.
    pool.cache_block(mine, chain(1)[0], ROOT)
    pool.free([mine])
    pool.free(pool.allocate(1))
    (lower,) = pool.match_prefix(chain(1))
    assert lower.medium is DRAM
    before = state(pool)
    with pytest.raises(PoolError, match="double free of dram block"):
        pool.free([lower])
    assert state(pool) == before
    pool.verify()


def test_a_pinned_lower_tier_block_keeps_its_slot_and_bytes_whatever_is_evicted() -> None:
    # What a KV transfer's sender relies on to read DRAM/SSD blocks outside the pool's
    # thread: no demotion reuses a pinned slot, so its bytes stay the key's.
    pool = BlockPool(TierCapacity(hbm=1, dram=2, ssd=1))
    k1, k2, k3 = chain(1)[0], chain(2)[0], chain(3)[0]
    for key in (k1, k2, k3):
        finish(pool, run_request(pool, [key]))
    assert pool.snapshot() == {HBM: [k3], DRAM: [k1, k2], SSD: []}
    (d1,) = pool.match_prefix([k1])
    assert pool.pin([d1]) == [d1]
    assert (pool.num_free(DRAM), pool.usage()[DRAM]) == (1, 2)
    # Four more requests push everything down: k1, the DRAM LRU, would have gone to SSD
    # first; pinned, it stays where it is and the others go past it.
    for token in range(4, 8):
        finish(pool, run_request(pool, chain(token)))
        pool.verify()
    snap = pool.snapshot()
    assert k1 in snap[DRAM]
    assert pool.match_prefix([k1]) == [d1]
    assert k2 not in snap[DRAM]
    assert pool.stats().hits == {m: 0 for m in Medium}  # reading is not a hit
    pool.free([d1])
    assert pool.num_free(DRAM) == 2
    pool.verify()
    # Released, it is an ordinary cached block again, the most recently used of its tier:
    # the second demotion after it takes it down.
    finish(pool, run_request(pool, chain(9)))
    assert k1 in pool.snapshot()[DRAM]
    finish(pool, run_request(pool, chain(10)))
    assert pool.snapshot()[SSD] == [k1]
    pool.verify()


def test_a_pinned_lower_tier_block_a_request_promotes_frees_its_slot_once_released() -> None:
    pool = BlockPool(TierCapacity(hbm=1, dram=2))
    k1, k2 = chain(1)[0], chain(2)[0]
    finish(pool, run_request(pool, [k1]))
    finish(pool, run_request(pool, [k2]))
    (d1,) = pool.match_prefix([k1])
    pool.pin([d1])
    pool.take_events()
    # A request hits k1 while a transfer reads it: the key moves up as usual...
    (h1,) = pool.acquire(pool.match_prefix([k1]))
    assert (h1.medium, h1.key) == (HBM, k1)
    assert pool.take_events() == [
        BlockRemoved(keys=[k2], medium=HBM),
        BlockStored(keys=[k2], parent=ROOT, medium=DRAM),
        BlockRemoved(keys=[k1], medium=DRAM),
        BlockStored(keys=[k1], parent=ROOT, medium=HBM),
    ]
    # ... but the slot the reader holds stays out of reach, holding the bytes, keyless.
    assert d1.key is None
    assert (pool.num_free(DRAM), pool.usage()[DRAM]) == (1, 2)  # k2's slot, d1's held
    pool.verify()
    pool.free([d1])  # the reader is done: the slot is empty and reusable
    assert (pool.num_free(DRAM), pool.usage()[DRAM]) == (2, 1)
    with pytest.raises(PoolError, match="double free"):
        pool.free([d1])
    finish(pool, [h1])
    pool.verify()


def test_pinning_refuses_uncached_foreign_or_repeated_blocks_and_changes_nothing() -> None:
    pool = BlockPool(TierCapacity(hbm=2, dram=1))
    k1 = chain(1)[0]
    finish(pool, run_request(pool, [k1]))
    (cached,) = pool.match_prefix([k1])
    (empty,) = pool.allocate(1)
    before = state(pool)
    for bad in ([empty], [Block(0, DRAM)], [cached, cached]):
        with pytest.raises(PoolError):
            pool.pin(bad)
        assert state(pool) == before
        assert cached.ref_cnt == 0
    pool.verify()


def test_clearing_the_cache_while_a_lower_tier_block_is_pinned() -> None:
    pool = BlockPool(TierCapacity(hbm=1, dram=1))
    finish(pool, run_request(pool, chain(1)))
    finish(pool, run_request(pool, chain(2)))
    (d1,) = pool.match_prefix(chain(1))
    pool.pin([d1])
    pool.clear_cache()
    assert pool.match_prefix(chain(1)) == []
    assert pool.usage()[DRAM] == 1  # still being read
    pool.verify()
    pool.free([d1])
    assert (pool.num_free(DRAM), pool.usage()[DRAM]) == (1, 0)
    pool.verify()


def test_cache_block_rejects_bad_use() -> None:
    pool = BlockPool(TierCapacity(hbm=2, dram=1))
    keys = chain(1, 2)
    finish(pool, run_request(pool, keys[:1]))
    (block,) = pool.allocate(1)  # the empty block
    pool.allocate(1)  # demotes keys[0] to DRAM
    (lower,) = pool.match_prefix(keys[:1])
    assert lower.medium is DRAM
    pool.take_events()
    before = state(pool)
    with pytest.raises(PoolError):
        pool.cache_block(lower, keys[1], keys[0])
    with pytest.raises(PoolError):
        pool.cache_block(block, 2**64, None)
    with pytest.raises(PoolError):
        pool.cache_block(block, keys[1], -1)
    pool.free([block])
    with pytest.raises(PoolError):
        pool.cache_block(block, keys[1], keys[0])
    assert pool.take_events() == []
    assert state(pool)[0] == before[0]
    pool.verify()


def test_caching_a_key_already_cached_elsewhere_keeps_one_copy() -> None:
    pool = BlockPool(TierCapacity(hbm=4))
    keys = chain(1)
    first = run_request(pool, keys)
    (dup,) = pool.allocate(1)
    pool.take_events()
    pool.cache_block(dup, keys[0], ROOT)
    assert dup.key is None
    assert pool.take_events() == []
    assert pool.stats().duplicates == 1
    pool.free([dup])
    assert pool.match_prefix(keys) == first
    with pytest.raises(PoolError):
        pool.cache_block(first[0], chain(2)[0], ROOT)
    pool.verify()


def test_clear_cache_forgets_every_key_even_in_use() -> None:
    pool = BlockPool(TierCapacity(hbm=3, dram=2))
    old = chain(1, 2, 3)
    finish(pool, run_request(pool, old))
    running = run_request(pool, chain(4, 5))
    replay = EventReplay()
    replay.apply(pool.take_events())
    assert pool.clear_cache() is True
    assert pool.take_events() == [AllCleared()]
    assert pool.snapshot() == {HBM: [], DRAM: [], SSD: []}
    assert pool.match_prefix(old) == []
    assert pool.usage() == {HBM: 2, DRAM: 0, SSD: 0}
    assert all(b.ref_cnt == 1 and b.key is None for b in running)
    finish(pool, running)
    assert pool.usage()[HBM] == 0
    assert pool.clear_cache() is False
    pool.verify()


def test_disabled_caching_never_matches_or_emits() -> None:
    pool = BlockPool(TierCapacity(hbm=2, dram=2), enable_caching=False)
    keys = chain(1, 2)
    finish(pool, run_request(pool, keys))
    finish(pool, run_request(pool, keys))
    assert pool.match_prefix(keys) == []
    assert pool.take_events() == []
    assert pool.usage() == {HBM: 0, DRAM: 0, SSD: 0}


@pytest.mark.parametrize(
    "kwargs",
    [{"hbm": 0}, {"hbm": 1, "dram": -1}, {"hbm": 1, "ssd": 1.5}, {"hbm": True}],
)
def test_bad_capacity_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(PoolError):
        TierCapacity(**kwargs)  # type: ignore[arg-type]
