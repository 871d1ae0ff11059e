"""Block leases of a prefill worker: what a decoder will pull stays put until it is pulled."""

from __future__ import annotations

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.pd import Leases
from engine_worker.scheduler import Scheduler, SchedulerConfig
from indexer.keys import block_keys, root_parent
from indexer.media import Medium

ROOT = root_parent("lease-model")
B = 4


def cache(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Compute ``tokens`` as a finished request leaves them: cached, unreferenced."""
    keys = block_keys(tokens, B, ROOT)
    blocks = pool.allocate(len(keys))
    for i, (block, key) in enumerate(zip(blocks, keys, strict=True)):
        pool.cache_block(block, key, keys[i - 1] if i else ROOT)
    pool.free(blocks[::-1])
    return keys


def test_a_lease_holds_the_prompts_run_on_every_tier_and_counts_no_hit() -> None:
    pool = BlockPool(TierCapacity(hbm=4, dram=2, ssd=2))
    s = Scheduler(SchedulerConfig(max_model_len=16), pool, B)
    prompt = cache(pool, list(range(16)))  # 4 blocks
    # Pressure between the prefill's end and the lease pushed the prompt's tail down
    # (a request's tail is evicted first).
    cache(pool, list(range(100, 108)))
    media = [b.medium for b in pool.match_prefix(prompt)]
    assert media == [Medium.HBM, Medium.HBM, Medium.DRAM, Medium.DRAM]
    leases = Leases()
    # Only the leading HBM run was held before: the decoder then recomputed the rest.
    assert leases.hold(s, "r1", prompt, ttl_s=30.0) == prompt
    assert pool.stats().hits == {m: 0 for m in Medium}
    # Held: more traffic evicts everything else, never the leased blocks, wherever they are.
    for start in range(200, 240, 8):
        cache(pool, list(range(start, start + 8)))
        pool.verify()
    assert [b.medium for b in pool.match_prefix(prompt)] == media
    assert leases.release(s, "r1")
    assert [pool.num_free(m) for m in Medium] == [4, 2, 2]
    pool.verify()


def test_an_expired_lease_lets_go_of_its_lower_tier_blocks() -> None:
    pool = BlockPool(TierCapacity(hbm=4, dram=2))
    s = Scheduler(SchedulerConfig(max_model_len=16), pool, B)
    prompt = cache(pool, list(range(16)))
    cache(pool, list(range(100, 108)))
    leases = Leases()
    leases.hold(s, "r1", prompt, ttl_s=1.0)
    assert pool.num_free(Medium.DRAM) == 0
    assert leases.expire(s, now=0.0) == 0
    assert leases.expire(s, now=1e12) == 1
    assert pool.num_free(Medium.DRAM) == 2
    assert len(pool.match_prefix(prompt)) == 4  # released, still cached
    pool.verify()
