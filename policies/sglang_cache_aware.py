"""``sglang_cache_aware``: SGLang's approximate cache-aware routing with balance thresholds.

Follows ``sgl-project/sglang``, ``sgl-router/src/policies/cache_aware.rs``
(``CacheAwareConfig::default``: cache_threshold 0.5, balance_abs_threshold 32,
balance_rel_threshold 1.0001, eviction_interval_secs 60, max_tree_size 100000):

1. Load is the number of requests in flight per worker. The system is
   imbalanced when both ``max - min > balance_abs_threshold`` and
   ``max > min * balance_rel_threshold``; then the least loaded worker wins
   (shortest queue), and the request still goes into its tree.
2. Otherwise the request is matched against the tree of routing history (not
   the global index: this policy only knows what it routed). If the matched
   fraction of the prompt is above ``cache_threshold`` the worker holding the
   match wins; else the worker with the smallest tree, the one with the most
   spare cache by this estimate.
3. Every ``eviction_interval_s`` the tree is cut back to ``max_tree_size`` per
   worker, least recently used leaves first.

Our deviations: the tree is keyed by block keys, not characters (see
``policies.history_tree``), so the match rate is ``matched blocks * block size
/ prompt tokens`` and ``max_tree_size`` counts blocks; eviction runs when a
request arrives after the interval instead of on a background thread (no
clock here); ties go to fewer in-flight requests, then the host name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest
from policies.history_tree import HistoryTree

__all__ = ["SglangCacheAwarePolicy"]


class SglangCacheAwarePolicy:
    """Cache affinity from a tree of routing history, shortest queue when imbalanced.

    ``scores[h]`` carries ``in_flight``, ``tree_blocks`` (its history size) and
    ``matched_blocks`` (its history's match); ``total`` is the criterion of the
    branch taken (lower is better): in-flight count when imbalanced, minus the
    matched blocks on a cache hit, the tree size otherwise.
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        eviction_interval_s: float = 60.0,
        max_tree_size: int = 100_000,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or not balance_rel_threshold > 0:
            raise ValueError("balance thresholds must be >= 0 (absolute) and > 0 (relative)")
        if not eviction_interval_s > 0 or max_tree_size < 0:
            raise ValueError("eviction_interval_s must be > 0 and max_tree_size >= 0")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.tree = HistoryTree()
        self._last_eviction: float | None = None

    def _maybe_evict(self, now: float) -> None:
        if self._last_eviction is None:
            self._last_eviction = now
        elif now - self._last_eviction >= self.eviction_interval_s:
            self.tree.evict(self.max_tree_size)
            self._last_eviction = now

    def imbalanced(self, workers: Sequence[WorkerView]) -> bool:
        """SGLang's test: the load spread exceeds both the absolute and relative thresholds."""
        loads = [w.in_flight for w in workers]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Route by history-tree affinity unless the load is imbalanced.

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("sglang_cache_aware: no worker to route to")
        now = request.now
        self._maybe_evict(now)
        views = {w.host: w for w in workers}
        keys = request.block_keys
        hosts = sorted(views)
        own = self.tree.match_lengths(keys, hosts)
        scores = {
            h: {
                "in_flight": float(views[h].in_flight),
                "tree_blocks": float(self.tree.size(h)),
                "matched_blocks": float(own[h]),
            }
            for h in hosts
        }
        if self.imbalanced(workers):
            chosen = min(hosts, key=lambda h: (views[h].in_flight, h))
            criterion = "in_flight"
        else:
            matched, holders = self.tree.best(keys, own)
            tokens = max(request.num_tokens, 1)
            if holders and matched * request.block_size / tokens > self.cache_threshold:
                chosen = holders[0]
                self.tree.touch(keys, chosen, now)
                criterion = "matched_blocks"
            else:
                chosen = min(hosts, key=lambda h: (self.tree.size(h), views[h].in_flight, h))
                criterion = "tree_blocks"
        sign = -1.0 if criterion == "matched_blocks" else 1.0
        for h in hosts:
            scores[h]["total"] = sign * scores[h][criterion]
        self.tree.insert(keys, chosen, now)
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            matched_blocks=match.blocks if match is not None else 0,
        )
