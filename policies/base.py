"""The policy interface (DESIGN.md, "Policy").

``choose(request, workers, matches) -> Decision``: the decision names the
worker (for PD, also the prefill worker and any KV source peer) and carries
the score breakdown per candidate, which the gateway exposes in metrics and
the debug response header.

A policy that remembers where it placed requests (speculative prefixes, routing
rates) may also split ``choose`` in two (:class:`PlacingPolicy`): ``score``, then
``commit`` of the worker the request actually went to. The router core uses the
pair when session affinity or the PD planner sends the request elsewhere than
the policy chose, so that the policy does not credit its choice with a prefix it
never computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from indexer.views import PrefixMatch, WorkerView

__all__ = ["Decision", "NoWorkerError", "PlacingPolicy", "Policy", "RouteRequest", "Scored"]


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered, or none of the right role)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know of a request.

    Attributes:
        request_id: The gateway's id for the request.
        model: Requested model name.
        num_tokens: Prompt length in tokens.
        block_keys: Keys of the prompt's full blocks (``indexer.keys.block_keys``).
        block_size: Tokens per block.
        now: Current time in seconds (wall clock live, virtual in the simulator).
        max_tokens: Requested output length, when known.
        session_id: Client's session-affinity hint, if any.
    """

    request_id: str
    model: str
    num_tokens: int
    block_keys: tuple[int, ...]
    block_size: int
    now: float
    max_tokens: int = 0
    session_id: str | None = None


@dataclass(slots=True)
class Decision:
    """A routing decision and why.

    Attributes:
        worker: The host that serves the request (decode side under PD).
        policy: Name of the policy that decided.
        scores: Per candidate host, its score terms (e.g. ``wait_s``,
            ``load_s``, ``prefill_s``, ``total``); lower or higher is better as
            the policy documents in ``lower_is_better``.
        predicted_ttft_s: The predicted time to first token on ``worker``, when
            the policy predicts one.
        matched_blocks: Blocks of the prompt the chosen worker holds, counting those it
            pulls from ``kv_source`` first: the gateway asks it to pull that many
            leading blocks, and counts only the rest as prefill work.
        prefill_worker: Under PD, the host that prefills; None otherwise.
        kv_source: A peer to pull cached blocks from, if any.
        lower_is_better: Whether ``scores[h]["total"]`` is minimized.
    """

    worker: str
    policy: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    predicted_ttft_s: float | None = None
    matched_blocks: int = 0
    prefill_worker: str | None = None
    kv_source: str | None = None
    lower_is_better: bool = True

    def ranked(self) -> list[str]:
        """Candidates best first (by ``total``), the chosen worker always first.

        The gateway retries on the next one when a dispatch fails before the first byte.
        """
        others = [h for h in self.scores if h != self.worker]
        others.sort(
            key=lambda h: self.scores[h].get("total", 0.0), reverse=not self.lower_is_better
        )
        return [self.worker, *others]


@runtime_checkable
class Policy(Protocol):
    """A routing policy. Implementations may keep state (a counter, a tree) but do no I/O."""

    name: str

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick a worker for ``request``.

        Args:
            request: The request's features.
            workers: Live workers able to serve the model (never empty).
            matches: Index answer per host holding a prefix of the request
                (hosts with no match are absent).

        Raises:
            NoWorkerError: When ``workers`` is empty.
        """
        ...


@dataclass(slots=True)
class Scored:
    """A request scored by a :class:`PlacingPolicy`, not yet committed.

    Attributes:
        decision: What ``choose`` would return: the policy's choice and every score.
    """

    decision: Decision


@runtime_checkable
class PlacingPolicy(Policy, Protocol):
    """A policy whose ``choose`` is ``score`` then ``commit`` of the chosen worker.

    ``commit`` records the placement in the policy's memory of what it routed; the
    router core commits the worker the request really runs on, which session
    affinity or the PD planner may have changed. ``commit`` follows its ``score``
    directly, with no other ``score`` between them.
    """

    def score(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Scored:
        """Score ``request`` as ``choose`` does, recording no placement."""
        ...

    def commit(self, scored: Scored, worker: str, ttft_s: float | None = None) -> None:
        """Record that the request of ``scored`` runs on ``worker``.

        ``worker`` may be one the policy did not score (a decode-only worker under
        PD); ``ttft_s`` is then the caller's predicted TTFT there.
        """
        ...
