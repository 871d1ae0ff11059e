"""``kv_ttft``: route to the worker with the smallest predicted time to first token.

Our default policy (DESIGN.md, "Policy"). For each candidate worker ``w``::

    TTFT(w) = wait(w) + load(w) + prefill(w)

* ``wait``: draining the prompt tokens already queued on ``w`` (the view's
  ``queued_prefill_tokens`` plus what this policy routed there that the view
  does not show yet), chunked at the step budget while the running decode
  batch takes its share of every step (``policies.cost_model``);
* ``load``: moving the matched blocks that sit on DRAM or SSD into HBM, at the
  worker's measured bandwidth per medium, else its profile's. vLLM's CPU
  offloading loads a request's blocks before computing it, so the load adds
  to the prefill instead of overlapping it;
* ``prefill``: computing the uncached tokens after the cached ones, beside the
  same decode batch.

The running decode batch holds ``running * mean_decode_context`` KV tokens:
heartbeats carry the batch size, not each sequence's context, so the mean
context is an option (2048 by default, a chat-sized prompt plus answer).

The minimum wins; ties go to the fewest in-flight requests (including those
routed here and not yet visible), then the host name, so decisions are
reproducible. Speculative state (``policies.speculation``) makes a burst of
requests sharing one system prompt see each other: the second request finds
the first's prefix on the first's worker, and that worker's longer queue, so
the burst spreads once queueing costs more than recomputing the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError, RouteRequest
from policies.cost_model import (
    load_seconds,
    prefill_seconds,
    queue_seconds,
    resolve_profile,
    split_prompt,
)
from policies.speculation import Speculation

__all__ = ["KvTtftPolicy"]


class KvTtftPolicy:
    """Predicted-TTFT routing with speculative prefix entries and load.

    Args:
        speculative_ttl_s: Lifetime of speculative entries (default 2 s: well above
            the event-to-index and heartbeat delays of a healthy cluster).
        catchup_s: A view taken this long after a routing already counts it.
        mean_decode_context: KV tokens per running sequence assumed for the decode term.
        default_profile: Profile for workers that publish none.
        speculative_load: Add what this policy routed to the views' queues until they
            show it. The gateway turns it off: its own accounting of routed requests is
            already in the views it passes, exact and immediate, and counting it twice
            would push a burst away from the worker that holds its prefix.
    """

    name = "kv_ttft"

    def __init__(
        self,
        *,
        speculative_ttl_s: float = 2.0,
        catchup_s: float = 0.05,
        mean_decode_context: int = 2048,
        default_profile: TimingProfile | None = None,
        speculative_load: bool = True,
    ) -> None:
        if mean_decode_context < 0:
            raise ValueError(f"mean_decode_context must be >= 0, got {mean_decode_context}")
        self.speculation = Speculation(speculative_ttl_s, catchup_s)
        self.mean_decode_context = mean_decode_context
        self.default_profile = default_profile
        self.speculative_load = speculative_load

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the worker with the smallest predicted TTFT; see the module docstring.

        Raises:
            NoWorkerError: ``workers`` is empty.
            ValueError: A bad block size, or a worker without any profile to use.
        """
        if not workers:
            raise NoWorkerError("kv_ttft: no worker to route to")
        now = request.now
        self.speculation.expire(now)
        keys = request.block_keys
        scores: dict[str, dict[str, float]] = {}
        rank: dict[str, tuple[float, int, str]] = {}
        blocks: dict[str, tuple[int, int]] = {}
        for view in workers:
            profile = resolve_profile(view, self.default_profile)
            match = self.speculation.merge(view.host, keys, matches.get(view.host))
            matched = min(match.blocks, len(keys)) if match is not None else 0
            cached, new = split_prompt(request.num_tokens, matched, request.block_size)
            spec_tokens, spec_requests = (
                self.speculation.pending(view, now) if self.speculative_load else (0, 0)
            )
            batch = view.running
            kv = batch * self.mean_decode_context
            wait = queue_seconds(profile, view.queued_prefill_tokens + spec_tokens, batch, kv)
            load = load_seconds(view, profile, match, request.block_size)
            prefill = prefill_seconds(profile, new, cached, batch, kv)
            total = wait + load + prefill
            in_flight = view.in_flight + spec_requests
            scores[view.host] = {
                "wait_s": wait,
                "load_s": load,
                "prefill_s": prefill,
                "cached_tokens": float(cached),
                "speculative_tokens": float(spec_tokens),
                "in_flight": float(in_flight),
                "total": total,
            }
            rank[view.host] = (total, in_flight, view.host)
            blocks[view.host] = (matched, new)
        best = min(rank, key=rank.__getitem__)
        matched, new = blocks[best]
        self.speculation.record(best, keys, new, now)
        return Decision(
            worker=best,
            policy=self.name,
            scores=scores,
            predicted_ttft_s=scores[best]["total"],
            matched_blocks=matched,
        )
