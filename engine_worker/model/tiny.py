"""A tiny random-weight model for fast tests, speaking SmolLM2's vocabulary.

Its vocabulary is SmolLM2's (49152 tokens, same bos/eos), so text goes
through SmolLM2's real tokenizer and chat template while the forward pass
stays cheap (about 3.3M parameters, nearly all of them the embedding).
Weights are a pure function of the seed: generated on the CPU with a
seeded generator, then moved, so every device sees the same numbers.
"""

from __future__ import annotations

import torch

from engine_worker.model.config import ModelConfig
from engine_worker.model.llama import LlamaModel
from engine_worker.model.registry import TINY_NAME

__all__ = ["random_model", "tiny_config", "tiny_model"]


def tiny_config(dtype: str = "float32") -> ModelConfig:
    """2 layers, hidden 64, 4 query heads over 2 kv heads of width 16, SmolLM2's vocab."""
    return ModelConfig(
        name=TINY_NAME,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        dtype=dtype,
    )


def random_model(
    config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> LlamaModel:
    """A model of any ``config`` with weights drawn from ``seed``.

    Linear weights are N(0, 1/fan_in), biases N(0, 1/size), embeddings N(0, 0.25),
    norm gains 1 + N(0, 0.01): large enough that logits are far from
    uniform, so comparisons against a reference are meaningful. The same
    seed gives the same weights on any device.
    """
    model = LlamaModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            elif name == "embed_tokens.weight":
                values = 0.5 * torch.randn(param.shape, generator=gen)
            else:
                values = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
            param.copy_(values)
    return model.to(device).eval()


def tiny_model(
    seed: int = 0, device: torch.device | str = "cpu", dtype: str = "float32"
) -> tuple[ModelConfig, LlamaModel]:
    """The tiny model (:func:`tiny_config`) with weights drawn from ``seed``.

    Args:
        seed: Weight seed; the same seed gives the same weights on any device.
        device: Where the model lives.
        dtype: Parameter dtype name.
    """
    config = tiny_config(dtype)
    return config, random_model(config, seed, device)
