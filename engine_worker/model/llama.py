"""Llama-family decoder (Llama, SmolLM2, Qwen2) computing over a paged KV cache.

The model takes a :class:`ForwardBatch` of several sequences' new tokens,
flattened into one ``[T]`` row batch. Linear layers, norms and RoPE run on
all ``T`` rows at once; only attention loops over sequences, because each
reads its own blocks (:mod:`engine_worker.model.paged_attention`).

Parameter names follow transformers' ``LlamaForCausalLM`` minus its
``model.`` prefix (``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``)
so that HF checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from engine_worker.model.batch import BatchError, ForwardBatch, SeqInput, blocks_needed
from engine_worker.model.config import ModelConfig
from engine_worker.model.errors import ModelError
from engine_worker.model.layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from engine_worker.model.paged_attention import AttentionMetadata, paged_attention, write_kv

__all__ = [
    "BatchError",
    "ForwardBatch",
    "LlamaModel",
    "SeqInput",
    "blocks_needed",
    "torch_dtype",
]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32", "float16", "bfloat16")."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, reading and writing the paged cache."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(
            q_dim, config.hidden_size, bias=config.attention_out_bias, dtype=dtype
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attend every new token in ``x`` ``[T, hidden]`` over its own sequence."""
        rows = x.shape[0]
        q = apply_rope(self.q_proj(x).view(rows, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, self.layer, k, v, meta)
        out = paged_attention(q, kv_cache, self.layer, meta)
        projected: torch.Tensor = self.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
        return projected


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One decoder layer over the flattened batch."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    """Causal LM over a paged KV cache; prefill chunks, decode steps and mixes in one call.

    Args:
        config: Model hyperparameters; parameters are created in ``config.dtype``
            on the current default device (use ``torch.device("meta")`` to skip
            allocation before loading weights with ``assign=True``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        dtype = torch_dtype(config.dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, dtype) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take ``state`` as this model's parameters (works on a meta-device model).

        Tensors are assigned, not copied; with tied embeddings ``lm_head.weight``
        may be absent and is taken from ``embed_tokens.weight``.

        Raises:
            ModelError: Tensors missing, unexpected or of the wrong shape.
        """
        state = dict(state)
        if self.config.tie_word_embeddings and "embed_tokens.weight" in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ModelError(
                f"checkpoint tensors missing {missing[:6]}, unexpected {unexpected[:6]}"
            )
        for key, value in state.items():
            if value.shape != own[key].shape:
                raise ModelError(
                    f"tensor {key} has shape {list(value.shape)}, expected {list(own[key].shape)}"
                )
        self.load_state_dict(state, strict=True, assign=True)
        self.tie_weights()

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.embed_tokens.weight.device

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise :class:`BatchError` unless ``kv_cache`` has this model's block layout."""
        c = self.config
        want = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or (shape[1], shape[2], shape[4], shape[5]) != want:
            raise BatchError(
                f"kv_cache must be [blocks, {c.num_layers}, 2, block_size, "
                f"{c.num_kv_heads}, {c.head_dim}], got {list(shape)}"
            )
        if kv_cache.device != self.device:
            raise BatchError(f"kv_cache is on {kv_cache.device}, the model on {self.device}")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch's new tokens, filling their KV slots.

        Each sequence's new tokens attend causally to its cached tokens and to
        each other; their keys and values are written at
        ``(block_table[pos // B], pos % B)``.

        Args:
            batch: Sequences and their concatenated new token ids.
            kv_cache: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.

        Returns:
            ``[n, vocab_size]`` float32 logits of the last new token of each of the
            ``n`` sequences with ``want_logits``, in batch order.

        Raises:
            BatchError: The batch does not fit the cache or the model (nothing is written).
        """
        self.check_kv_cache(kv_cache)
        batch.check(kv_cache.shape[3], kv_cache.shape[0], self.config.max_position_embeddings)
        ids = batch.input_ids.to(self.device)
        if bool(((ids < 0) | (ids >= self.config.vocab_size)).any()):
            raise BatchError(f"token ids must lie in [0, {self.config.vocab_size})")
        meta = AttentionMetadata.build(batch, kv_cache.shape[3], self.device)

        x = self.embed_tokens(ids)
        cos, sin = rope_cos_sin(meta.positions, rope_inv_freq(self.config, self.device), x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)

        last_rows = [
            s.start + s.num_new - 1
            for s, w in zip(meta.seqs, batch.seqs, strict=True)
            if w.want_logits
        ]
        if not last_rows:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        picked = x[torch.tensor(last_rows, device=self.device)]
        logits: torch.Tensor = self.lm_head(self.norm(picked))
        return logits.float()
