"""The torch runner under the real scheduler: batching and preemption never change the tokens.

Greedy decoding is deterministic, so a request must get the same tokens
whether it runs alone, in a batch of eight of different lengths (prefill
chunks and decodes mixed in one forward), or preempted and recomputed when
HBM runs out. Tiny model in the fast suite, SmolLM2-135M in the slow one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine_worker.block_pool import TierCapacity
from engine_worker.model.llama import LlamaModel
from engine_worker.model.registry import resolve
from engine_worker.request import Request
from tests.engine_worker.worker_core import (
    BLOCK_SIZE,
    WorkerCore,
    build_core,
    random_tokens,
    run_to_completion,
)

#: Max abs difference of first-token logits, batched vs alone. Batching changes the matrix
#: shapes and so the float32 summation order: the tiny model stays within 1e-5; SmolLM2's
#: 30 layers and logits of magnitude ~25 reach ~2e-5, so it gets model_refs' 1e-4 (the
#: tolerance against transformers). Tokens must be identical either way.
LOGIT_TOL = {"tiny": 1e-5, "smollm2": 1e-4}
PROMPT_LENGTHS = [5, 17, 33, 48, 64, 90, 111, 130]
MAX_TOKENS = [12, 7, 16, 3, 10, 16, 5, 9]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine two threads spin-wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return resolve("tiny").load()[1]


def requests(core: WorkerCore, seed: int = 0) -> list[Request]:
    """Eight requests of different prompt and output lengths (the same ones for any core)."""
    vocab = core.config.vocab_size
    return [
        core.request(f"r{i}", random_tokens(n, seed + i, vocab), m)
        for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True))
    ]


def alone(model: LlamaModel, index: int) -> tuple[list[int], torch.Tensor, int]:
    """Tokens, first-token logits and step count of request ``index`` on a worker of its own."""
    core = build_core(model, TierCapacity(hbm=64))
    req = requests(core)[index]
    run_to_completion(core, [req])
    return req.output_token_ids, core.sampler.first_logits[req.request_id], core.steps


def check_batch_equals_alone(model: LlamaModel, budget: int, tol: float) -> None:
    core = build_core(model, TierCapacity(hbm=128), max_num_batched_tokens=budget)
    together = run_to_completion(core, requests(core))
    alone_steps = 0
    for i, rid in enumerate(together):
        tokens, logits, steps = alone(model, i)
        alone_steps += steps
        assert together[rid].output_token_ids == tokens, rid
        assert len(tokens) == MAX_TOKENS[i]
        torch.testing.assert_close(core.sampler.first_logits[rid], logits, atol=tol, rtol=0)
    # They did run together: far fewer steps than one after the other.
    assert core.steps < alone_steps / 2


def test_a_batch_of_eight_generates_what_each_request_generates_alone(tiny: LlamaModel) -> None:
    check_batch_equals_alone(tiny, budget=2048, tol=LOGIT_TOL["tiny"])


def test_chunked_prefill_mixed_with_decodes_changes_no_token(tiny: LlamaModel) -> None:
    check_batch_equals_alone(tiny, budget=48, tol=LOGIT_TOL["tiny"])


@pytest.mark.slow
def test_smollm2_batch_of_eight_generates_what_each_request_generates_alone() -> None:
    model = resolve("smollm2").load()[1]
    check_batch_equals_alone(model, budget=2048, tol=LOGIT_TOL["smollm2"])


def test_preemption_under_hbm_pressure_changes_no_token(tiny: LlamaModel) -> None:
    roomy = build_core(tiny, TierCapacity(hbm=128))
    expected = run_to_completion(roomy, requests(roomy, seed=50))
    assert roomy.preemptions == 0
    # 160 tokens of HBM for eight requests needing up to 139 each: they must take turns.
    tight = build_core(tiny, TierCapacity(hbm=10), max_model_len=10 * BLOCK_SIZE)
    got = run_to_completion(tight, requests(tight, seed=50))
    assert tight.preemptions > 0
    assert sum(r.num_preemptions for r in got.values()) == tight.preemptions
    assert {rid: r.output_token_ids for rid, r in got.items()} == {
        rid: r.output_token_ids for rid, r in expected.items()
    }


def test_preemption_without_prefix_caching_changes_no_token(tiny: LlamaModel) -> None:
    """Recomputing from scratch (no cached blocks to fall back on) gives the same tokens."""
    roomy = build_core(tiny, TierCapacity(hbm=128))
    expected = run_to_completion(roomy, requests(roomy, seed=70))
    tight = build_core(tiny, TierCapacity(hbm=10), max_model_len=10 * BLOCK_SIZE, caching=False)
    got = run_to_completion(tight, requests(tight, seed=70))
    assert tight.preemptions > 0
    assert tight.pool.stats().stored == 0
    assert {rid: r.output_token_ids for rid, r in got.items()} == {
        rid: r.output_token_ids for rid, r in expected.items()
    }


def test_every_step_feeds_the_profile_fit(tiny: LlamaModel) -> None:
    core = build_core(tiny, TierCapacity(hbm=64))
    run_to_completion(core, requests(core)[:3])
    assert len(core.runner.fitter) == core.steps > 0
    profile = core.runner.profile()
    assert profile.kv_bytes_per_token == core.storage.layout.bytes_per_token
