"""``mooncake_conductor``: Mooncake's KVCache-centric prefill scheduling.

Follows Algorithm 1 of Qin et al., "Mooncake: Trading More Storage for Less
Computation -- A KVCache-centric Architecture for Serving LLM Chatbot"
(FAST '25; arXiv 2407.00079, section 6.1). For each prefill instance::

    if best_prefix / prefix < kvcache_balancing_threshold:   # local cache is good enough
        TTFT = T_queue + T_prefill(prompt, prefix)
    else:                                                    # pull the best holder's blocks
        TTFT = T_transfer(best_prefix - prefix) + T_queue + T_prefill(prompt, best_prefix)

and the instance with the smallest TTFT wins; ``best_prefix`` is the longest
prefix any instance holds. ``T_queue`` is the sum of the prefill times queued
on the instance (the paper's definition: Mooncake's prefill instances do not
decode, so no decode term), ``T_prefill`` comes from the timing profile (the
paper fits a model to offline measurements), and thanks to layer-wise prefill
(section 5.2) loading the instance's own cached blocks from DRAM/SSD overlaps
the computation: ``T_prefill = max(load, compute)``. When the pull branch wins,
``Decision.kv_source`` names the holder, which is Mooncake's hot-spot
replication (section 6.2).

``T_transfer`` is the bytes moved over the receiving instance's transfer
bandwidth as it publishes it (measured on its pulls, as Mooncake's transfer
engine knows its own network), else 25 GB/s (one 200 Gb/s RDMA NIC). Until
2026-12-07 it was 25 GB/s whatever the network, so on the bench suite's
12.5 GB/s fleet every pull looked twice as fast as it was.

Not published, so chosen here: ``balancing_threshold`` 2.0 (pull when the best
holder has at least twice this instance's prefix). Decode-instance selection
and SLO-based early rejection (Algorithm 1's last lines, section 7) are the
gateway's job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest
from policies.cost_model import load_seconds, queue_seconds, resolve_profile, split_prompt

__all__ = ["FALLBACK_TRANSFER_BANDWIDTH", "MooncakeConductorPolicy"]

#: Bytes/s of a pull to an instance that publishes no transfer bandwidth: one 200 Gb/s
#: RDMA NIC.
FALLBACK_TRANSFER_BANDWIDTH = 25e9


class MooncakeConductorPolicy:
    """Minimum of queue + prefill (+ transfer from the best holder) over the workers."""

    name = "mooncake_conductor"

    def __init__(
        self,
        *,
        balancing_threshold: float = 2.0,
        transfer_bandwidth: float | None = None,
        default_profile: TimingProfile | None = None,
    ) -> None:
        """``transfer_bandwidth``: bytes/s of every pull (None: each receiving instance's
        published transfer bandwidth, else :data:`FALLBACK_TRANSFER_BANDWIDTH`)."""
        if not (math.isfinite(balancing_threshold) and balancing_threshold >= 1.0):
            raise ValueError(f"balancing_threshold must be >= 1, got {balancing_threshold}")
        if transfer_bandwidth is not None and not (
            math.isfinite(transfer_bandwidth) and transfer_bandwidth > 0
        ):
            raise ValueError(f"transfer_bandwidth must be positive, got {transfer_bandwidth}")
        self.balancing_threshold = balancing_threshold
        self.transfer_bandwidth = transfer_bandwidth
        self.default_profile = default_profile

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the instance with the smallest predicted TTFT (Algorithm 1).

        Raises:
            NoWorkerError: ``workers`` is empty.
            ValueError: A bad block size, or a worker without any profile to use.
        """
        if not workers:
            raise NoWorkerError("mooncake_conductor: no worker to route to")
        views = {w.host: w for w in workers}
        hosts = sorted(views)
        size = request.block_size
        local: dict[str, int] = {}
        for h in hosts:
            match = matches.get(h)
            local[h] = min(match.blocks, len(request.block_keys)) if match is not None else 0
        holder = min(hosts, key=lambda h: (-local[h], h))
        best = local[holder]
        scores: dict[str, dict[str, float]] = {}
        for h in hosts:
            view = views[h]
            profile = resolve_profile(view, self.default_profile)
            pull = best > local[h] and best >= self.balancing_threshold * local[h]
            prefix = best if pull else local[h]
            transfer = 0.0
            if pull:
                moved = (best - local[h]) * size * profile.kv_bytes_per_token
                bandwidth = (
                    self.transfer_bandwidth
                    or view.transfer_bandwidth
                    or FALLBACK_TRANSFER_BANDWIDTH
                )
                transfer = moved / bandwidth
            cached, new = split_prompt(request.num_tokens, prefix, size)
            load = load_seconds(view, profile, matches.get(h), size)
            prefill = max(load, profile.prefill_seconds(new, cached))
            queue = queue_seconds(profile, view.queued_prefill_tokens)
            scores[h] = {
                "queue_s": queue,
                "transfer_s": transfer,
                "prefill_s": prefill,
                "cached_tokens": float(cached),
                "pull": 1.0 if pull else 0.0,
                "total": transfer + queue + prefill,
            }
        chosen = min(hosts, key=lambda h: (scores[h]["total"], views[h].in_flight, h))
        pulled = scores[chosen]["pull"] > 0
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            predicted_ttft_s=scores[chosen]["total"],
            matched_blocks=best if pulled else local[chosen],
            kv_source=holder if pulled else None,
        )
