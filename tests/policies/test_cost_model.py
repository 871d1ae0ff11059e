"""The shared time estimates: chunking, the decode batch's share, cached prompts, loads."""

from __future__ import annotations

import math

import pytest
from msgspec.structs import replace

from indexer.media import Medium
from policies.cost_model import (
    decode_batch,
    displacement_seconds,
    hbm_room_blocks,
    load_seconds,
    memory_wait_seconds,
    prefill_context,
    prefill_seconds,
    queue_seconds,
    reload_seconds,
    split_prompt,
    step_in_progress,
)
from tests.engine_worker.test_scheduler import make, req, run_to_end
from tests.policies.support import BLOCK, PROFILE, chunked_seconds, match, queue_wait, view


def test_without_decodes_prefill_is_the_profiles_own_chunked_prefill() -> None:
    for new, cached in [(1, 0), (8192, 0), (20_000, 3_000)]:
        assert prefill_seconds(PROFILE, new, cached) == pytest.approx(
            PROFILE.prefill_seconds(new, cached)
        )


def test_decodes_take_part_of_every_step_budget() -> None:
    budget = PROFILE.max_num_batched_tokens
    # Exactly one step's worth of tokens fits alone, but needs a second step beside 100 decodes.
    alone = queue_seconds(PROFILE, budget)
    beside = queue_seconds(PROFILE, budget, decode_batch=100, decode_kv_tokens=100_000)

    assert alone == pytest.approx(PROFILE.prefill_seconds(budget))
    two_steps = PROFILE.step_seconds([(budget - 100, 0)], 100, 100_000) + PROFILE.step_seconds(
        [(100, 0)], 100, 100_000
    )
    assert beside == pytest.approx(two_steps)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    assert split_prompt(64, matched_blocks=4, block_size=BLOCK) == (63, 1)
    assert split_prompt(70, matched_blocks=4, block_size=BLOCK) == (64, 6)
    assert split_prompt(0, matched_blocks=0, block_size=BLOCK) == (0, 0)
    with pytest.raises(ValueError, match="block_size"):
        split_prompt(10, 0, 0)


def test_loads_use_measured_bandwidth_first_and_hbm_is_free() -> None:
    kv = PROFILE.kv_bytes_per_token
    measured = view("w", bandwidth={Medium.DRAM: 10e9})
    held = match("w", hbm=50, dram=10, ssd=5)

    expected = 10 * BLOCK * kv / 10e9 + 5 * BLOCK * kv / PROFILE.load_bandwidth[Medium.SSD]
    assert load_seconds(measured, PROFILE, held, BLOCK) == pytest.approx(expected)
    assert load_seconds(measured, PROFILE, match("w", hbm=50), BLOCK) == 0.0
    assert load_seconds(measured, PROFILE, None, BLOCK) == 0.0


def test_a_queued_long_prompt_pays_the_attention_of_its_later_chunks() -> None:
    # One queued 100K-token prompt: new * (cached + new / 2) = 100K^2 / 2 of context.
    long = queue_seconds(PROFILE, 100_000, queued_context=100_000 * 100_000 // 2)
    assert long == pytest.approx(chunked_seconds(PROFILE, 100_000))
    # The same tokens as 100 separate 1K-token prompts attend to far less.
    short = queue_seconds(PROFILE, 100_000, queued_context=100 * 1_000 * 1_000 // 2)
    assert short == pytest.approx(queue_wait(PROFILE, 100_000))
    assert long > 3 * short
    # Without the published context the queue is costed as fresh chunks, as before.
    assert queue_seconds(PROFILE, 100_000) == pytest.approx(queue_wait(PROFILE, 100_000))


def test_the_decode_batch_is_the_published_running_context_else_a_mean() -> None:
    assert decode_batch(view("w", running=4, running_kv=50_000), 2048) == (4, 50_000)
    assert decode_batch(view("w", running=4), 2048) == (4, 4 * 2048)
    assert decode_batch(view("w"), 2048) == (0, 0)


def test_no_memory_wait_while_the_new_prompt_fits_beside_what_is_held() -> None:
    # 10,000 blocks: 6,000 held by 10 running requests, which will each grow by half
    # of 160 output tokens (50 blocks in all); a 32K-token prompt needs 2,000.
    roomy = view("w", running=10, active=6_000, running_kv=96_000)
    assert memory_wait_seconds(roomy, PROFILE, 32_000, BLOCK, 160.0) == 0.0
    # An older worker that does not publish its active blocks: no estimate.
    unknown = view("w", running=10, running_kv=96_000)
    assert memory_wait_seconds(unknown, PROFILE, 150_000, BLOCK, 160.0) == 0.0


def test_a_prompt_that_overflows_hbm_waits_for_running_requests_to_finish() -> None:
    # 9,500 of 10,000 blocks held by 10 running requests, 2,000 queued tokens (125 blocks)
    # and 160 output tokens to come (half each on average: 50 blocks). A 16K-token prompt
    # (1,000 blocks) finds 325 free: it computes those, is preempted, and waits until
    # enough requests finish to free the other 675 blocks (~960 each: 1 completion).
    full = view("w", running=10, queued=2_000, active=9_500, running_kv=150_000)
    wait = memory_wait_seconds(full, PROFILE, 16_000, BLOCK, 160.0)
    one_finishes = 160 * PROFILE.decode_seconds(10, 150_000) / 10
    wasted = PROFILE.prefill_seconds(325 * BLOCK)
    assert wait == pytest.approx(one_finishes + wasted)
    # Twice the overflow, twice the completions to wait for.
    bigger = memory_wait_seconds(full, PROFILE, 27_000, BLOCK, 160.0)
    assert bigger == pytest.approx(2 * one_finishes + wasted)
    # Longer outputs hold memory longer.
    assert memory_wait_seconds(full, PROFILE, 16_000, BLOCK, 640.0) > 4 * one_finishes


def test_requests_routed_since_the_heartbeat_count_their_whole_output() -> None:
    # The groups replay at 1 s heartbeats (seed 2, t = 1.83 s): the heartbeat shows 5
    # running requests and 2,496 of 2,560 blocks held; the router has 13 in flight there
    # since (its own count, overlaid). Half a 130-token mean output for 5 requests leaves
    # room for a 16-token prompt, and it was routed there, preempted, and waited 443 ms.
    # The 8 requests the heartbeat does not show hold what they generated so far as well
    # as what is to come: a whole mean output each, and there is no room.
    stale = view("w", running=5, in_flight=13, active=2_496, running_kv=22_000, hbm_capacity=2_560)
    room = hbm_room_blocks(stale, BLOCK, 130.0)
    assert room == pytest.approx(2_560 - 2_496 - (5 + 2 * 8) * 65 / BLOCK)
    assert memory_wait_seconds(stale, PROFILE, 16, BLOCK, 130.0) > 0.0
    # The same worker once the heartbeat has caught up (all 13 running): half each.
    fresh = view("w", running=13, in_flight=13, active=2_496, running_kv=22_000, hbm_capacity=2_560)
    assert hbm_room_blocks(fresh, BLOCK, 130.0) == pytest.approx(2_560 - 2_496 - 13 * 65 / BLOCK)


def test_a_prefix_loaded_from_dram_needs_hbm_room_like_computed_blocks() -> None:
    # 9,800 of 10,000 blocks held, 10 running with 160 tokens to come (half each: 50
    # blocks): 150 blocks of room. A prompt with 16 new tokens fits; the same prompt
    # whose 4K-token cached prefix (256 blocks) sits in DRAM must bring it into HBM
    # first, and it does not fit.
    full = view("w", running=10, active=9_800, running_kv=150_000)
    assert memory_wait_seconds(full, PROFILE, 16, BLOCK, 160.0) == 0.0
    assert memory_wait_seconds(full, PROFILE, 16, BLOCK, 160.0, loaded_blocks=100) == 0.0
    assert memory_wait_seconds(full, PROFILE, 16, BLOCK, 160.0, loaded_blocks=256) > 0.0


def test_prefill_context_is_what_a_worker_publishes_for_the_prompts_it_queued() -> None:
    # The router counts the attention work of the prompts it routed with the formula a
    # worker's heartbeat uses: a real scheduler, one prompt hitting a cached prefix.
    s, r, _ = make(hbm=64, budget=64, max_model_len=128)
    shared = list(range(32))
    s.add(req("a", [*shared, 1, 2], max_tokens=1))
    run_to_end(s, r)
    s.add(req("hit", [*shared, *range(200, 240)], max_tokens=1))
    s.add(req("cold", list(range(900, 935)), max_tokens=1))
    published = s.load().queued_prefill_context
    assert published == prefill_context(72, 40) + prefill_context(35, 35)
    assert prefill_context(72, 40) == 40 * 32 + 40 * 40 // 2
    # Out-of-range counts are clamped, never negative work.
    assert prefill_context(10, 50) == prefill_context(10, 10)
    assert prefill_context(10, -3) == 0


def test_new_blocks_evict_live_cached_blocks_only_beyond_the_spare_room() -> None:
    # 10,000 blocks, 6,000 held by 10 running requests that will grow by 50 blocks in all:
    # 3,950 blocks of room, 3,700 of them holding blocks other requests come back for.
    w = view("w", running=10, active=6_000, running_kv=96_000, dram_capacity=20_000)
    one_block = BLOCK * PROFILE.kv_bytes_per_token / PROFILE.load_bandwidth[Medium.DRAM]

    def displaced(added: int, live: int = 3_700) -> float:
        return displacement_seconds(w, PROFILE, added, live, BLOCK, 160.0)

    assert displaced(250) == 0.0  # fits in the 250 spare blocks
    assert displaced(400) == pytest.approx(150 * one_block)  # 150 live blocks go to DRAM
    assert displaced(400, live=0) == 0.0  # a dead cache costs nothing to evict
    assert displaced(20_000, live=100) == pytest.approx(100 * one_block)  # at most all
    assert displaced(0) == 0.0
    # An older worker that does not publish its active blocks: no estimate.
    unknown = view("w", running=10, running_kv=96_000)
    assert displacement_seconds(unknown, PROFILE, 20_000, 3_700, BLOCK, 160.0) == 0.0


def test_a_block_evicted_from_a_worker_without_dram_costs_its_recompute() -> None:
    # The block pool demotes an evicted HBM block to the next tier the worker has: DRAM,
    # else SSD; with HBM only (vLLM and SGLang without offloading) it is gone, and the
    # request that comes back for it recomputes it, ~7x a DRAM load for 150 blocks here.
    tokens_150 = 150 * BLOCK
    ssd_block = BLOCK * PROFILE.kv_bytes_per_token / PROFILE.load_bandwidth[Medium.SSD]
    recompute = PROFILE.prefill_seconds(tokens_150) - PROFILE.prefill[0]

    def displaced(dram: int = 0, ssd: int = 0) -> float:
        w = view(
            "w", running=10, active=6_000, running_kv=96_000, dram_capacity=dram, ssd_capacity=ssd
        )
        return displacement_seconds(w, PROFILE, 400, 3_700, BLOCK, 160.0)

    dram = displaced(dram=20_000, ssd=40_000)
    assert displaced(ssd=40_000) == pytest.approx(150 * ssd_block)
    assert displaced() == pytest.approx(recompute)
    assert dram < displaced() / 5
    # No capacities published at all: taken as a worker with DRAM, as before.
    bare = replace(view("w", running=10, active=6_000, running_kv=96_000), kv_capacity_blocks={})
    assert reload_seconds(bare, PROFILE, 150, BLOCK) == pytest.approx(dram)
    assert reload_seconds(bare, PROFILE, 0, BLOCK) == 0.0


def test_a_prompt_larger_than_an_idle_workers_hbm_waits_long_but_finitely() -> None:
    # Found live (`make run`, 1,024 blocks of HBM per worker): a 20K-token prompt on idle
    # workers, which nothing running will ever make room for, divided by the blocks held
    # (none): the gateway answered 500 instead of passing on the worker's 400.
    idle = view("w", hbm_capacity=1_024)
    assert memory_wait_seconds(idle, PROFILE, 16_000, BLOCK, 160.0) == 0.0  # 1,000 blocks fit
    over = memory_wait_seconds(idle, PROFILE, 20_000, BLOCK, 160.0)
    assert math.isfinite(over)
    assert over > 10.0  # far longer than any worker that could hold it would take
    assert memory_wait_seconds(idle, PROFILE, 40_000, BLOCK, 160.0) > over


def test_a_step_in_progress_is_waited_out_for_what_is_left_of_it() -> None:
    # A 4,352-token prompt fills the step in progress (one ~93 ms chunk), 30 ms from its end.
    chunk = 4352
    context = chunk * chunk // 2
    in_step = (0.030, chunk, context)
    whole = queue_seconds(PROFILE, chunk, queued_context=context)
    assert whole > 0.09
    assert queue_seconds(PROFILE, chunk, queued_context=context, step=in_step) == 0.030
    # Tokens queued beyond the step are chunked after it ends.
    behind = 8192 + chunk
    assert queue_seconds(
        PROFILE, behind, queued_context=context + 8192 * 8192 // 2, step=in_step
    ) == pytest.approx(0.030 + queue_wait(PROFILE, 8192))
    # A worker only decoding: what is left of its decode step, not half a step on average.
    decoding = queue_seconds(PROFILE, 0, 8, 20_000, step=(0.001, 0, 0))
    assert decoding == 0.001
    assert queue_seconds(PROFILE, 0, 8, 20_000) == pytest.approx(
        PROFILE.decode_seconds(8, 20_000) / 2
    )


def test_the_step_in_progress_is_known_only_until_the_view_says_it_ends() -> None:
    mid = replace(view("w", queued=4352), step_ends_ts=10.0, step_prefill_tokens=4352)
    step = step_in_progress(mid, 9.97)
    assert step is not None
    left, tokens, context = step
    assert left == pytest.approx(0.03)
    assert (tokens, context) == (4352, 0)
    # A heartbeat older than its step: that step is over, the next one's start unknown.
    assert step_in_progress(mid, 10.0) is None
    assert step_in_progress(mid, 10.5) is None
    # Not published (an older worker, a vLLM engine) or no step running.
    assert step_in_progress(view("w", queued=4352), 9.97) is None


def test_a_full_hbm_waits_for_the_releases_the_worker_names() -> None:
    # The agent replay (seed 1 at 0.7 of capacity, t = 4.04 s): 4 running requests hold
    # 5,472 of 6,144 blocks, and the queue ahead of a 10K-token prompt (8,435 tokens to
    # compute) takes 1,189 cached blocks and its 11,787 tokens' on admission. Three
    # requests decode their last outputs, but the queued next steps of their agents
    # take their histories back: they free 5 blocks each. Only the fourth, which still
    # prefills 10,397 tokens and has 95 outputs to go, frees enough (1,790): the wait
    # was 1.32 s. Finishing one every mean-output / running steps, as a view without
    # the releases is priced, the wait looked a quarter of that, and the prompt went
    # behind it.
    kv = 95_879
    base = view("w", running=4, waiting=4, in_flight=8, queued=11_787, active=5_472,
                running_kv=kv, hbm_capacity=6_144, mean_output=36.0, ts=4.04)  # fmt: skip
    base = replace(base, queued_taken_blocks=1_189)
    full = replace(base, kv_release=[(0, 22, 5), (0, 25, 4), (0, 28, 5), (10_397, 95, 1_790)])
    prompt = 8_435
    blind = memory_wait_seconds(base, PROFILE, prompt, BLOCK, 36.0)
    wait = memory_wait_seconds(full, PROFILE, prompt, BLOCK, 36.0)
    # The fourth finishes after the running prefill and then its 95 outputs, one step
    # each, beside the three decoding.
    prefill = queue_seconds(PROFILE, 10_397, 4, kv)
    # (the queue ahead leaves no room: nothing is computed and wasted before it).
    assert wait == pytest.approx(prefill + 95 * PROFILE.decode_seconds(4, kv))
    assert wait > 2.5 * blind
    # Counted from the heartbeat: half a second later, half a second less to wait.
    later = memory_wait_seconds(full, PROFILE, prompt, BLOCK, 36.0, now=4.54)
    assert later == pytest.approx(wait - 0.5)
    # Releases that never make room: the queued requests must run and finish too, and
    # the wait is no shorter than the last release.
    short = replace(full, kv_release=[(0, 3, 5)])
    last = 3 * PROFILE.decode_seconds(4, kv)
    assert memory_wait_seconds(short, PROFILE, prompt, BLOCK, 36.0) >= last
