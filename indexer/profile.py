"""Timing profile: how long a worker takes to prefill, decode and load KV blocks.

One model, three users: the ``sim`` runner returns each step's modeled
duration from it, workers publish their own (fitted) profile in their
heartbeat, and the routing policies predict time-to-first-token with it.

Model (seconds)::

    prefill(n new, c cached)  = p0 + p1*n + p2*n^2 + p3*n*c        (one chunk)
    decode(b seqs, k kv tok)  = d0 + d1*b + d2*k                   (one step)
    step(chunks, b, k)        = max(p0, d0) + sum_chunks(p1*n + p2*n^2 + p3*n*c)
                                + d1*b + d2*k                      (a mixed batch)
    load(t tokens, medium)    = t * kv_bytes_per_token / bandwidth[medium]

``p2*n^2 + p3*n*c`` is attention's cost (quadratic in the chunk, linear in
the cached context it attends to); ``p1*n`` is the linear layers; ``d2*k``
is reading the KV cache during decode. A medium with no bandwidth entry
(HBM) loads in zero time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import msgspec

from indexer.media import Medium

__all__ = ["DEFAULT_TRANSFER_BANDWIDTH", "TimingProfile"]

#: Bytes/s assumed for moving KV between workers until a worker has measured its own
#: pulls (and modeled by ``sim`` workers, whose blocks are placeholders): one 100 Gb/s
#: RDMA NIC (12.5 GB/s), the per-NIC link of Mooncake's transfer engine deployments
#: (FAST'25, section 4) and of common H100 nodes' scale-out networks.
DEFAULT_TRANSFER_BANDWIDTH = 12.5e9


class TimingProfile(msgspec.Struct, frozen=True, kw_only=True):
    """Coefficients of the cost model above, plus where they came from."""

    name: str
    prefill: tuple[float, float, float, float]
    decode: tuple[float, float, float]
    kv_bytes_per_token: int
    load_bandwidth: dict[Medium, float] = msgspec.field(default_factory=dict)
    max_num_batched_tokens: int = 8192
    source: str = ""

    def __post_init__(self) -> None:
        if any(not math.isfinite(c) or c < 0 for c in (*self.prefill, *self.decode)):
            raise ValueError(f"profile {self.name!r}: coefficients must be finite and >= 0")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"profile {self.name!r}: kv_bytes_per_token must be positive")
        if any(not bw > 0 for bw in self.load_bandwidth.values()):
            raise ValueError(f"profile {self.name!r}: load bandwidths must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"profile {self.name!r}: max_num_batched_tokens must be positive")

    def _prefill_var(self, new: int, cached: int) -> float:
        _, p1, p2, p3 = self.prefill
        return p1 * new + p2 * new * new + p3 * new * cached

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` after ``cached_tokens``, chunked by the step budget.

        A long prompt runs as several chunks of at most ``max_num_batched_tokens``,
        each paying the step overhead and attending to everything before it.
        """
        if new_tokens <= 0:
            return 0.0
        total = 0.0
        done = 0
        chunk = self.max_num_batched_tokens
        while done < new_tokens:
            n = min(chunk, new_tokens - done)
            total += self.prefill[0] + self._prefill_var(n, cached_tokens + done)
            done += n
        return total

    def decode_seconds(self, batch: int, kv_tokens: int) -> float:
        """Time of one decode step over ``batch`` sequences holding ``kv_tokens`` tokens."""
        if batch <= 0:
            return 0.0
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * kv_tokens

    def step_seconds(
        self, chunks: Iterable[tuple[int, int]], decode_batch: int, decode_kv_tokens: int
    ) -> float:
        """Time of one mixed step: prefill ``chunks`` of (new, cached) tokens, plus decode."""
        var = 0.0
        has_prefill = False
        for new, cached in chunks:
            if new > 0:
                has_prefill = True
                var += self._prefill_var(new, cached)
        if decode_batch > 0:
            var += self.decode[1] * decode_batch + self.decode[2] * decode_kv_tokens
        if not has_prefill and decode_batch <= 0:
            return 0.0
        base = max(self.prefill[0] if has_prefill else 0.0, self.decode[0] if decode_batch else 0.0)
        return base + var

    def load_seconds(self, num_tokens: int, medium: Medium) -> float:
        """Time to bring ``num_tokens`` tokens of KV from ``medium`` into HBM."""
        bw = self.load_bandwidth.get(medium)
        if bw is None or num_tokens <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / bw

    def blocks_load_seconds(self, blocks: Mapping[Medium, int], block_size: int) -> float:
        """Time to read ``blocks`` (a count per medium) of ``block_size`` tokens off their
        media (HBM blocks cost nothing): a load into HBM, or a peer reading what it serves."""
        return sum(self.load_seconds(n * block_size, m) for m, n in blocks.items())

    def with_step_budget(self, budget: int) -> TimingProfile:
        """This profile for a scheduler that chunks prefill at ``budget`` tokens a step
        (itself when that is already its budget): a router counts a long prompt's chunks,
        and their step overheads, with it."""
        if budget == self.max_num_batched_tokens:
            return self
        return msgspec.structs.replace(self, max_num_batched_tokens=budget)

    def slowed(self, factor: float) -> TimingProfile:
        """This profile on hardware ``factor`` times slower: every duration times ``factor``
        (bandwidths divided by it). A ``sim`` worker running at ``time_scale`` publishes
        its profile slowed by that scale, so that routers predict in the wall-clock time
        they keep their own books in.

        Raises:
            ValueError: ``factor`` is not finite and positive.
        """
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be finite and positive, got {factor}")
        if factor == 1:
            return self
        p0, p1, p2, p3 = self.prefill
        d0, d1, d2 = self.decode
        return TimingProfile(
            name=f"{self.name} x{factor:g}",
            prefill=(p0 * factor, p1 * factor, p2 * factor, p3 * factor),
            decode=(d0 * factor, d1 * factor, d2 * factor),
            kv_bytes_per_token=self.kv_bytes_per_token,
            load_bandwidth={m: bw / factor for m, bw in self.load_bandwidth.items()},
            max_num_batched_tokens=self.max_num_batched_tokens,
            source=self.source,
        )
