"""The position-wise pieces of a Llama decoder: RMSNorm, RoPE and the SwiGLU MLP.

Numerics follow Hugging Face transformers' Llama so that logits agree to
float32 rounding: RMSNorm computes in float32 and casts back before the
weight; RoPE angles are computed in float32 and use the ``rotate_half``
convention (the two halves of a head are the real and imaginary parts).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional

from engine_worker.model.config import ModelConfig, RopeScaling

__all__ = ["MLP", "RMSNorm", "apply_rope", "rope_cos_sin", "rope_inv_freq"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean removal)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to every row of ``x``."""
        out: torch.Tensor = self.down_proj(functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Rescale RoPE frequencies the Llama 3.1 way (see :class:`RopeScaling`)."""
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Per-pair inverse frequencies ``theta ** (-2i / head_dim)``, float32, ``[head_dim / 2]``."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of ``positions`` ``[T]``, as ``[T, 1, head_dim]`` over heads."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by its tokens' angles."""
    return x * cos + _rotate_half(x) * sin
