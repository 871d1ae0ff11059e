"""The paged-attention Llama against transformers on the same (tiny, random) weights.

Tolerance: max abs logit difference <= 1e-4 in float32 (logits here span
about +-20, so that is float32 rounding, not a modelling difference).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_worker.model.batch import BatchError, blocks_needed
from engine_worker.model.config import ModelConfig
from engine_worker.model.errors import ModelError
from engine_worker.model.llama import ForwardBatch, LlamaModel, SeqInput
from engine_worker.model.tiny import tiny_model
from tests.engine_worker.model_refs import (
    FLOAT32_TOL,
    empty_cache,
    hf_llama_from,
    hf_logits,
    prefill_logits,
)

BLOCK = 4


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return tiny_model(seed=0)[1]


@pytest.fixture(scope="module")
def hf_tiny(tiny: LlamaModel) -> torch.nn.Module:
    return hf_llama_from(tiny)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def shuffled_table(num_blocks: int, need: int, seed: int) -> list[int]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:need]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_one_shot_prefill_matches_transformers(tiny: LlamaModel, hf_tiny: torch.nn.Module) -> None:
    ids = prompt(23, seed=1)
    ours = prefill_logits(tiny, ids)
    ref = hf_logits(hf_tiny, ids)[-1]
    assert max_diff(ours, ref) <= FLOAT32_TOL
    assert int(ours.argmax()) == int(ref.argmax())


def test_chunked_prefill_then_decode_through_shuffled_blocks(
    tiny: LlamaModel, hf_tiny: torch.nn.Module
) -> None:
    ids = prompt(23, seed=2)
    ref = hf_logits(hf_tiny, ids)
    cache = empty_cache(tiny.config, 32, BLOCK)
    table = shuffled_table(32, blocks_needed(len(ids), BLOCK), seed=3)
    assert table != sorted(table)
    steps = [10, 7] + [1] * 6
    done = 0
    for n in steps:
        batch = ForwardBatch(torch.tensor(ids[done : done + n]), [SeqInput(done, n, table)])
        logits = tiny(batch, cache)
        done += n
        assert logits.shape == (1, tiny.config.vocab_size)
        assert max_diff(logits[0], ref[done - 1]) <= FLOAT32_TOL, f"after {done} tokens"
    assert done == len(ids)


def test_mixed_batch_of_three_sequences_in_one_forward(
    tiny: LlamaModel, hf_tiny: torch.nn.Module
) -> None:
    """A fresh prefill, a second chunk and a decode step share one forward."""
    a, b, c = prompt(9, seed=4), prompt(14, seed=5), prompt(6, seed=6)
    cache = empty_cache(tiny.config, 24, BLOCK)
    blocks = shuffled_table(24, 24, seed=7)
    ta, tb, tc = blocks[:3], blocks[3:7], blocks[7:9]
    # Warm b (first 8 tokens) and c (first 5) in earlier forwards.
    tiny(ForwardBatch(torch.tensor(b[:8]), [SeqInput(0, 8, tb)]), cache)
    tiny(ForwardBatch(torch.tensor(c[:5]), [SeqInput(0, 5, tc)]), cache)

    batch = ForwardBatch(
        torch.tensor(a + b[8:] + c[5:]),
        [SeqInput(0, 9, ta), SeqInput(8, 6, tb), SeqInput(5, 1, tc)],
    )
    logits = tiny(batch, cache)
    assert logits.shape == (3, tiny.config.vocab_size)
    for row, seq in zip(logits, (a, b, c), strict=True):
        assert max_diff(row, hf_logits(hf_tiny, seq)[-1]) <= FLOAT32_TOL


def test_prefix_blocks_reused_from_another_sequence_give_cold_logits(tiny: LlamaModel) -> None:
    """Blocks prefilled by sequence A serve as B's cached prefix (a prefix-cache hit)."""
    shared = prompt(12, seed=8)  # 3 full blocks
    a = [*shared, *prompt(5, seed=9)]
    b = [*shared, *prompt(7, seed=10)]
    cache = empty_cache(tiny.config, 16, BLOCK)
    table_a = [9, 2, 14, 5, 11]
    tiny(ForwardBatch(torch.tensor(a), [SeqInput(0, len(a), table_a)]), cache)

    table_b = [*table_a[:3], 0, 7]
    warm = tiny(ForwardBatch(torch.tensor(b[12:]), [SeqInput(12, 7, table_b)]), cache)[0]
    cold = prefill_logits(tiny, b)
    assert max_diff(warm, cold) <= 1e-5
    # And A's own blocks past the shared prefix were not touched by B.
    again_a = tiny(ForwardBatch(torch.tensor(a[-1:]), [SeqInput(len(a) - 1, 1, table_a)]), cache)
    assert max_diff(again_a[0], prefill_logits(tiny, a)) <= 1e-5


def test_want_logits_selects_rows_in_batch_order(tiny: LlamaModel) -> None:
    a, b, c = prompt(5, seed=11), prompt(3, seed=12), prompt(4, seed=13)
    cache = empty_cache(tiny.config, 8, BLOCK)
    batch = ForwardBatch(
        torch.tensor(a + b + c),
        [
            SeqInput(0, 5, [0, 1], want_logits=True),
            SeqInput(0, 3, [2], want_logits=False),
            SeqInput(0, 4, [3], want_logits=True),
        ],
    )
    logits = tiny(batch, cache)
    assert logits.shape[0] == 2
    assert max_diff(logits[0], prefill_logits(tiny, a)) <= 1e-5
    assert max_diff(logits[1], prefill_logits(tiny, c)) <= 1e-5


def test_forward_writes_only_the_blocks_in_the_table(tiny: LlamaModel) -> None:
    cache = empty_cache(tiny.config, 10, BLOCK)
    ids = prompt(6, seed=14)
    tiny(ForwardBatch(torch.tensor(ids), [SeqInput(0, 6, [7, 3])]), cache)
    touched = {i for i in range(10) if cache[i].abs().sum() > 0}
    assert touched == {7, 3}
    # Slots past the sequence's end in its last block stay empty.
    assert cache[3, :, :, 2:].abs().sum() == 0
    assert cache[3, :, :, :2].abs().sum() > 0


def test_half_precision_kv_cache_stays_close(tiny: LlamaModel) -> None:
    ids = prompt(11, seed=15)
    cache = torch.zeros(
        4, *tiny.config.kv_layout(BLOCK, "float16").block_shape, dtype=torch.float16
    )
    logits = tiny(ForwardBatch(torch.tensor(ids), [SeqInput(0, 11, [0, 1, 2])]), cache)[0]
    assert cache.dtype == torch.float16
    assert max_diff(logits, prefill_logits(tiny, ids)) <= 0.05


def test_tiny_model_is_a_function_of_its_seed() -> None:
    ids = prompt(7, seed=16)
    first = prefill_logits(tiny_model(seed=3)[1], ids)
    assert torch.equal(first, prefill_logits(tiny_model(seed=3)[1], ids))
    assert not torch.allclose(first, prefill_logits(tiny_model(seed=4)[1], ids))


@pytest.mark.parametrize(
    ("seqs", "num_ids", "match"),
    [
        ([SeqInput(0, 9, [0, 1])], 9, "block table has 2 blocks"),
        ([SeqInput(0, 4, [0])], 5, "input_ids must be 1-D"),
        ([SeqInput(0, 4, [8])], 4, r"block ids must lie in \[0, 8\)"),
        ([SeqInput(0, 0, [0])], 0, "num_new >= 1"),
        ([], 0, "at least one sequence"),
    ],
)
def test_bad_batches_are_refused_without_touching_the_cache(
    tiny: LlamaModel, seqs: list[SeqInput], num_ids: int, match: str
) -> None:
    cache = empty_cache(tiny.config, 8, BLOCK)
    with pytest.raises(BatchError, match=match):
        tiny(ForwardBatch(torch.tensor(prompt(num_ids, seed=17), dtype=torch.int64), seqs), cache)
    assert cache.abs().sum() == 0


def test_out_of_vocab_ids_and_wrong_cache_shape_are_refused(tiny: LlamaModel) -> None:
    cache = empty_cache(tiny.config, 4, BLOCK)
    with pytest.raises(BatchError, match="token ids must lie"):
        tiny(ForwardBatch(torch.tensor([5, 49152]), [SeqInput(0, 2, [0])]), cache)
    with pytest.raises(BatchError, match="kv_cache must be"):
        tiny(ForwardBatch(torch.tensor([5]), [SeqInput(0, 1, [0])]), cache[:, :1])
    assert cache.abs().sum() == 0


def test_positions_past_the_context_length_are_refused() -> None:
    config = ModelConfig(
        name="short", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=8,
    )  # fmt: skip
    model = LlamaModel(config)
    cache = empty_cache(config, 4, BLOCK)
    with pytest.raises(BatchError, match="context length 8"):
        model(ForwardBatch(torch.arange(9), [SeqInput(0, 9, [0, 1, 2])]), cache)


def test_config_validation_and_kv_layout() -> None:
    config = tiny_model()[0]
    layout = config.kv_layout(16)
    assert layout.block_shape == (2, 2, 16, 2, 16)
    assert layout.block_bytes == 2 * 2 * 16 * 2 * 16 * 4
    assert config.kv_layout(16, "bfloat16").block_bytes == layout.block_bytes // 2
    assert config.num_params == sum(p.numel() for p in tiny_model()[1].parameters())
    with pytest.raises(ModelError, match="multiple of num_kv_heads"):
        ModelConfig("x", 10, 8, 8, 1, num_heads=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ModelError, match="vocab_size must be a positive integer"):
        ModelConfig("x", 0, 8, 8, 1, num_heads=2, num_kv_heads=2, head_dim=4)
