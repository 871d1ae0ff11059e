"""A request inside the worker: its tokens, sampling parameters and KV bookkeeping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from indexer.keys import block_keys
from indexer.media import MEDIA, Medium

if TYPE_CHECKING:
    from engine_worker.block_pool import Block

__all__ = [
    "GREEDY_BELOW",
    "LOGIT_BIAS_RANGE",
    "PENALTY_RANGE",
    "SEED_RANGE",
    "FinishReason",
    "Request",
    "RequestStatus",
    "SamplingParams",
]

#: Temperatures below this sample greedily. Dividing logits by a temperature near zero
#: overflows float32 to infinity and the softmax to NaN; vLLM's sampler draws the same
#: line (``_SAMPLING_EPS = 1e-5`` in ``vllm/sampling_params.py``).
GREEDY_BELOW = 1e-5

#: Seeds a request may carry: a signed 64-bit integer, what ``torch.Generator.manual_seed``
#: takes whatever its sign (vLLM's request schema bounds ``seed`` the same way).
SEED_RANGE = (-(2**63), 2**63 - 1)

#: ``presence_penalty`` and ``frequency_penalty`` bounds, and a ``logit_bias`` entry's
#: (OpenAI's API reference); the request schema and :class:`SamplingParams` share them.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class RequestStatus(StrEnum):
    """Where a request is in its life."""

    WAITING = "waiting"
    #: Admitted with blocks to bring up from DRAM/SSD, computing nothing until they are
    #: in HBM (the scheduler's ``async_loads``).
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    """Why a request stopped (OpenAI's ``finish_reason`` plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """OpenAI sampling parameters, validated.

    ``temperature`` below :data:`GREEDY_BELOW` (0 included) means greedy. ``top_k == 0``
    disables top-k; ``min_p`` (vLLM's) drops the tokens less likely than that fraction of
    the likeliest one's probability. ``seed`` lies in :data:`SEED_RANGE`.

    Penalties change the logits before any sampling, greedy included, as OpenAI's API
    defines them (``presence_penalty`` and ``frequency_penalty`` in [-2, 2], on the
    tokens generated so far; ``logit_bias`` in [-100, 100] per token id) and as vLLM
    adds ``repetition_penalty`` (> 0; CTRL's rule on the prompt's and the output's
    tokens: a positive logit divided by it, a negative one multiplied).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise ValueError(f"{name} must be in {list(PENALTY_RANGE)}, got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            low, high = LOGIT_BIAS_RANGE
            if token < 0 or not (math.isfinite(bias) and low <= bias <= high):
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [{low}, {high}]")

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    The block keys of the request's full blocks are computed incrementally
    from ``root`` (``indexer.keys.root_parent`` of the model, LoRA and cache
    salt) as tokens become known, so the prompt is hashed once and each
    generated block once.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    root: int
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: list[Block] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    keys: list[int] = field(default_factory=list)
    #: Prompt tokens served from the prefix cache at first admission, per medium rank.
    cached_tokens: list[int] = field(default_factory=lambda: [0] * len(MEDIA))
    admitted: bool = False
    num_preemptions: int = 0
    #: Prompt tokens the pool held when the request was queued (the load estimate's discount).
    expected_cached_tokens: int = 0
    #: Of those, in blocks: the prefix matched on arrival. Admission takes the part no
    #: running request holds then out of the free HBM pool (``Scheduler.load``).
    expected_hit_blocks: int = 0
    #: Of those, the blocks on DRAM and SSD (brought up into HBM on admission, which the
    #: admitting step pays for), as matched on arrival.
    expected_load_blocks: dict[Medium, int] = field(default_factory=dict)
    #: Prompt plus generated tokens (kept current by :meth:`append_output`: read every step).
    num_tokens: int = 0

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token: int) -> None:
        """Append a generated token."""
        self.output_token_ids.append(token)
        self.num_tokens += 1

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def ensure_keys(self, num_tokens: int) -> list[int]:
        """Keys of every full block within the first ``num_tokens`` tokens (extends the chain)."""
        want = num_tokens // self.block_size
        have = len(self.keys)
        if want > have:
            parent = self.keys[-1] if self.keys else self.root
            tokens = self.token_ids(have * self.block_size, want * self.block_size)
            self.keys.extend(block_keys(tokens, self.block_size, parent))
        return self.keys

    def parent_of(self, block_index: int) -> int:
        """Parent key of block ``block_index`` (the root for block 0)."""
        return self.keys[block_index - 1] if block_index > 0 else self.root

    @property
    def remaining_prefill(self) -> int:
        """Known tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed_tokens

    def cached_by_medium(self) -> dict[Medium, int]:
        """Prompt tokens served from cache per medium (usage reporting)."""
        return {m: self.cached_tokens[m.rank] for m in MEDIA}

    @property
    def finished(self) -> bool:
        """Whether the request is done (any reason)."""
        return self.status is RequestStatus.FINISHED
