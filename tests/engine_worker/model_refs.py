"""Reference models for the model tests: transformers on the same weights, tiny GGUF files.

transformers is imported lazily (it takes seconds on a loaded machine);
every helper here builds its reference from *our* weights or from the same
file, so a disagreement is a bug on one side, never different numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from engine_worker.model.config import ModelConfig
from engine_worker.model.llama import ForwardBatch, LlamaModel, SeqInput

#: Max abs logit difference accepted between us and transformers in float32.
FLOAT32_TOL = 1e-4


def hf_config_kwargs(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for a transformers Llama/Qwen2 config matching ``config``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0] if config.eos_token_ids else None,
    }


def hf_llama_from(model: LlamaModel) -> torch.nn.Module:
    """A transformers ``LlamaForCausalLM`` holding a copy of ``model``'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config
    hf: Any = LlamaForCausalLM(
        LlamaConfig(**hf_config_kwargs(config), attention_bias=config.attention_bias)
    )
    state = {
        (k if k.startswith("lm_head") else f"model.{k}"): v for k, v in model.state_dict().items()
    }
    hf.load_state_dict(state, strict=True)
    reference: torch.nn.Module = hf.eval()
    return reference


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter of a (transformers) model non-trivial random values, biases too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len(ids), vocab]`` for one sequence, no cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids])).logits[0]
    assert isinstance(out, torch.Tensor)
    return out.float()


def empty_cache(config: ModelConfig, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed HBM tier tensor for ``config``."""
    layout = config.kv_layout(block_size)
    return torch.zeros(num_blocks, *layout.block_shape, dtype=getattr(torch, layout.dtype))


def prefill_logits(model: LlamaModel, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Our logits of the last token of ``ids`` computed in one prefill on a fresh cache."""
    cache = empty_cache(model.config, -(-len(ids) // block_size) + 1, block_size)
    table = list(range(cache.shape[0]))
    batch = ForwardBatch(torch.tensor(ids), [SeqInput(0, len(ids), table)])
    out: torch.Tensor = model(batch, cache)[0]
    return out


def _llama_cpp_permute(rows: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """llama.cpp's Q/K row permutation (rotate-half halves -> interleaved pairs)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _encode(values: np.ndarray[Any, Any], quant: GGMLQuantizationType) -> np.ndarray[Any, Any]:
    """``values`` quantized, or zero bytes of the right size where gguf has no quantizer."""
    try:
        encoded: np.ndarray[Any, Any] = quantize(values, quant)
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[quant]
        return np.zeros((values.shape[0], values.shape[1] // block * size), dtype=np.uint8)
    return encoded


def write_llama_gguf(
    path: Path,
    model: LlamaModel,
    *,
    quant: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    arch: str = "llama",
) -> None:
    """Write ``model`` as a llama.cpp-style GGUF: 2-D weights in ``quant``, norms in F32.

    Q/K rows are permuted as ``convert_hf_to_gguf.py`` does, the first layer's
    ``attn_v`` is stored as F16 to mix types, and the LM head is omitted when tied.
    """
    c = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name("test-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_dimension_count(c.head_dim)
    if c.bos_token_id is not None:
        writer.add_bos_token_id(c.bos_token_id)
    if c.eos_token_ids:
        writer.add_eos_token_id(c.eos_token_ids[0])
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
            gguf_name = name.get(key, "output.weight")
        else:
            _, layer, rest = key.split(".", 2)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[rest]}"
        if gguf_name.endswith("attn_q.weight"):
            values = _llama_cpp_permute(values, c.num_heads)
        elif gguf_name.endswith("attn_k.weight"):
            values = _llama_cpp_permute(values, c.num_kv_heads)
        if values.ndim == 1:
            writer.add_tensor(gguf_name, values.astype(np.float32))
        elif gguf_name == "blk.0.attn_v.weight":
            writer.add_tensor(gguf_name, values.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, _encode(values, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own reading of a GGUF file, as a ``LlamaForCausalLM``.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` refuses to
    run without the ``accelerate`` package, which this project does not
    depend on; this calls the function that method uses for the tensors
    (``load_gguf_checkpoint``: dequantize + undo the Q/K permutation) and the
    config class's own GGUF parsing, so no number comes from our loader.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf: Any = LlamaForCausalLM(config)
    reader: Any = load_gguf_checkpoint
    tensors = reader(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    reference: torch.nn.Module = hf.eval()
    return reference


def greedy_generate(
    model: LlamaModel, prompt_ids: list[int], max_new_tokens: int, block_size: int = 16
) -> list[int]:
    """Our greedy continuation: one prefill, then one decode step per token, stopping at EOS."""
    total = len(prompt_ids) + max_new_tokens
    cache = empty_cache(model.config, -(-total // block_size), block_size)
    table = list(range(cache.shape[0]))[::-1]
    logits = model(
        ForwardBatch(torch.tensor(prompt_ids), [SeqInput(0, len(prompt_ids), table)]), cache
    )
    out: list[int] = []
    while True:
        token = int(logits[0].argmax())
        out.append(token)
        if token in model.config.eos_token_ids or len(out) == max_new_tokens:
            return out
        seq = SeqInput(len(prompt_ids) + len(out) - 1, 1, table)
        logits = model(ForwardBatch(torch.tensor([token]), [seq]), cache)
