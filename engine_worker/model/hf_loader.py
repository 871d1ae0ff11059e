"""Load a Hugging Face safetensors directory of a Llama or Qwen2 model.

Reads ``config.json`` written by transformers 4.x (``rope_theta`` and
``rope_scaling`` at top level, ``torch_dtype``) or 5.x (``rope_parameters``,
``dtype``), and the weights from ``model.safetensors`` or the shards named
by ``model.safetensors.index.json``. Tensor names are transformers' with
the ``model.`` prefix dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine_worker.model.config import ModelConfig, RopeScaling
from engine_worker.model.errors import ModelError, UnsupportedModelError
from engine_worker.model.llama import LlamaModel, torch_dtype

__all__ = ["SUPPORTED_HF_ARCHITECTURES", "hf_config", "load_hf"]

#: Architectures we load; the value says whether o_proj follows ``attention_bias``.
SUPPORTED_HF_ARCHITECTURES = {"LlamaForCausalLM": True, "Qwen2ForCausalLM": False}


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either config.json generation."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"RoPE scaling {kind!r} is not supported; only plain RoPE and 'llama3'"
        )
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelError(f"llama3 rope scaling lacks {exc}") from exc
    return theta, scaling


def hf_config(raw: Mapping[str, Any], name: str, dtype: str | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a parsed transformers ``config.json``.

    Raises:
        UnsupportedModelError: Architecture or feature we do not implement.
        ModelError: Required keys missing.
    """
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else raw.get("model_type", "?")
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; one of {sorted(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias", False):
        raise UnsupportedModelError("only SiLU MLPs without bias are supported")
    if raw.get("use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention is not supported")
    theta, scaling = _rope(raw)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            name=name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=qkv_bias and SUPPORTED_HF_ARCHITECTURES[arch],
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
            dtype=dtype or str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )
    except KeyError as exc:
        raise ModelError(f"config.json lacks {exc}") from exc


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def load_hf(
    directory: str | Path,
    *,
    name: str | None = None,
    dtype: str | None = None,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, LlamaModel]:
    """Load a transformers checkpoint directory.

    Args:
        directory: Holds ``config.json`` and the ``*.safetensors`` weights.
        name: Served model name; defaults to the directory name.
        dtype: Parameter dtype; defaults to the checkpoint's.
        device: Where the model lives.

    Raises:
        FileNotFoundError: Missing directory, config.json or weight file.
        UnsupportedModelError: Architecture or feature we do not implement.
        ModelError: Inconsistent config or weights.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    config = hf_config(json.loads(config_path.read_text()), name or directory.name, dtype)
    target = torch_dtype(config.dtype)
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        if not path.is_file():
            raise FileNotFoundError(f"weight shard {path} is missing")
        with safe_open(str(path), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                state[key.removeprefix("model.")] = shard.get_tensor(key).to(target)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_weights(state)
    return config, model.to(device).eval()
