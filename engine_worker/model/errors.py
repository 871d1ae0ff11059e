"""Exceptions raised while resolving, configuring and loading a model.

A missing file is a plain :class:`FileNotFoundError`; everything else a
loader refuses is one of these, so that the CLI can print one clear line.
"""

from __future__ import annotations

__all__ = ["ModelError", "UnsupportedModelError"]


class ModelError(ValueError):
    """A model spec, config or checkpoint is invalid (bad values, inconsistent shapes)."""


class UnsupportedModelError(ModelError):
    """A checkpoint is well formed but uses something we do not implement.

    Examples: an architecture other than Llama/Qwen2, a GGUF quantization
    type outside the supported list, an unknown RoPE scaling scheme.
    """
