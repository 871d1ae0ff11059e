"""The ``torch`` runner: computes a plan with the real model over the HBM tier.

Each step flattens the scheduled sequences' new tokens into one
:class:`~engine_worker.model.batch.ForwardBatch` whose block tables point
into ``kv_cache`` (the HBM tier tensor of :class:`~engine_worker.tiers.TierStorage`),
runs the model once, and samples a token for every sequence that finished
its prompt or is decoding. Measured step times feed a
:class:`~engine_worker.profile_fit.ProfileFitter`, so the worker publishes a
timing profile fitted to its own hardware.
"""

from __future__ import annotations

import time

import torch

from engine_worker.model.batch import ForwardBatch, SeqInput
from engine_worker.model.llama import LlamaModel
from engine_worker.profile_fit import ProfileFitter, StepSample
from engine_worker.runners.base import StepResult
from engine_worker.sampling import Sampler
from engine_worker.scheduler import SchedulerPlan
from indexer.profile import TimingProfile

__all__ = ["TorchRunner"]


class TorchRunner:
    """Runs the model on the plan's tokens; samples; fits a timing profile."""

    name = "torch"

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        *,
        fitter: ProfileFitter,
        seed: int = 0,
    ) -> None:
        model.check_kv_cache(kv_cache)
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.sampler = Sampler(self.device, seed)
        self.fitter = fitter

    def profile(self) -> TimingProfile:
        """The profile fitted to this worker's measured steps (the prior until enough samples)."""
        return self.fitter.profile

    def execute(self, plan: SchedulerPlan) -> StepResult:
        """Compute the plan's tokens and sample the next token where wanted."""
        t0 = time.perf_counter()
        ids: list[int] = []
        seqs: list[SeqInput] = []
        wanted = []
        for s in plan.seqs:
            ids.extend(s.request.token_ids(s.num_cached, s.num_cached + s.num_new))
            seqs.append(SeqInput(s.num_cached, s.num_new, s.block_ids, s.want_logits))
            if s.want_logits:
                wanted.append(s.request)
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long, device=self.device), seqs)
        logits = self.model(batch, self.kv_cache)
        tokens = self.sampler.sample(
            logits,
            [r.sampling for r in wanted],
            [r.request_id for r in wanted],
            [(r.prompt_token_ids, r.output_token_ids) for r in wanted],
        )
        sampled = {r.request_id: t for r, t in zip(wanted, tokens, strict=True)}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        batch_size, kv_tokens = plan.decode_batch()
        self.fitter.add(StepSample(plan.prefill_chunks(), batch_size, kv_tokens, seconds))
        return StepResult(sampled, seconds, modeled=False)

    def forget(self, request_id: str) -> None:
        """Release per-request sampler state of a finished request."""
        self.sampler.forget(request_id)
