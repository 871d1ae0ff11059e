"""``round_robin``: each request to the next worker in turn.

Follows SGLang's router (``sgl-project/sglang``, ``sgl-router/src/policies/round_robin.rs``):
a counter that advances once per request, modulo the number of workers. We
cycle over the workers sorted by host name, so the turn order does not depend
on the order the caller lists them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy:
    """Cycle through the workers; ``scores[h]["total"]`` is how many turns until ``h``."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the next worker in turn.

        Raises:
            NoWorkerError: ``workers`` is empty.
        """
        if not workers:
            raise NoWorkerError("round_robin: no worker to route to")
        hosts = sorted({w.host for w in workers})
        turn = self._counter % len(hosts)
        self._counter += 1
        scores = {h: {"total": float((i - turn) % len(hosts))} for i, h in enumerate(hosts)}
        chosen = hosts[turn]
        match = matches.get(chosen)
        return Decision(
            worker=chosen,
            policy=self.name,
            scores=scores,
            matched_blocks=match.blocks if match is not None else 0,
        )
