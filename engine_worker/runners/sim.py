"""The ``sim`` runner: executes plans without tensors, returning each step's modeled duration.

It lets one machine host many workers (and the offline simulator replay
traces) with the real scheduler and block pool: only the arithmetic is
replaced by :class:`indexer.profile.TimingProfile`. Like NVIDIA Dynamo's
mocker engine, it emits placeholder tokens: deterministic per request and
position, never an end-of-sequence token, so requests run to ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from engine_worker.runners.base import StepResult
from engine_worker.scheduler import SchedulerPlan
from indexer.profile import TimingProfile

__all__ = ["SimRunner", "plan_seconds"]

#: Multiplier spreading consecutive positions over the vocabulary (2**64 / golden ratio).
_STEP = 0x9E3779B97F4A7C15


def plan_seconds(profile: TimingProfile, plan: SchedulerPlan, block_size: int) -> float:
    """Modeled duration of ``plan``: one mixed step plus loading its promoted blocks.

    NOTE: demotions (HBM -> DRAM copies on eviction) are assumed to overlap
    with compute, as offloading connectors run them asynchronously; loads on a
    prefix hit are on the critical path and are charged.
    """
    batch, kv_tokens = plan.decode_batch()
    seconds = profile.step_seconds(plan.prefill_chunks(), batch, kv_tokens)
    for medium, blocks in plan.loaded_blocks.items():
        seconds += profile.load_seconds(blocks * block_size, medium)
    return seconds


class SimRunner:
    """Models step time from a profile; emits placeholder tokens."""

    name = "sim"

    def __init__(
        self,
        profile: TimingProfile,
        block_size: int,
        *,
        vocab_size: int = 32000,
        avoid_token_ids: Iterable[int] = (),
    ) -> None:
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        self._profile = profile
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.avoid = frozenset(avoid_token_ids)
        self._bases: dict[str, int] = {}

    def profile(self) -> TimingProfile:
        """The timing model in use."""
        return self._profile

    def forget(self, request_id: str) -> None:
        """Drop a finished request's token base."""
        self._bases.pop(request_id, None)

    def _token(self, request_id: str, position: int) -> int:
        base = self._bases.get(request_id)
        if base is None:
            if len(self._bases) > 65536:
                self._bases.clear()  # a bound whatever forget is told; cheap to recompute
            base = self._bases[request_id] = xxhash.xxh3_64_intdigest(request_id.encode())
        token = (base + position * _STEP) % self.vocab_size
        while token in self.avoid:
            token = (token + 1) % self.vocab_size
        return token

    def execute(self, plan: SchedulerPlan) -> StepResult:
        """Return placeholder tokens and the plan's modeled duration."""
        bases, avoid, vocab = self._bases, self.avoid, self.vocab_size
        sampled: dict[str, int] = {}
        for s in plan.seqs:
            if not s.want_logits:
                continue
            rid = s.request.request_id
            base = bases.get(rid)
            token = -1 if base is None else (base + s.request.num_tokens * _STEP) % vocab
            # The common case is inlined above (one per decoded token); the rest is rare.
            sampled[rid] = (
                token
                if token >= 0 and token not in avoid
                else self._token(rid, s.request.num_tokens)
            )
        return StepResult(sampled, plan_seconds(self._profile, plan, self.block_size), True)
