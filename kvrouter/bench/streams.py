"""Building blocks of the workload generators: token streams cut into trace hash ids.

A conversation is an append-only token stream cut into 512-token blocks, and
block ``i`` of a stream always carries the same hash id, allocated when the
stream first reaches it. A prompt that ends mid-block lists that block's id
too: the replay truncates it at ``input_length``, so the prompt holds exactly
the first tokens the block will hold once the stream grows, and the next
turn's prompt starts with every token of this one, as real chat text does.
Content shared *between* streams (a system prompt, a document) is a stream of
its own that others :meth:`TokenStream.fork`: they share its whole 512-token
blocks only, so shared lengths that are multiples of 512 share exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord

__all__ = ["TokenStream", "WorkloadError", "check_positive", "shared_stream"]


class WorkloadError(ValueError):
    """A workload parameter is out of range."""


def check_positive(**values: float) -> None:
    """Raise :class:`WorkloadError` naming the first value that is not finite and > 0."""
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):
            raise WorkloadError(f"{name} must be positive, got {value}")


@dataclass(slots=True)
class TokenStream:
    """An append-only token stream and the hash ids of its 512-token blocks."""

    alloc: Callable[[], int]
    ids: list[int] = field(default_factory=list)
    length: int = 0

    def fork(self) -> TokenStream:
        """A new stream starting with this one's whole blocks (its partial block is not shared)."""
        whole = self.length // HASH_BLOCK_TOKENS
        return TokenStream(self.alloc, self.ids[:whole], whole * HASH_BLOCK_TOKENS)

    def append(self, tokens: int) -> None:
        """Grow by ``tokens``, giving every block it newly reaches a fresh id."""
        self.length += tokens
        while len(self.ids) * HASH_BLOCK_TOKENS < self.length:
            self.ids.append(self.alloc())

    def record(self, at_s: float, output: int) -> TraceRecord:
        """A request whose prompt is the stream so far."""
        return TraceRecord(round(at_s * 1000.0, 3), self.length, output, list(self.ids))


def shared_stream(
    alloc: Callable[[], int], tokens: int, base: TokenStream | None = None
) -> TokenStream:
    """A stream of ``tokens`` tokens (after ``base``'s whole blocks, if any) for others to fork."""
    stream = base.fork() if base is not None else TokenStream(alloc)
    stream.append(tokens)
    return stream
