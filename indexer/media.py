"""Storage media of the KV cache, ordered fastest first."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["MEDIA", "Medium"]


class Medium(StrEnum):
    """Where a KV block sits. The string value is the wire name in events and metrics.

    ``rank`` orders media fastest first (hbm=0, dram=1, ssd=2); compact index
    entries store the rank, not the name.
    """

    HBM = "hbm"
    DRAM = "dram"
    SSD = "ssd"

    @property
    def rank(self) -> int:
        """0 for hbm, 1 for dram, 2 for ssd."""
        return _RANK[self]

    @classmethod
    def from_rank(cls, rank: int) -> Medium:
        """Inverse of :attr:`rank`; raises ValueError for an unknown rank."""
        try:
            return MEDIA[rank]
        except IndexError:
            raise ValueError(f"unknown medium rank {rank}") from None

    @classmethod
    def from_vllm(cls, name: str | None) -> Medium:
        """Map vLLM's medium names (GPU / CPU / DISK, any case; None means GPU)."""
        if name is None:
            return cls.HBM
        try:
            return _VLLM[name.upper()]
        except KeyError:
            raise ValueError(f"unknown vLLM medium {name!r}") from None

    def slower(self) -> Medium | None:
        """The next slower medium (where an evicted block is demoted), or None for ssd."""
        r = self.rank + 1
        return MEDIA[r] if r < len(MEDIA) else None


MEDIA: tuple[Medium, ...] = (Medium.HBM, Medium.DRAM, Medium.SSD)
_RANK = {m: i for i, m in enumerate(MEDIA)}
_VLLM = {"GPU": Medium.HBM, "CPU": Medium.DRAM, "DISK": Medium.SSD}
