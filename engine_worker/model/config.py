"""Hyperparameters of a Llama-family decoder, independent of the checkpoint format.

The loaders (GGUF, HF safetensors, the tiny test model) all produce a
:class:`ModelConfig`; the model, the KV cache geometry and the router's
block size checks read only this. Torch-free on purpose: the tokenizer and
the registry import it without pulling torch in.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.kv_layout import DTYPE_SIZES, KVLayout
from engine_worker.model.errors import ModelError, UnsupportedModelError

__all__ = ["ModelConfig", "RopeScaling"]


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling (``rope_type: "llama3"``).

    Frequencies whose wavelength exceeds ``original_max_position_embeddings
    / low_freq_factor`` are divided by ``factor``; those shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept; the band
    between is interpolated. Numbers as published in Llama 3.1's config.json.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if (
            self.factor <= 0
            or self.low_freq_factor <= 0
            or self.original_max_position_embeddings <= 0
        ):
            raise ModelError(f"invalid llama3 rope scaling {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama/Qwen2 decoder.

    Attributes:
        name: Served model name (the router's block keys fold it in).
        vocab_size: Rows of the embedding and of the LM head.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the SwiGLU MLP.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention when fewer than query heads).
        head_dim: Width of one attention head.
        rope_theta: RoPE base frequency.
        rms_norm_eps: Epsilon of every RMSNorm.
        max_position_embeddings: Context length; positions past it are refused.
        tie_word_embeddings: The LM head reuses the embedding matrix.
        attention_bias: q/k/v projections carry a bias (Qwen2; Llama with ``attention_bias``).
        attention_out_bias: The output projection carries a bias (Llama with ``attention_bias``).
        bos_token_id: Beginning-of-sequence token, if the model has one.
        eos_token_ids: Tokens that end generation.
        rope_scaling: Llama 3.1-style scaling, or None for plain RoPE.
        dtype: Parameter dtype name ("float32", "float16", "bfloat16").
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.name:
            raise ModelError("ModelConfig.name must not be empty")
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ModelError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ModelError("rope_theta and rms_norm_eps must be positive")
        if self.dtype not in DTYPE_SIZES:
            raise UnsupportedModelError(
                f"unsupported model dtype {self.dtype!r}; one of {sorted(DTYPE_SIZES)}"
            )
        for token in (self.bos_token_id, *self.eos_token_ids):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ModelError(f"special token id {token} outside vocab of {self.vocab_size}")

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.attention_out_bias:
            attn += h
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def kv_layout(self, block_size: int, dtype: str | None = None) -> KVLayout:
        """Geometry of one KV block of this model.

        Args:
            block_size: Tokens per block.
            dtype: KV cache dtype name; defaults to the model's own dtype.
        """
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=self.dtype if dtype is None else dtype,
        )
