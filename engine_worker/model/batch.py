"""What one forward pass computes: a flat batch of sequences' new tokens.

A prefill chunk, a decode step and a mixed batch are the same thing here:
each sequence contributes ``num_new`` tokens at positions
``num_cached .. num_cached + num_new - 1`` and owns the HBM blocks of its
``block_table``. Token ``pos`` of a sequence lives in slot::

    block_table[pos // block_size], offset pos % block_size

    positions: 0 1 2 3 | 4 5 6 7 | 8 9        (block_size 4)
    blocks:    [  17   ] [   3   ] [ 42 ..]   block_table = [17, 3, 42]

Torch-free apart from the ``input_ids`` tensor the runner hands over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BatchError", "ForwardBatch", "SeqInput", "blocks_needed"]


class BatchError(ValueError):
    """A forward batch is inconsistent (token counts, block tables, positions)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens, the last one possibly partial."""
    if block_size <= 0:
        raise BatchError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise BatchError(f"num_tokens must be non-negative, got {num_tokens}")
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class SeqInput:
    """One sequence's part of a forward batch.

    Attributes:
        num_cached: Tokens already in the KV cache (positions ``0 .. num_cached - 1``).
        num_new: Tokens computed in this forward, following the cached ones.
        block_table: HBM block ids covering positions ``0 .. num_cached + num_new - 1``.
        want_logits: Produce logits for this sequence's last new token.
    """

    num_cached: int
    num_new: int
    block_table: list[int] = field(default_factory=list)
    want_logits: bool = True

    @property
    def context_len(self) -> int:
        """Tokens this sequence attends over after the forward (cached + new)."""
        return self.num_cached + self.num_new

    def check(self, block_size: int, num_blocks: int) -> None:
        """Raise :class:`BatchError` unless the sequence fits ``num_blocks`` blocks."""
        if self.num_cached < 0 or self.num_new <= 0:
            raise BatchError(
                f"need num_cached >= 0 and num_new >= 1, got {self.num_cached}, {self.num_new}"
            )
        need = blocks_needed(self.context_len, block_size)
        if len(self.block_table) < need:
            raise BatchError(
                f"block table has {len(self.block_table)} blocks, "
                f"{self.context_len} tokens need {need}"
            )
        if min(self.block_table[:need]) < 0 or max(self.block_table[:need]) >= num_blocks:
            raise BatchError(f"block ids must lie in [0, {num_blocks}), got {self.block_table}")


@dataclass(slots=True)
class ForwardBatch:
    """Sequences' new tokens, concatenated in batch order.

    Attributes:
        input_ids: ``[sum(num_new)]`` int64 token ids.
        seqs: The sequences, in the order their tokens appear in ``input_ids``.
    """

    input_ids: torch.Tensor
    seqs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this forward."""
        return sum(s.num_new for s in self.seqs)

    def check(self, block_size: int, num_blocks: int, max_positions: int) -> None:
        """Raise :class:`BatchError` if the batch cannot run on this cache and model."""
        if not self.seqs:
            raise BatchError("a forward batch needs at least one sequence")
        if self.input_ids.dim() != 1 or self.input_ids.numel() != self.num_tokens:
            raise BatchError(
                f"input_ids must be 1-D with sum(num_new) = {self.num_tokens} tokens, "
                f"got shape {tuple(self.input_ids.shape)}"
            )
        for seq in self.seqs:
            seq.check(block_size, num_blocks)
            if seq.context_len > max_positions:
                raise BatchError(
                    f"sequence of {seq.context_len} tokens exceeds the model's "
                    f"context length {max_positions}"
                )
