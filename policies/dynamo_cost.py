"""``dynamo_cost``: NVIDIA Dynamo's KV-router cost function.

Follows ``ai-dynamo/dynamo``, ``lib/kv-router/src/scheduling/selector/default.rs``
(``DefaultWorkerScorer::worker_logit``) with the defaults of its
``KvRouterConfig``. Per worker, in blocks::

    raw_prefill  = (worker's active prefill tokens + prompt tokens) / block_size
    credit       = overlap_score_weight * device_blocks
                   + host_cache_hit_weight * host_blocks + disk_cache_hit_weight * disk_blocks
    cost         = prefill_load_scale * max(0, raw_prefill - credit)
                   + decode_blocks + decode_active_request_weight * active_requests

Defaults: overlap_score_weight (Dynamo's ``--kv-overlap-score-weight``, now
``overlap_score_credit``) 1.0, host 0.75, disk 0.25, prefill_load_scale 1.0,
decode_active_request_weight 0.0, router temperature 0.0 (argmin; Dynamo
breaks exact ties at random, here with the policy's seeded generator). With a
temperature above 0 the worker is sampled with probability proportional to
``exp(-(cost - min) / ((max - min) * temperature))``, Dynamo's normalized
softmax.

Dynamo's router knows each worker's active blocks because it tracks every
sequence it routed until the sequence finishes. Our views carry only request
counts, so ``decode_blocks = (in_flight + 1) * prompt blocks``: the worker's
in-flight requests are assumed to be this request's size, and the request adds
its own blocks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest

__all__ = ["DynamoCostPolicy"]


class DynamoCostPolicy:
    """Minimum (or softmax-sampled) Dynamo cost; ``scores`` hold its terms in blocks."""

    name = "dynamo_cost"

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        prefill_load_scale: float = 1.0,
        decode_active_request_weight: float = 0.0,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        values = (
            overlap_score_weight,
            host_cache_hit_weight,
            disk_cache_hit_weight,
            prefill_load_scale,
            decode_active_request_weight,
            temperature,
        )
        if any(not (math.isfinite(v) and v >= 0) for v in values):
            raise ValueError(
                f"dynamo_cost weights and temperature must be finite and >= 0: {values}"
            )
        self.credit = {
            Medium.HBM: overlap_score_weight,
            Medium.DRAM: host_cache_hit_weight,
            Medium.SSD: disk_cache_hit_weight,
        }
        self.prefill_load_scale = prefill_load_scale
        self.decode_active_request_weight = decode_active_request_weight
        self.temperature = temperature
        self._rng = random.Random(seed)

    def _sample(self, hosts: list[str], cost: dict[str, float]) -> str:
        low, high = min(cost.values()), max(cost.values())
        if self.temperature == 0.0:
            tied = [h for h in hosts if cost[h] == low]
            return tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        if high == low:
            return hosts[self._rng.randrange(len(hosts))]
        weights = [math.exp(-(cost[h] - low) / ((high - low) * self.temperature)) for h in hosts]
        return self._rng.choices(hosts, weights=weights)[0]

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick by Dynamo's cost.

        Raises:
            NoWorkerError: ``workers`` is empty.
            ValueError: A non-positive block size.
        """
        if not workers:
            raise NoWorkerError("dynamo_cost: no worker to route to")
        if request.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {request.block_size}")
        views = {w.host: w for w in workers}
        hosts = sorted(views)
        size = request.block_size
        prompt_blocks = request.num_tokens / size
        scores: dict[str, dict[str, float]] = {}
        for h in hosts:
            view = views[h]
            match = matches.get(h)
            credit = 0.0
            if match is not None:
                credit = sum(weight * match.on(m) for m, weight in self.credit.items())
            raw = (view.queued_prefill_tokens + request.num_tokens) / size
            prefill = self.prefill_load_scale * max(0.0, raw - credit)
            decode = (view.in_flight + 1) * prompt_blocks
            active = self.decode_active_request_weight * view.in_flight
            scores[h] = {
                "overlap_credit": credit,
                "prefill_blocks": prefill,
                "decode_blocks": decode,
                "total": prefill + decode + active,
            }
        chosen = self._sample(hosts, {h: s["total"] for h, s in scores.items()})
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            matched_blocks=match.blocks if match is not None else 0,
        )
