"""``kv_ttft``: route to the worker with the smallest predicted time to first token,
charged for the delay its work imposes on the requests behind it.

Our default policy (DESIGN.md, "Policy"). For each candidate worker ``w``::

    TTFT(w)  = wait(w) + load(w) + prefill(w)
    score(w) = TTFT(w) + externality_weight * work(w) * rate(w) * TTFT(w) / (1 - rho)

* ``wait``: draining the prompt tokens already queued on ``w`` (the view's
  ``queued_prefill_tokens``, which the gateway overlays with its own exact
  count of what it routed, plus, when ``speculative_load`` is on, what this
  policy routed that the view does not show yet), chunked at the step budget
  while the running decode batch takes its share of every step
  (``policies.cost_model``);
* ``load``: moving the matched blocks that sit on DRAM or SSD into HBM, at the
  worker's measured bandwidth per medium, else its profile's. vLLM's CPU
  offloading loads a request's blocks before computing it, so the load adds
  to the prefill instead of overlapping it;
* ``prefill``: computing the uncached tokens after the cached ones, beside the
  same decode batch.

TTFT alone is greedy: under load, a session's next turn would chase a
slightly shorter queue and recompute its whole history elsewhere, which
spends capacity everybody waits for (the bench suite showed turns moving
away from their cache at 90% load and p90 TTFT ten times the best peer's).
The externality term prices that: ``work(w)`` (load + compute of this
request on ``w``) delays every request routed to ``w`` before this one's
prefill ends, about ``rate(w) * TTFT(w)`` of them (``rate`` is what this
policy routed to ``w`` recently, so an idle worker is charged nothing), and
more while the worker stays busy: ``1 / (1 - rho)``, the busy-period
stretch of an M/G/1 queue, with ``rho`` estimated as the share of arrivals
that found prefill queued (Poisson arrivals see time averages). At light
load the term vanishes and the policy is plain TTFT.

The minimum score wins; ties go to the fewest in-flight requests (including
those routed here and not yet visible), then the host name, so decisions are
reproducible. ``predicted_ttft_s`` is the chosen worker's TTFT (not its
score). Speculative prefix entries (``policies.speculation``) make a burst of
requests sharing one system prompt see each other: the second request finds
the first's prefix on the first's worker, and that worker's longer queue, so
the burst spreads once queueing costs more than recomputing the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from policies.arrivals import RouteRates
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
        externality_weight: Weight of the delay a choice imposes on later requests
            (0 is plain TTFT-greedy routing). The default 2 was chosen on the bench
            suite (weights 1, 2 and 4 compared on every workload and load): the estimate
            counts only prefill queueing, while extra work also slows the decode steps
            every running request shares.
        busy_period: Stretch the externality by ``1 / (1 - rho)``.
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
        externality_weight: float = 2.0,
        busy_period: bool = True,
    ) -> None:
        if mean_decode_context < 0:
            raise ValueError(f"mean_decode_context must be >= 0, got {mean_decode_context}")
        self.speculation = Speculation(speculative_ttl_s, catchup_s)
        self.mean_decode_context = mean_decode_context
        self.default_profile = default_profile
        self.speculative_load = speculative_load
        if externality_weight < 0:
            raise ValueError(f"externality_weight must be >= 0, got {externality_weight}")
        self.externality_weight = externality_weight
        self.routed = RouteRates()
        self.busy_period = busy_period
        self._busy = 0.0

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
        # Poisson arrivals see time averages: the share of arrivals finding a worker with
        # prefill queued estimates its utilization rho; extra work then delays everyone
        # arriving until the busy period ends, 1 / (1 - rho) times the backlog.
        busy_now = sum(1 for v in workers if v.queued_prefill_tokens > 0 or v.waiting) / len(
            workers
        )
        self._busy += 0.02 * (busy_now - self._busy)
        stretch = 1.0 / max(1.0 - self._busy, 0.1) if self.busy_period else 1.0
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
            ttft = wait + load + prefill
            # The compute this request adds delays everyone routed behind it on this worker:
            # (the worker's routing rate x the time until this prefill ends) requests, stretched
            # by the busy period. An idle worker delays nobody.
            work = load + profile.prefill_seconds(new, cached)
            externality = work * self.routed.rate(view.host, now) * ttft * stretch
            total = ttft + self.externality_weight * externality
            in_flight = view.in_flight + spec_requests
            scores[view.host] = {
                "wait_s": wait,
                "load_s": load,
                "prefill_s": prefill,
                "cached_tokens": float(cached),
                "speculative_tokens": float(spec_tokens),
                "in_flight": float(in_flight),
                "ttft_s": ttft,
                "externality_s": externality,
                "total": total,
            }
            rank[view.host] = (total, in_flight, view.host)
            blocks[view.host] = (matched, new)
        best = min(rank, key=rank.__getitem__)
        matched, new = blocks[best]
        self.speculation.record(best, keys, new, now)
        self.routed.record(best, now)
        return Decision(
            worker=best,
            policy=self.name,
            scores=scores,
            predicted_ttft_s=scores[best]["ttft_s"],
            matched_blocks=matched,
        )
