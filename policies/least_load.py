"""``least_load``: the worker with the fewest requests in flight, then the shortest queue.

The classic shortest-queue baseline, as SGLang's router falls back to when its
cache-aware policy finds the load imbalanced (``sgl-project/sglang``,
``sgl-router/src/policies/cache_aware.rs``: "shortest queue"). Ties on in-flight
requests go to the fewer queued prefill tokens, then the host name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest

__all__ = ["LeastLoadPolicy", "load_key", "load_scores"]


def load_key(view: WorkerView) -> tuple[int, int, str]:
    """Order of preference: fewest in flight, then fewest queued tokens, then host name."""
    return (view.in_flight, view.queued_prefill_tokens, view.host)


def load_scores(workers: Sequence[WorkerView]) -> dict[str, dict[str, float]]:
    """Per host: ``in_flight``, ``queued_prefill_tokens`` and a ``total`` that sorts like
    :func:`load_key` (in-flight count plus the queue as a fraction below 1)."""
    top = max(w.queued_prefill_tokens for w in workers) + 1
    return {
        w.host: {
            "in_flight": float(w.in_flight),
            "queued_prefill_tokens": float(w.queued_prefill_tokens),
            "total": w.in_flight + w.queued_prefill_tokens / top,
        }
        for w in workers
    }


class LeastLoadPolicy:
    """Fewest in-flight requests, then fewest queued prefill tokens, then host name."""

    name = "least_load"

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the least loaded worker.

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("least_load: no worker to route to")
        chosen = min(workers, key=load_key).host
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=load_scores(workers),
            matched_blocks=match.blocks if match is not None else 0,
        )
