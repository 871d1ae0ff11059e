"""``llmd_precise``: llm-d's precise prefix-cache scorer plus queue and KV-usage scorers.

Follows llm-d's endpoint picker as its precise-prefix-cache guide configures it
(``llm-d/llm-d``, ``guides/precise-prefix-cache-aware``: precise-prefix-cache-scorer
weight 3, kv-cache-utilization-scorer weight 2, queue-scorer weight 2,
max-score-picker):

* prefix score: the longest run of the prompt's blocks a pod holds, each block
  weighted by the tier it sits on (``llm-d/llm-d-kv-cache``,
  ``pkg/kvcache/kvblock_scorer.go`` ``LongestPrefixScorer``; tier weights from
  ``pkg/kvcache/backend.go`` ``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8,
  storage 0.3, which we map to hbm, dram and ssd). Scores are min-max
  normalized over the pods that matched at all; a pod with no match scores 0,
  and when every matching pod scores the same they all get 1
  (``indexedScoresToNormalizedScoredPods`` in llm-d-inference-scheduler).
* queue score: ``(max - waiting) / (max - min)`` over the candidates' waiting
  queues, 1 for all when they are equal (gateway-api-inference-extension,
  ``pkg/epp/scheduling/framework/plugins/scorer/queue.go``).
* KV-cache utilization score: ``1 - usage`` of HBM (same project's
  ``KVCacheUtilizationScorer``). Our views count cached-but-free blocks as used,
  where vLLM's usage metric does not, so this reads higher than vLLM's would.
* the picker takes the highest weighted sum; ties are broken at random (the
  max-score picker shuffles its candidates), here with the policy's seeded
  ``random.Random``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest

__all__ = ["LlmdPrecisePolicy"]


class LlmdPrecisePolicy:
    """Weighted sum of prefix, queue and KV-usage scores, highest wins."""

    name = "llmd_precise"

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_usage_weight: float = 2.0,
        hbm_weight: float = 1.0,
        dram_weight: float = 0.8,
        ssd_weight: float = 0.3,
        seed: int = 0,
    ) -> None:
        weights = (
            prefix_weight,
            queue_weight,
            kv_usage_weight,
            hbm_weight,
            dram_weight,
            ssd_weight,
        )
        if any(not w >= 0 for w in weights):
            raise ValueError(f"llmd_precise weights must be >= 0, got {weights}")
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_usage_weight = kv_usage_weight
        self.tier_weights = {
            Medium.HBM: hbm_weight,
            Medium.DRAM: dram_weight,
            Medium.SSD: ssd_weight,
        }
        self._rng = random.Random(seed)

    def _prefix_scores(
        self, hosts: Sequence[str], matches: Mapping[str, PrefixMatch], num_keys: int
    ) -> dict[str, float]:
        raw: dict[str, float] = {}
        for h in hosts:
            match = matches.get(h)
            if match is None or match.blocks <= 0:
                continue
            blocks = min(match.blocks, num_keys)
            weighted = sum(self.tier_weights[m] * match.on(m) for m in self.tier_weights)
            raw[h] = weighted * blocks / match.blocks
        if not raw:
            return dict.fromkeys(hosts, 0.0)
        low, high = min(raw.values()), max(raw.values())
        return {
            h: (0.0 if h not in raw else 1.0 if high == low else (raw[h] - low) / (high - low))
            for h in hosts
        }

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the highest weighted score.

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("llmd_precise: no worker to route to")
        views = {w.host: w for w in workers}
        hosts = sorted(views)
        prefix = self._prefix_scores(hosts, matches, len(request.block_keys))
        waiting = [views[h].waiting for h in hosts]
        low, high = min(waiting), max(waiting)
        scores: dict[str, dict[str, float]] = {}
        for h in hosts:
            queue = 1.0 if high == low else (high - views[h].waiting) / (high - low)
            kv = 1.0 - min(max(views[h].kv_usage(Medium.HBM), 0.0), 1.0)
            total = (
                self.prefix_weight * prefix[h]
                + self.queue_weight * queue
                + self.kv_usage_weight * kv
            )
            scores[h] = {"prefix": prefix[h], "queue": queue, "kv_usage": kv, "total": total}
        best = max(s["total"] for s in scores.values())
        tied = [h for h in hosts if scores[h]["total"] == best]
        chosen = tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            matched_blocks=match.blocks if match is not None else 0,
            lower_is_better=False,
        )
