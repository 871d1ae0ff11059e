"""What a policy has routed but the index and the worker views do not show yet.

The gateway's picture of a worker lags: KV events reach the index, and
heartbeats refresh ``WorkerView``, some time after a request was dispatched.
Without its own memory, a policy routing a burst of requests that share one
system prompt sees the same stale picture for each of them: the prefix
cached nowhere and the queues empty. This state closes that gap:

* speculative prefix entries: after routing a request to ``w``, treat ``w`` as
  holding that request's block keys on HBM until its blocks can be in the index:
  the time the request waits and prefills there (``pending_s``, the policy's
  prediction) plus ``ttl_s``, the time the worker's events take to reach the
  index. Without ``pending_s`` a request queued longer than ``ttl_s`` vanished
  from the picture before its blocks existed, and the next turn of its
  conversation, arriving meanwhile, recomputed the whole history elsewhere;
* speculative load: add the request's uncached prompt tokens (and one request)
  to ``w``'s queue until ``ttl_s`` passes or a view of ``w`` taken after the
  routing (``view.ts >= routed_at + catchup_s``) already counts it.

Dynamo's router does the same with its ``ApproxKvIndexer`` (routing decisions
with a TTL, ``lib/llm/src/kv_router/approx.rs``) and llm-d's precise scorer
with its speculative index entries. Time comes from the caller (``now``);
nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from indexer.keys import chained_prefix
from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView

__all__ = ["Speculation"]


@dataclass(slots=True)
class _Pending:
    """One request routed to a host and not yet visible in its view."""

    tokens: int
    routed_at: float
    expires: float


@dataclass(slots=True)
class _Backlog:
    """A host's pending requests in routing order, with their token sum."""

    entries: deque[_Pending] = field(default_factory=deque)
    tokens: int = 0

    def drop_front(self, keep: Callable[[_Pending], bool]) -> None:
        """Pop entries from the old end until one passes ``keep``."""
        while self.entries and not keep(self.entries[0]):
            self.tokens -= self.entries.popleft().tokens


class Speculation:
    """Speculative prefix entries and speculative load per host.

    Args:
        ttl_s: How long an entry lives (seconds of the caller's clock).
        catchup_s: A view taken this long after a routing is trusted to count it.
    """

    def __init__(self, ttl_s: float = 2.0, catchup_s: float = 0.05) -> None:
        if not ttl_s > 0:
            raise ValueError(f"speculative ttl must be positive, got {ttl_s}")
        if not catchup_s >= 0:
            raise ValueError(f"catchup margin must be >= 0, got {catchup_s}")
        self.ttl_s = ttl_s
        self.catchup_s = catchup_s
        self._keys: dict[str, dict[int, float]] = {}
        # A heap: entries last different times (their requests' predicted waits).
        self._expiry: list[tuple[float, int, str, tuple[int, ...]]] = []
        self._seq = itertools.count()
        self._pending: dict[str, _Backlog] = {}
        # Per host, the latest expiry any of its keys holds: a chain expiring no earlier
        # can overwrite its keys at once instead of taking the max key by key.
        self._latest: dict[str, float] = {}

    def expire(self, now: float) -> None:
        """Drop entries whose time has passed; amortized O(dropped keys + hosts).

        Speculative load is kept in routing order and dropped from the old end, which
        assumes ``now`` does not go backwards; if it does, younger entries may
        outlive their TTL until the older ones ahead of them expire.
        """
        for host, backlog in list(self._pending.items()):
            backlog.drop_front(lambda p: p.expires > now)
            if not backlog.entries:
                del self._pending[host]
        while self._expiry and self._expiry[0][0] <= now:
            expires, _, host, keys = heapq.heappop(self._expiry)
            held = self._keys.get(host)
            if held is None:
                continue
            for key in keys:
                if held.get(key) == expires:
                    del held[key]
            if not held:
                del self._keys[host]
                self._latest.pop(host, None)

    def record(
        self,
        host: str,
        keys: Sequence[int],
        new_tokens: int,
        now: float,
        pending_s: float = 0.0,
    ) -> None:
        """Remember that a request with ``keys`` and ``new_tokens`` to prefill went to ``host``.

        ``pending_s``: how long until its blocks are computed there (its predicted TTFT);
        its keys are held that much longer than ``ttl_s``.
        """
        expires = now + self.ttl_s
        if keys:
            held_until = expires + max(pending_s, 0.0)
            held = self._keys.setdefault(host, {})
            if held_until >= self._latest.get(host, -math.inf):
                held.update(dict.fromkeys(keys, held_until))
            else:
                for key in keys:
                    held[key] = max(held.get(key, held_until), held_until)
            self._latest[host] = max(self._latest.get(host, -math.inf), held_until)
            heapq.heappush(self._expiry, (held_until, next(self._seq), host, tuple(keys)))
        backlog = self._pending.setdefault(host, _Backlog())
        backlog.entries.append(_Pending(new_tokens, now, expires))
        backlog.tokens += new_tokens

    def prefix_blocks(self, host: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` that ``host`` speculatively holds, in O(log len(keys)).

        A host's held keys are prefix-closed: a chain is recorded whole, a key
        names its whole prefix, and expiries only move later, so an ancestor
        never expires before its descendants. Membership along ``keys`` is
        therefore a run of hits then misses, and a binary search finds its end.
        """
        held = self._keys.get(host)
        if not held:
            return 0
        return chained_prefix(len(keys), lambda i: keys[i] in held)

    def merge(
        self, host: str, keys: Sequence[int], match: PrefixMatch | None
    ) -> PrefixMatch | None:
        """The index's match for ``host`` widened by its speculative prefix.

        Blocks a worker just computed sit on HBM, so the speculative prefix counts
        as HBM; index blocks beyond it keep their media, the slowest assumed
        deepest (LRU demotes a chain's tail first).
        """
        spec = self.prefix_blocks(host, keys)
        if spec == 0:
            return match
        if match is None:
            return PrefixMatch(host, spec, (spec, 0, 0))
        # The router's note of the matched HBM blocks no request holds (idle_hbm) carries
        # over; blocks known only from speculation are being computed by the request
        # routed there just now, so they count as held.
        idle = match.idle_hbm
        if match.blocks <= spec:
            return PrefixMatch(host, spec, (spec, 0, 0), idle_hbm=idle)
        rest = match.blocks - spec
        ssd = min(match.on(Medium.SSD), rest)
        dram = min(match.on(Medium.DRAM), rest - ssd)
        hbm = match.blocks - ssd - dram
        return PrefixMatch(
            host, match.blocks, (hbm, dram, ssd), idle_hbm=None if idle is None else min(idle, hbm)
        )

    def pending(self, view: WorkerView, now: float) -> tuple[int, int]:
        """(tokens, requests) routed to the worker that its view does not show yet."""
        backlog = self._pending.get(view.host)
        if backlog is None:
            return 0, 0
        seen_until = view.ts - self.catchup_s
        backlog.drop_front(lambda p: p.expires > now and p.routed_at > seen_until)
        if not backlog.entries:
            del self._pending[view.host]
        return backlog.tokens, len(backlog.entries)
