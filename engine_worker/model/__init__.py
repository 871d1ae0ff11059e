"""The model: config, Llama-family decoder over a paged KV cache, loaders, registry.

Importing this package does not import torch (the router resolves model
specs and tokenizers through it); the torch modules (``llama``,
``gguf_loader``, ``hf_loader``, ``tiny``) are imported where used, or
through :meth:`ModelSpec.load`.
"""

from engine_worker.model.config import ModelConfig, RopeScaling
from engine_worker.model.errors import ModelError, UnsupportedModelError
from engine_worker.model.registry import ModelSpec, resolve

__all__ = [
    "ModelConfig",
    "ModelError",
    "ModelSpec",
    "RopeScaling",
    "UnsupportedModelError",
    "resolve",
]
