"""The oracle hit bound: one LRU cache with the whole cluster's capacity.

A router can at best make the cluster behave like one cache holding every
block of every worker's HBM, DRAM and SSD, seen by every request. This module
replays a trace's prompts, in arrival order, through one block-granular LRU
of that capacity and counts the prefix hits, with the scheduler's rule that at
least the last prompt token is computed (a fully cached prompt gives back its
last block). Its hit rate is the bound the simulator's policies are compared
with.

Two choices make it generous, as a bound should be: it caches a prompt's
blocks the moment the prompt arrives (a real worker caches them only once
computed), and it touches a prompt's blocks tail first so that the prefix is
most recent and evicted last (an LRU that evicted a prefix before its tail
would keep blocks no prompt can reach). It is not a proof of optimality: LRU
is not Belady's optimal replacement, and a partitioned cache can in contrived
cases beat a global LRU. :attr:`OracleBound.unbounded_hit_rate` is the hard
ceiling: an infinite cache, where only the first sight of a block misses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from indexer.keys import root_parent
from kvrouter.bench.trace import PromptFactory, TraceRecord, arrival_times

__all__ = ["LruOracle", "OracleBound", "oracle_bound"]


@dataclass(frozen=True, slots=True)
class OracleBound:
    """Hits of the oracle cache over a trace.

    Attributes:
        capacity_blocks: Blocks the oracle cache holds.
        prompt_tokens: Prompt tokens over the trace.
        hit_tokens: Prompt tokens served from the oracle LRU.
        unbounded_hit_tokens: Prompt tokens an infinite cache would serve.
    """

    capacity_blocks: int
    prompt_tokens: int
    hit_tokens: int
    unbounded_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens (0.0 for an empty trace)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def unbounded_hit_rate(self) -> float:
        """The infinite cache's hit rate."""
        return self.unbounded_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _cached_tokens(matched: int, num_tokens: int, block_size: int) -> int:
    if matched * block_size >= num_tokens:
        matched -= 1
    return max(matched, 0) * block_size


class LruOracle:
    """A block-granular LRU over block keys plus an infinite "seen" set.

    Args:
        capacity_blocks: Blocks the LRU holds (>= 0).
        block_size: Tokens per block.
    """

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError("capacity_blocks must be >= 0 and block_size >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.unbounded_hit_tokens = 0

    def observe(self, num_tokens: int, keys: Sequence[int]) -> int:
        """Look up then cache one prompt; return its hit tokens in the LRU.

        Args:
            num_tokens: Prompt length.
            keys: Its full blocks' keys (``indexer.keys.block_keys``).
        """
        lru, seen = self._lru, self._seen
        matched = 0
        for key in keys:
            if key not in lru:
                break
            matched += 1
        known = 0
        for key in keys:
            if key not in seen:
                break
            known += 1
        hit = _cached_tokens(matched, num_tokens, self.block_size)
        self.prompt_tokens += num_tokens
        self.hit_tokens += hit
        self.unbounded_hit_tokens += _cached_tokens(known, num_tokens, self.block_size)
        seen.update(keys)
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
        return hit

    def bound(self) -> OracleBound:
        """The totals so far."""
        return OracleBound(
            self.capacity_blocks, self.prompt_tokens, self.hit_tokens, self.unbounded_hit_tokens
        )


def oracle_bound(
    prompts: Iterable[tuple[int, Sequence[int]]], capacity_blocks: int, block_size: int
) -> OracleBound:
    """Replay ``(num_tokens, keys)`` prompts, in arrival order, through an :class:`LruOracle`."""
    oracle = LruOracle(capacity_blocks, block_size)
    for num_tokens, keys in prompts:
        oracle.observe(num_tokens, keys)
    return oracle.bound()


def trace_bound(
    trace: Sequence[TraceRecord],
    capacity_blocks: int,
    block_size: int,
    model: str,
    *,
    vocab_size: int = 32000,
    time_scale: float = 1.0,
) -> OracleBound:
    """The bound of a whole trace replayed in arrival order on ``capacity_blocks`` of cache."""
    prompts = PromptFactory(block_size, root_parent(model), vocab_size=vocab_size)
    arrivals = arrival_times(trace, time_scale)
    order = sorted(range(len(trace)), key=lambda i: (arrivals[i], i))
    return oracle_bound(
        ((trace[i].input_length, prompts.keys(trace[i])) for i in order),
        capacity_blocks,
        block_size,
    )
