"""Loaders (HF safetensors, GGUF) and the registry, against transformers on the same files.

Every checkpoint is written at test time into ``tmp_path``: transformers'
``save_pretrained`` for HF directories, gguf's ``GGUFWriter`` for GGUF files
(quantized, with llama.cpp's Q/K permutation). Tolerance: max abs logit
difference <= 1e-4 in float32.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from engine_worker.model.config import ModelConfig, RopeScaling
from engine_worker.model.errors import ModelError, UnsupportedModelError
from engine_worker.model.gguf_loader import load_gguf
from engine_worker.model.hf_loader import load_hf
from engine_worker.model.registry import SMOLLM2_NAME, resolve, smollm2_gguf_path
from engine_worker.model.tiny import random_model
from tests.engine_worker.model_refs import (
    FLOAT32_TOL,
    hf_config_kwargs,
    hf_from_gguf,
    hf_logits,
    prefill_logits,
    randomize_,
    write_llama_gguf,
)

VOCAB = 320


def small_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "name": "small",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_ids": (2,),
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_hf_llama_sharded_with_llama3_rope_scaling(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    scaling = RopeScaling(8.0, 1.0, 4.0, original_max_position_embeddings=16)
    config = small_config(rope_scaling=scaling, rope_theta=500000.0)
    hf: Any = LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(config)))
    randomize_(hf, seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    loaded_config, model = load_hf(tmp_path)
    assert loaded_config.rope_scaling == scaling
    assert loaded_config.name == tmp_path.name
    assert not loaded_config.tie_word_embeddings
    prompt = ids(40, seed=2)  # past the original 16-token context: scaling matters
    assert (
        float((prefill_logits(model, prompt) - hf_logits(hf.eval(), prompt)[-1]).abs().max())
        <= FLOAT32_TOL
    )


def test_hf_qwen2_with_qkv_bias_and_tied_embeddings(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kwargs = hf_config_kwargs(small_config(tie_word_embeddings=True))
    kwargs.pop("head_dim")
    hf: Any = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    randomize_(hf, seed=3)
    assert float(hf.model.layers[0].self_attn.q_proj.bias.detach().abs().sum()) > 0
    hf.save_pretrained(tmp_path)

    config, model = load_hf(tmp_path, name="qwen-small")
    assert (config.attention_bias, config.attention_out_bias) == (True, False)
    assert (config.tie_word_embeddings, config.name) == (True, "qwen-small")
    assert model.lm_head.weight is model.embed_tokens.weight
    prompt = ids(21, seed=4)
    assert (
        float((prefill_logits(model, prompt) - hf_logits(hf.eval(), prompt)[-1]).abs().max())
        <= FLOAT32_TOL
    )


def test_hf_dtype_override(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(small_config()))).save_pretrained(tmp_path)
    config, model = load_hf(tmp_path, dtype="bfloat16")
    assert config.dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(
    "quant", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1], ids=lambda q: q.name
)
def test_gguf_quantized_llama_matches_transformers_reading_the_same_file(
    tmp_path: Path, quant: GGMLQuantizationType
) -> None:
    source = random_model(small_config(tie_word_embeddings=True), seed=5)
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, source, quant=quant)

    config, model = load_gguf(path)
    assert config.name == "small"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.tie_word_embeddings, config.eos_token_ids) == (True, (2,))
    prompt = ids(19, seed=6)
    ours = prefill_logits(model, prompt)
    ref = hf_logits(hf_from_gguf(path), prompt)[-1]
    assert float((ours - ref).abs().max()) <= FLOAT32_TOL
    # Quantization moved the weights, yet the file still encodes the source model.
    assert int(ours.argmax()) == int(prefill_logits(source, prompt).argmax())


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], **hf_config_kwargs(small_config())})
    )
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="model 'nope' not found"):
        resolve("nope")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve(str(tmp_path / ".."))


def test_unsupported_architectures_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], **hf_config_kwargs(small_config())})
    )
    with pytest.raises(UnsupportedModelError, match="'MistralForCausalLM' is not supported"):
        load_hf(tmp_path)
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2'"):
        load_gguf(path)


def test_unsupported_quant_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ternary.gguf"
    write_llama_gguf(path, random_model(small_config(), seed=7), quant=GGMLQuantizationType.IQ4_NL)
    with pytest.raises(UnsupportedModelError, match=r"tensor types \['IQ4_NL'\] are not supported"):
        load_gguf(path)


def test_gguf_that_disagrees_with_its_metadata_is_refused(tmp_path: Path) -> None:
    model = random_model(small_config(intermediate_size=64), seed=8)
    model.config.intermediate_size = 96  # metadata now lies about the MLP width
    write_llama_gguf(tmp_path / "bad.gguf", model)
    with pytest.raises(ModelError, match=r"ffn_gate.weight has shape \(64, 64\)"):
        load_gguf(tmp_path / "bad.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")


def test_registry_resolves_aliases_and_paths(tmp_path: Path) -> None:
    smol = resolve("smollm2")
    assert (smol.name, smol.kind) == (SMOLLM2_NAME, "gguf")
    assert smol.weights == smol.tokenizer_path == smollm2_gguf_path()
    tiny = resolve("tiny")
    assert (tiny.name, tiny.kind, tiny.weights) == ("tiny", "tiny", None)
    assert tiny.tokenizer_path == smollm2_gguf_path()
    config, _ = tiny.load(seed=1)
    assert (config.vocab_size, config.eos_token_ids) == (49152, (2,))

    path = tmp_path / "my-model.Q8_0.gguf"
    write_llama_gguf(path, random_model(small_config(), seed=9))
    spec = resolve(str(path))
    assert (spec.name, spec.kind, spec.tokenizer_path) == ("my-model.Q8_0", "gguf", path)
    assert spec.load()[0].name == "my-model.Q8_0"
    assert resolve(str(path), name="served").name == "served"
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"must be \.gguf"):
        resolve(str(tmp_path / "weights.bin"))
