"""A worker's core without HTTP, for engine-level tests: tiers, pool, scheduler, torch runner.

:func:`build_core` wires a model to ``TierStorage -> BlockPool -> Scheduler
-> TorchRunner`` the way the worker does; :func:`run_to_completion` steps
it until every request finished, recording the logits row each request's
first token was sampled from (:class:`RecordingSampler`), so tests can
compare what a user would get on a cold worker and on a cache hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.model.config import ModelConfig
from engine_worker.model.llama import LlamaModel
from engine_worker.profile_fit import ProfileFitter
from engine_worker.request import Request, SamplingParams
from engine_worker.runners.torch_runner import TorchRunner
from engine_worker.sampling import Sampler
from engine_worker.scheduler import Scheduler, SchedulerConfig
from engine_worker.tiers import TierStorage
from indexer.keys import block_keys, root_parent
from indexer.media import Medium

#: Tokens per KV block in these tests (the cluster default).
BLOCK_SIZE = 16


class RecordingSampler(Sampler):
    """A sampler that keeps, per request, a copy of the logits row of its first sampled token."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        super().__init__(device, seed)
        self.first_logits: dict[str, torch.Tensor] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        tokens: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> list[int]:
        """Record first rows, then sample as the base sampler does."""
        for i, rid in enumerate(request_ids):
            if rid not in self.first_logits:
                self.first_logits[rid] = logits[i].detach().to("cpu", copy=True)
        return super().sample(logits, params, request_ids, tokens)


@dataclass
class WorkerCore:
    """The engine objects of one worker, sharing one model."""

    config: ModelConfig
    storage: TierStorage
    pool: BlockPool
    scheduler: Scheduler
    runner: TorchRunner
    sampler: RecordingSampler
    root: int
    steps: int = 0
    preemptions: int = 0
    finished: dict[str, Request] = field(default_factory=dict)

    def request(self, request_id: str, prompt: Sequence[int], max_tokens: int = 1) -> Request:
        """A greedy request for this worker's model that ignores EOS (runs to ``max_tokens``)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(request_id, list(prompt), params, self.root, BLOCK_SIZE)

    def media_of(self, tokens: Sequence[int]) -> list[Medium]:
        """The medium of each cached block of the longest cached prefix of ``tokens``."""
        keys = block_keys(tokens, BLOCK_SIZE, self.root)
        return [b.medium for b in self.pool.match_prefix(keys)]

    def close(self) -> None:
        """Release the SSD tier's files and lock."""
        self.storage.close()


def build_core(
    model: LlamaModel,
    capacity: TierCapacity,
    ssd_path: Path | None = None,
    *,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    caching: bool = True,
) -> WorkerCore:
    """A worker core over ``model`` with float32 KV tiers of ``capacity`` blocks.

    Args:
        model: The model (stateless: several cores may share one).
        capacity: Blocks per medium.
        ssd_path: Directory of the SSD tier (reopened, journal replayed, if it exists).
        max_num_batched_tokens: The step's token budget (prefill chunk size).
        max_num_seqs: Requests per step at most.
        max_model_len: Context limit; defaults to what HBM holds (capped by the model's).
        caching: Prefix caching on (the default) or off, in the pool and the scheduler.
    """
    config = model.config
    layout = config.kv_layout(BLOCK_SIZE, "float32")
    storage = TierStorage(layout, capacity, device=model.device, ssd_path=ssd_path)
    pool = BlockPool(capacity, storage, enable_caching=caching)
    limit = max_model_len or min(capacity.hbm * BLOCK_SIZE, config.max_position_embeddings)
    sched_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=limit,
        enable_prefix_caching=caching,
    )
    scheduler = Scheduler(sched_config, pool, BLOCK_SIZE)
    fitter = ProfileFitter(
        name=f"{config.name}-measured",
        kv_bytes_per_token=layout.bytes_per_token,
        load_bandwidth={},
        max_num_batched_tokens=max_num_batched_tokens,
    )
    runner = TorchRunner(model, storage.hbm, fitter=fitter)
    sampler = RecordingSampler(runner.device)
    runner.sampler = sampler
    return WorkerCore(config, storage, pool, scheduler, runner, sampler, root_parent(config.name))


def run_to_completion(
    core: WorkerCore, requests: Iterable[Request], max_steps: int = 10_000
) -> dict[str, Request]:
    """Add ``requests`` together, step until all finished; return them by id.

    Raises:
        AssertionError: The scheduler still had work after ``max_steps`` steps.
    """
    batch = list(requests)
    for r in batch:
        core.scheduler.add(r)
    for _ in range(max_steps):
        if not core.scheduler.has_work():
            break
        plan = core.scheduler.schedule()
        core.preemptions += len(plan.preempted)
        if plan.empty:
            continue
        result = core.runner.execute(plan)
        core.scheduler.update(plan, result.sampled)
        core.steps += 1
    else:
        raise AssertionError(f"requests still running after {max_steps} steps")
    out = {r.request_id: r for r in batch}
    core.finished.update(out)
    return out


def random_tokens(n: int, seed: int, vocab_size: int) -> list[int]:
    """``n`` token ids drawn from ``seed``, avoiding the low ids that hold special tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (n,), generator=gen).tolist()
