"""The shared time estimates: chunking, the decode batch's share, cached prompts, loads."""

from __future__ import annotations

import pytest

from indexer.media import Medium
from policies.cost_model import load_seconds, prefill_seconds, queue_seconds, split_prompt
from tests.policies.support import BLOCK, PROFILE, match, view


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
