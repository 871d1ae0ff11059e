"""Measured copies between two media: counts, bytes, seconds and a recent bandwidth.

:class:`~engine_worker.tiers.TierStorage` keeps one per (source, destination)
pair of media; the KV puller keeps one for blocks received from peers. It is
plain arithmetic over numbers, kept apart from the tensors so that code which
only reads or reports the figures need not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EWMA_ALPHA", "TransferStat"]

#: Weight of the newest copy in the running averages of :class:`TransferStat`.
EWMA_ALPHA = 0.05


@dataclass(slots=True)
class TransferStat:
    """Copies from one medium to another since counting began.

    The bandwidth is a ratio of two exponentially weighted moving averages,
    of bytes and of seconds per copy (weight :data:`EWMA_ALPHA` on the newest),
    that is, bytes over time across roughly the last ``1 / EWMA_ALPHA`` copies.
    Averaging the ratio instead of each copy's own bytes/s keeps one copy that
    the timer caught in a few nanoseconds from dominating the estimate.

    Attributes:
        copies: Blocks copied.
        bytes: Bytes copied.
        seconds: Time spent in those copies.
        avg_bytes: Exponentially weighted bytes per copy.
        avg_seconds: Exponentially weighted seconds per copy.
    """

    copies: int = 0
    bytes: int = 0
    seconds: float = 0.0
    avg_bytes: float = 0.0
    avg_seconds: float = 0.0

    def add(self, num_bytes: int, seconds: float) -> None:
        """Fold one copy of ``num_bytes`` bytes that took ``seconds`` in."""
        if self.copies == 0:
            self.avg_bytes, self.avg_seconds = float(num_bytes), seconds
        else:
            self.avg_bytes += EWMA_ALPHA * (num_bytes - self.avg_bytes)
            self.avg_seconds += EWMA_ALPHA * (seconds - self.avg_seconds)
        self.copies += 1
        self.bytes += num_bytes
        self.seconds += seconds

    @property
    def bandwidth(self) -> float | None:
        """Recent bytes/s (see the class docstring); None before the first copy."""
        if self.copies == 0 or self.avg_seconds <= 0.0:
            return None
        return self.avg_bytes / self.avg_seconds

    def copy(self) -> TransferStat:
        """An independent copy (the storage keeps counting in its own)."""
        return TransferStat(self.copies, self.bytes, self.seconds, self.avg_bytes, self.avg_seconds)
