"""Shape and size of one KV block, shared by the tiers and the model runner.

Layout of a medium's storage (one tensor per medium, allocated once)::

    storage[block_id] : [num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

All layers of a block are contiguous, so moving a block between media is
one copy of ``block_bytes`` bytes. The model reads layer ``l``'s keys as
``storage[:, l, 0]`` and gathers them by block table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DTYPE_SIZES", "KVLayout"]

#: Bytes per element of the dtypes the KV cache may use (names as in torch).
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one KV block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(DTYPE_SIZES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: (layers, 2, block_size, kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        """Elements in one block."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes in one block (what one tier copy moves)."""
        return self.block_numel * DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token across all layers."""
        return self.block_bytes // self.block_size
