"""Time estimates the TTFT-predicting policies share: queue, prefill, KV loads.

Every estimate goes through :class:`indexer.profile.TimingProfile`, the same
model the ``sim`` runner uses to time its steps, so the router predicts with
the arithmetic the simulator executes.

Chunking follows vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``):
each step first gives one token of the step budget
(``max_num_batched_tokens``) to every running decode, then fills the rest with
prefill chunks. A worker with ``b`` running sequences therefore prefills at
most ``budget - b`` tokens per step, and every one of those steps also pays the
decode batch's cost (``d1*b + d2*k`` in the profile's step model). That is the
"decode batch slows the queue" term: ignoring it makes a worker with a big
decode batch look as fast as an idle one.
"""

from __future__ import annotations

from indexer.media import Medium
from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView

__all__ = [
    "load_seconds",
    "prefill_seconds",
    "queue_seconds",
    "resolve_profile",
    "split_prompt",
]


def resolve_profile(view: WorkerView, fallback: TimingProfile | None) -> TimingProfile:
    """The worker's own profile, else ``fallback``.

    Raises:
        ValueError: Neither exists, so no time can be predicted for this worker.
    """
    profile = view.profile if view.profile is not None else fallback
    if profile is None:
        raise ValueError(
            f"worker {view.host!r} publishes no timing profile and the policy has no "
            "default_profile to predict with"
        )
    return profile


def split_prompt(num_tokens: int, matched_blocks: int, block_size: int) -> tuple[int, int]:
    """(cached, new) tokens of a prompt whose first ``matched_blocks`` blocks are cached.

    Like vLLM, a fully cached prompt still computes its last token (the engine
    needs its logits), so ``new >= 1`` for any non-empty prompt.

    Raises:
        ValueError: For a non-positive block size or negative counts.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0 or matched_blocks < 0:
        raise ValueError("num_tokens and matched_blocks must be >= 0")
    if num_tokens == 0:
        return 0, 0
    cached = min(matched_blocks * block_size, num_tokens - 1)
    return cached, num_tokens - cached


def _chunk(profile: TimingProfile, decode_batch: int) -> int:
    return max(profile.max_num_batched_tokens - decode_batch, 1)


def queue_seconds(
    profile: TimingProfile, queued_tokens: int, decode_batch: int = 0, decode_kv_tokens: int = 0
) -> float:
    """Time to drain ``queued_tokens`` of prefill ahead of a new request.

    The queued tokens belong to many requests whose cached context is unknown,
    so each chunk is costed as fresh tokens (no ``p3`` term).
    """
    if queued_tokens <= 0:
        return 0.0
    chunk = _chunk(profile, decode_batch)
    full, rest = divmod(queued_tokens, chunk)
    total = full * profile.step_seconds([(chunk, 0)], decode_batch, decode_kv_tokens)
    if rest:
        total += profile.step_seconds([(rest, 0)], decode_batch, decode_kv_tokens)
    return total


def prefill_seconds(
    profile: TimingProfile,
    new_tokens: int,
    cached_tokens: int,
    decode_batch: int = 0,
    decode_kv_tokens: int = 0,
) -> float:
    """Time to prefill ``new_tokens`` after ``cached_tokens`` beside a decode batch.

    With no decode batch this is exactly ``profile.prefill_seconds``.
    """
    chunk = _chunk(profile, decode_batch)
    total = 0.0
    done = 0
    while done < new_tokens:
        n = min(chunk, new_tokens - done)
        total += profile.step_seconds([(n, cached_tokens + done)], decode_batch, decode_kv_tokens)
        done += n
    return total


def load_seconds(
    view: WorkerView, profile: TimingProfile, match: PrefixMatch | None, block_size: int
) -> float:
    """Time to bring the matched blocks held on DRAM and SSD into HBM.

    Uses the worker's measured bandwidth per medium, else its profile's; a
    medium with neither costs nothing (as ``TimingProfile.load_seconds`` does).
    """
    if match is None:
        return 0.0
    total = 0.0
    for medium in (Medium.DRAM, Medium.SSD):
        blocks = match.on(medium)
        bandwidth = view.bandwidth(medium) or profile.load_bandwidth.get(medium)
        if blocks > 0 and bandwidth:
            total += blocks * block_size * profile.kv_bytes_per_token / bandwidth
    return total
