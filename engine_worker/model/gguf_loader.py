"""Load a Llama or Qwen2 GGUF file (llama.cpp's format) into a :class:`LlamaModel`.

Facts used (llama.cpp's ``convert_hf_to_gguf.py`` and ``gguf-py``):

* Hyperparameters live under ``{arch}.*`` keys: ``context_length``,
  ``embedding_length``, ``block_count``, ``feed_forward_length``,
  ``attention.head_count(_kv)``, ``rope.freq_base``,
  ``attention.layer_norm_rms_epsilon``; special tokens under
  ``tokenizer.ggml.*``. No ``output.weight`` tensor means tied embeddings.
* GGUF lists dims fastest first; ``GGUFReader`` already exposes the data
  as a row-major numpy array of the reversed shape, which for a linear layer
  is torch's ``[out_features, in_features]``.
* For ``llama`` the converter permutes the rows of ``attn_q``/``attn_k``
  within each head from HF's rotate-half order to interleaved pairs; we undo
  it (``qwen2`` files are written unpermuted).
* Quantized tensors are expanded to float with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine_worker.model.config import ModelConfig
from engine_worker.model.errors import ModelError, UnsupportedModelError
from engine_worker.model.llama import LlamaModel, torch_dtype

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "SUPPORTED_GGUF_TYPES", "load_gguf", "open_gguf"]

#: GGUF architectures we load; the value says whether Q/K rows were permuted.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": True, "qwen2": False}

#: Tensor types we dequantize (float, legacy block quants and k-quants).
SUPPORTED_GGUF_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        *("F32", "F16", "BF16"),
        *("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
        *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    )
)

_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file, turning a malformed one into :class:`ModelError`.

    Raises:
        FileNotFoundError: No file at ``path``.
        ModelError: The file is not a readable GGUF.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelError(f"{path} is not a readable GGUF file: {exc}") from exc


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def gguf_config(reader: GGUFReader, name: str, dtype: str = "float32") -> ModelConfig:
    """Model hyperparameters from a GGUF file's metadata.

    Raises:
        UnsupportedModelError: Architecture or RoPE scaling we do not implement.
        ModelError: Required metadata missing or inconsistent.
    """
    arch = str(_field(reader, "general.architecture"))
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; one of "
            f"{sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    tensor_names = {t.name for t in reader.tensors}
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "GGUF RoPE scaling is not supported (load the HF checkpoint, whose "
            "llama3 rope_scaling is)"
        )
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_default = len(tokens.data) if tokens is not None else None
    eos = [int(_field(reader, "tokenizer.ggml.eos_token_id", -1))]
    eos.append(int(_field(reader, "tokenizer.ggml.eot_token_id", -1)))
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", -1))
    return ModelConfig(
        name=name,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", vocab_default)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=bos if bos >= 0 else None,
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e >= 0)),
        dtype=dtype,
    )


def _our_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _unpermute(rows: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    shape = rows.shape
    per_head = shape[0] // heads
    return rows.reshape(heads, per_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def load_gguf(
    path: str | Path,
    *,
    name: str | None = None,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, LlamaModel]:
    """Load a GGUF checkpoint, dequantizing every tensor.

    Args:
        path: The ``.gguf`` file.
        name: Served model name; defaults to the file name without ``.gguf``.
        dtype: Parameter dtype after dequantization.
        device: Where the model lives.

    Raises:
        FileNotFoundError: No such file.
        UnsupportedModelError: Unsupported architecture, tensor type or RoPE scaling.
        ModelError: Malformed file (missing metadata or tensors, wrong shapes).
    """
    reader = open_gguf(path)
    config = gguf_config(reader, name or Path(path).name.removesuffix(".gguf"), dtype)
    unsupported = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in SUPPORTED_GGUF_TYPES}
    )
    if unsupported:
        raise UnsupportedModelError(
            f"GGUF tensor types {unsupported} are not supported; supported: "
            f"{sorted(t.name for t in SUPPORTED_GGUF_TYPES)}"
        )
    permuted = SUPPORTED_GGUF_ARCHITECTURES[str(_field(reader, "general.architecture"))]
    with torch.device("meta"):
        model = LlamaModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    target = torch_dtype(dtype)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        key = _our_name(tensor.name)
        values = dequantize(tensor.data, tensor.tensor_type)
        if permuted and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            values = _unpermute(values, config.num_heads)
        elif permuted and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            values = _unpermute(values, config.num_kv_heads)
        if key not in expected or tuple(values.shape) != expected[key]:
            raise ModelError(
                f"GGUF tensor {tensor.name} has shape {values.shape}, "
                f"the config expects {expected.get(key)}"
            )
        state[key] = torch.from_numpy(np.array(values, copy=True)).to(target)
    model.load_weights(state)
    return config, model.to(device).eval()
