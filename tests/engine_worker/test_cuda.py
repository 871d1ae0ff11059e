"""The engine's torch paths on a CUDA device give what they give on the CPU.

CI has no GPU, so this module is skipped there; on a machine with one run
``pytest tests/engine_worker/test_cuda.py tests/engine_worker/test_tiers.py``
(docs/benchmarks.md, "CUDA check", says when it last ran and what it gave).
The CPU paths are checked against transformers elsewhere; here the same
model, requests and cache traffic run on the GPU: the paged forward, the
scheduler's mixed batches and preemption, prefix hits copied up from DRAM
and SSD into device memory, KV blocks pulled across devices over the data
socket, and a quantized GGUF dequantized onto the device.

Tolerance: float32 on the GPU sums in another order than on the CPU; logits
of the tiny model stay within ``CUDA_TOL`` (1e-4, the tolerance against
transformers); greedy tokens must be identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from engine_worker.block_pool import TierCapacity
from engine_worker.model.gguf_loader import load_gguf
from engine_worker.model.llama import ForwardBatch, LlamaModel, SeqInput
from engine_worker.model.tiny import random_model, tiny_model
from indexer.media import Medium
from tests.engine_worker.model_refs import empty_cache, write_llama_gguf
from tests.engine_worker.test_engine_tiers import (
    HBM_BLOCKS,
    PREFIX_BLOCKS,
    Prompts,
    ask,
    cold_answer,
    pull_prefix,
    push_prefix_to,
)
from tests.engine_worker.test_model_loaders import small_config
from tests.engine_worker.test_torch_runner import requests
from tests.engine_worker.worker_core import BLOCK_SIZE, build_core, random_tokens, run_to_completion

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA_TOL = 1e-4
HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD


@pytest.fixture(scope="module")
def cpu() -> LlamaModel:
    return tiny_model(0, "cpu")[1]


@pytest.fixture(scope="module")
def gpu() -> Iterator[LlamaModel]:
    model = tiny_model(0, "cuda")[1]
    yield model
    torch.cuda.synchronize()


def prefill(model: LlamaModel, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Last-token logits of one prefill on a fresh paged cache on the model's device (CPU)."""
    cache = empty_cache(model.config, -(-len(ids) // block_size) + 1, block_size)
    cache = cache.to(model.device)
    # Blocks in reverse order: the device kernels must follow the table, not the layout.
    table = list(range(cache.shape[0]))[::-1]
    batch = ForwardBatch(torch.tensor(ids, device=model.device), [SeqInput(0, len(ids), table)])
    out: torch.Tensor = model(batch, cache)[0]
    return out.float().cpu()


def same_answer(a: tuple[torch.Tensor, list[int]], b: tuple[torch.Tensor, list[int]]) -> None:
    torch.testing.assert_close(a[0], b[0], atol=CUDA_TOL, rtol=0)
    assert a[1] == b[1]


def test_the_models_weights_and_cache_live_on_the_gpu(gpu: LlamaModel) -> None:
    assert gpu.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    core = build_core(gpu, TierCapacity(hbm=4, dram=4))
    assert core.storage.hbm.device.type == "cuda"
    assert core.storage.dram.device.type == "cpu"
    assert core.storage.dram.is_pinned()


def test_the_paged_forward_on_the_gpu_matches_the_cpu(cpu: LlamaModel, gpu: LlamaModel) -> None:
    prompt = random_tokens(37, 5, cpu.config.vocab_size)
    ours, ref = prefill(gpu, prompt), prefill(cpu, prompt)
    torch.testing.assert_close(ours, ref, atol=CUDA_TOL, rtol=0)
    assert int(ours.argmax()) == int(ref.argmax())


@pytest.mark.parametrize("budget", [2048, 48], ids=["whole-prefills", "chunked-with-decodes"])
def test_a_batch_of_eight_on_the_gpu_generates_what_the_cpu_generates(
    cpu: LlamaModel, gpu: LlamaModel, budget: int
) -> None:
    on_cpu = build_core(cpu, TierCapacity(hbm=128), max_num_batched_tokens=budget)
    on_gpu = build_core(gpu, TierCapacity(hbm=128), max_num_batched_tokens=budget)
    want = run_to_completion(on_cpu, requests(on_cpu))
    got = run_to_completion(on_gpu, requests(on_gpu))
    for rid, req in want.items():
        assert got[rid].output_token_ids == req.output_token_ids, rid
        torch.testing.assert_close(
            on_gpu.sampler.first_logits[rid], on_cpu.sampler.first_logits[rid],
            atol=CUDA_TOL, rtol=0,
        )  # fmt: skip
    assert on_gpu.steps == on_cpu.steps


def test_preemption_on_the_gpu_changes_no_token(cpu: LlamaModel, gpu: LlamaModel) -> None:
    roomy = build_core(cpu, TierCapacity(hbm=128))
    want = run_to_completion(roomy, requests(roomy, seed=50))
    tight = build_core(gpu, TierCapacity(hbm=10), max_model_len=10 * BLOCK_SIZE)
    got = run_to_completion(tight, requests(tight, seed=50))
    assert tight.preemptions > 0
    assert {r: q.output_token_ids for r, q in got.items()} == {
        r: q.output_token_ids for r, q in want.items()
    }


@pytest.mark.parametrize(
    ("medium", "capacity"),
    [
        pytest.param(DRAM, TierCapacity(hbm=HBM_BLOCKS, dram=64), id="dram"),
        pytest.param(SSD, TierCapacity(hbm=HBM_BLOCKS, dram=8, ssd=64), id="ssd"),
    ],
)
def test_a_prefix_copied_up_into_gpu_memory_answers_like_a_cold_cpu_worker(
    cpu: LlamaModel, gpu: LlamaModel, medium: Medium, capacity: TierCapacity, tmp_path: Path
) -> None:
    prompts = Prompts(gpu.config.vocab_size)
    core = build_core(gpu, capacity, tmp_path / "ssd")
    try:
        run_to_completion(core, [core.request("warm", prompts.warm)])
        push_prefix_to(core, prompts, medium, max_fillers=6)
        before = core.pool.stats().promotions[medium]
        answer = ask(core, prompts, medium)
        assert core.pool.stats().promotions[medium] - before == PREFIX_BLOCKS
    finally:
        core.close()
    same_answer(answer, cold_answer(cpu, prompts))


@pytest.mark.parametrize(("donor", "receiver"), [("gpu", "cpu"), ("cpu", "gpu"), ("gpu", "gpu")])
def test_blocks_pulled_across_devices_answer_like_a_cold_cpu_worker(
    cpu: LlamaModel, gpu: LlamaModel, donor: str, receiver: str
) -> None:
    """The transfer format is device-free: HBM on a GPU is staged through host memory on
    send and written into device memory on receipt, checksums checked both ways."""
    models = {"cpu": cpu, "gpu": gpu}
    prompts = Prompts(cpu.config.vocab_size)
    a = build_core(models[donor], TierCapacity(hbm=HBM_BLOCKS))
    b = build_core(models[receiver], TierCapacity(hbm=HBM_BLOCKS))
    run_to_completion(a, [a.request("warm", prompts.warm)])
    assert pull_prefix(a, b, prompts) == PREFIX_BLOCKS
    assert b.media_of(prompts.query) == [HBM] * PREFIX_BLOCKS
    same_answer(ask(b, prompts, HBM), cold_answer(cpu, prompts))


def test_the_comparison_notices_corrupted_gpu_blocks(cpu: LlamaModel, gpu: LlamaModel) -> None:
    """Guards the tests above: a hit over wrong KV bytes in device memory must not pass."""
    prompts = Prompts(gpu.config.vocab_size)
    core = build_core(gpu, TierCapacity(hbm=HBM_BLOCKS))
    run_to_completion(core, [core.request("warm", prompts.warm)])
    keys = core.request("probe", prompts.query).ensure_keys(len(prompts.query))
    last = core.pool.match_prefix(keys)[PREFIX_BLOCKS - 1]
    core.storage.hbm[last.block_id].mul_(0.5)
    hit, cold = ask(core, prompts, HBM), cold_answer(cpu, prompts)
    assert float((hit[0] - cold[0]).abs().max()) > 100 * CUDA_TOL


@pytest.mark.parametrize(
    "quant", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0], ids=lambda q: q.name
)
def test_a_quantized_gguf_dequantized_onto_the_gpu_matches_the_cpu(
    tmp_path: Path, quant: GGMLQuantizationType
) -> None:
    path = tmp_path / "small.gguf"
    write_llama_gguf(
        path, random_model(small_config(tie_word_embeddings=True), seed=5), quant=quant
    )
    _, on_cpu = load_gguf(path)
    _, on_gpu = load_gguf(path, device="cuda")
    assert on_gpu.device.type == "cuda"
    prompt = random_tokens(23, 6, on_cpu.config.vocab_size)
    torch.testing.assert_close(
        prefill(on_gpu, prompt), prefill(on_cpu, prompt), atol=CUDA_TOL, rtol=0
    )
