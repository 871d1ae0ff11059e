"""``random``: a uniformly random worker, from a seeded generator.

Follows SGLang's router (``sgl-project/sglang``, ``sgl-router/src/policies/random.rs``:
a uniform index into the healthy workers). The generator is the policy's own
``random.Random(seed)``, so a benchmark replays the same choices run after run.
Workers are drawn from their host-sorted order, so the caller's list order does
not change the outcome.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest

__all__ = ["RandomPolicy"]


class RandomPolicy:
    """Uniform choice; ``total`` is 0 for the chosen worker and 1 for the others."""

    name = "random"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick a worker at random.

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("random: no worker to route to")
        hosts = sorted({w.host for w in workers})
        chosen = hosts[self._rng.randrange(len(hosts))]
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores={h: {"total": 0.0 if h == chosen else 1.0} for h in hosts},
            matched_blocks=match.blocks if match is not None else 0,
        )
