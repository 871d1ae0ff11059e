"""``power_of_two``: sample two workers at random, keep the less loaded one.

The power-of-two-choices rule (Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing", 2001) as SGLang's router implements it
(``sgl-project/sglang``, ``sgl-router/src/policies/power_of_two.rs``: two distinct
random workers, the one with the lower load wins). Load compares like
``least_load`` (in flight, then queued tokens, then host). Sampling uses the
policy's own seeded ``random.Random`` over the host-sorted workers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest
from policies.least_load import load_key, load_scores

__all__ = ["PowerOfTwoPolicy"]


class PowerOfTwoPolicy:
    """Two random candidates, the less loaded wins; ``sampled`` marks them in the scores."""

    name = "power_of_two"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the less loaded of two random workers (the only one if there is one).

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("power_of_two: no worker to route to")
        views = sorted({w.host: w for w in workers}.values(), key=lambda w: w.host)
        picks = self._rng.sample(views, 2) if len(views) > 1 else views
        chosen = min(picks, key=load_key).host
        picked = {p.host for p in picks}
        scores = load_scores(views)
        for view in views:
            scores[view.host]["sampled"] = 1.0 if view.host in picked else 0.0
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            matched_blocks=match.blocks if match is not None else 0,
        )
