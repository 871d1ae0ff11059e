"""Paged attention over the HBM KV cache tensor, one sequence at a time.

Cache layout (``engine_worker.kv_layout``)::

    kv_cache[block, layer, 0 | 1, offset, kv_head, head_dim]     0 = keys, 1 = values

A forward first scatters its new tokens' K/V into their slots, then every
sequence gathers its own blocks (cached prefix + the tokens just written)
and runs ``scaled_dot_product_attention`` with a causal mask shifted by
``num_cached``: new token ``i`` sees context positions ``0 .. num_cached + i``.

    context:  c c c c c c | n n n        (num_cached = 6, num_new = 3)
    new 0:    1 1 1 1 1 1   1 0 0
    new 1:    1 1 1 1 1 1   1 1 0
    new 2:    1 1 1 1 1 1   1 1 1

Per-sequence index tensors are built once per forward
(:class:`AttentionMetadata`) and reused by every layer. Everything is
device-agnostic: the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional

from engine_worker.model.batch import ForwardBatch

__all__ = ["AttentionMetadata", "SeqAttention", "paged_attention", "write_kv"]


@dataclass(slots=True)
class SeqAttention:
    """One sequence's view of the batch, shared by all layers of a forward.

    Attributes:
        start: Row of the sequence's first new token in the flattened batch.
        num_new: New tokens (rows ``start .. start + num_new - 1``).
        context_len: Tokens attended over (cached + new).
        block_ids: ``[blocks]`` int64 ids of the blocks covering the context.
        mask: ``[num_new, context_len]`` bool (True = attend), or None for a single
            new token, which sees the whole context.
    """

    start: int
    num_new: int
    context_len: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Positions, write slots and per-sequence gather indices for one forward.

    Attributes:
        positions: ``[T]`` int64 position of every new token.
        slot_blocks: ``[T]`` int64 block id each new token is written to.
        slot_offsets: ``[T]`` int64 offset inside that block.
        seqs: One entry per sequence, in batch order.
    """

    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    seqs: list[SeqAttention]

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        """Index the batch; one host-to-device copy per tensor, no per-token Python loop."""
        positions, tables, spans = [], [], []
        for seq in batch.seqs:
            positions.append(torch.arange(seq.num_cached, seq.context_len, dtype=torch.int64))
            need = -(-seq.context_len // block_size)
            tables.append(torch.tensor(seq.block_table[:need], dtype=torch.int64))
            spans.append(need)
        pos_cpu = torch.cat(positions)
        table_lens = torch.tensor(spans, dtype=torch.int64)
        table_starts = torch.cumsum(table_lens, 0) - table_lens
        new_lens = torch.tensor([s.num_new for s in batch.seqs], dtype=torch.int64)
        token_table_start = torch.repeat_interleave(table_starts, new_lens)
        flat_tables = torch.cat(tables)
        slot_blocks = flat_tables[token_table_start + pos_cpu // block_size]

        flat_tables_dev = flat_tables.to(device, non_blocking=True)
        seqs: list[SeqAttention] = []
        start = table_start = 0
        for seq, need in zip(batch.seqs, spans, strict=True):
            mask = None
            if seq.num_new > 1:
                rows = torch.arange(seq.num_new, device=device)[:, None] + seq.num_cached
                mask = torch.arange(seq.context_len, device=device)[None, :] <= rows
            seqs.append(
                SeqAttention(
                    start=start,
                    num_new=seq.num_new,
                    context_len=seq.context_len,
                    block_ids=flat_tables_dev[table_start : table_start + need],
                    mask=mask,
                )
            )
            start += seq.num_new
            table_start += need
        return cls(
            positions=pos_cpu.to(device, non_blocking=True),
            slot_blocks=slot_blocks.to(device, non_blocking=True),
            slot_offsets=(pos_cpu % block_size).to(device, non_blocking=True),
            seqs=seqs,
        )


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store new tokens' keys and values ``[T, kv_heads, head_dim]`` into their slots."""
    kv_cache[meta.slot_blocks, layer, 0, meta.slot_offsets] = k.to(kv_cache.dtype)
    kv_cache[meta.slot_blocks, layer, 1, meta.slot_offsets] = v.to(kv_cache.dtype)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of new queries ``[T, heads, head_dim]`` over each sequence's cached context.

    Must run after :func:`write_kv` for the same layer, so that a chunk sees
    its own tokens. Grouped-query heads map query head ``h`` to kv head
    ``h // (heads / kv_heads)``, as in transformers' ``repeat_kv``.

    Returns:
        ``[T, heads, head_dim]`` in ``q``'s dtype.
    """
    kv_heads, head_dim = kv_cache.shape[4], kv_cache.shape[5]
    outputs = []
    for seq in meta.seqs:
        blocks = kv_cache[seq.block_ids, layer]  # [blocks, 2, block_size, kv_heads, head_dim]
        keys = blocks[:, 0].reshape(-1, kv_heads, head_dim)[: seq.context_len]
        values = blocks[:, 1].reshape(-1, kv_heads, head_dim)[: seq.context_len]
        qs = q[seq.start : seq.start + seq.num_new].transpose(0, 1).unsqueeze(0)
        out = functional.scaled_dot_product_attention(
            qs,
            keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
            values.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=seq.mask,
            enable_gqa=True,
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)
