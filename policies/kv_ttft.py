"""``kv_ttft``: route to the worker with the smallest predicted time to first token,
charged for the delay its work imposes on the requests behind it.

Our default policy (DESIGN.md, "Policy"). For each candidate worker ``w``::

    TTFT(w)  = max(queue(w), memory(w)) + load(w) + prefill(w)
             = max(queue(w), memory(w), loads(w)) + load(w)^ + prefill(w)  (async loads)
    score(w) = TTFT(w) + externality_weight * (delayed(w) * TTFT(w) + landing(w)) / (1 - rho)
               + displacement(w)

* ``queue``: draining the prompt tokens already queued on ``w`` (the view's
  ``queued_prefill_tokens``, which the gateway overlays with its own exact
  count of what it routed, plus, when ``speculative_load`` is on, what this
  policy routed that the view does not show yet), chunked at the step budget
  while the running decode batch (its published KV tokens) takes its share of
  every step, plus the attention the queued tokens pay to the context before
  their chunk (``queued_prefill_context``): a queued 100K-token prompt costs
  several times its token count (``policies.cost_model``), plus, where loads
  stall the steps, bringing up the queue's cached DRAM and SSD blocks
  (``queued_load_blocks``), which the step admitting each request pays before
  any of it is computed; on a worker only
  decoding, the rest of the decode step in progress (half a step on average,
  ``step_residual_seconds``), which a new request waits out before its chunk
  joins the next step. Where the view names the step in progress (when it
  ends and which queued tokens it computes: ``step_in_progress``), the request
  waits out what is left of that step, then the queued tokens it does not
  compute: counted whole, a worker ending a 93 ms prefill looked 93 ms away
  from the group prompt it held, and the prompt was recomputed elsewhere;
* ``memory``: what the new prompt loses when it does not fit in ``w``'s HBM
  beside what running and queued requests hold and will grow into
  (``memory_wait_seconds``): a vLLM-style scheduler admits it, preempts it when
  a later chunk finds HBM full, and starts it over once enough running
  requests finished: when the view names them (``kv_release``), once the
  ones whose blocks nobody queued takes back have finished their prefill and
  expected outputs (an agent's step whose history its next step, queued,
  reuses frees nothing). The wait overlaps the queue, hence the ``max``;
* ``load``: moving the matched blocks that sit on DRAM or SSD into HBM, at the
  worker's measured bandwidth per medium, else its profile's. vLLM's CPU
  offloading loads a request's blocks before computing it, so the load adds
  to the prefill instead of overlapping it. A worker that loads beside its
  steps (the view's ``async_loads``, as vLLM's offloading connector does)
  starts it once the loads before it (``loads``: the view's
  ``queued_load_blocks``) are done, while the queue drains; its load then
  delays no one else, and is no part of the ``work`` below. The request is
  computed in the first step that starts after its load lands, so on a worker
  only decoding ``^`` rounds the load up to whole decode steps, at least one
  (``async_load_seconds``);
* ``prefill``: computing the uncached tokens after the cached ones, beside the
  same decode batch.

TTFT alone is greedy: under load, a session's next turn would chase a
slightly shorter queue and recompute its whole history elsewhere, which
spends capacity everybody waits for (the bench suite showed turns moving
away from their cache at 90% load and p90 TTFT ten times the best peer's).
The externality term prices that. The requests routed to ``w`` before this
one's prefill ends, about ``rate(w) * TTFT(w)`` of them (``rate`` is what
this policy routed to ``w`` recently, so an idle worker is charged nothing),
are delayed by the compute this request adds there, and more while the worker
stays busy: ``1 / (1 - rho)``, the busy-period stretch of an M/G/1 queue,
with ``rho`` estimated as the share of arrivals that found prefill queued
(Poisson arrivals see time averages). At light load the term vanishes and
the policy is plain TTFT.

What delays them is not the whole ``work(w)`` (load + compute of this request
on ``w``): some worker has to do at least the least work any candidate would
(``least``), and requests that could go elsewhere do, so they bear only the
excess ``work(w) - least``. Requests that came to ``w`` for its cache (the
``affine`` share of its rate, each weighted by the fraction of its prompt
that only ``w`` held) cannot leave without recomputing; they bear the whole
``work(w)``, but no more than moving would have cost them (``switching``,
the compute per second those choices saved)::

    delayed(w) = min(work(w) * affine(w), switching(w))
                 + (work(w) - least(w)) * (rate(w) - affine(w))

On a mixed fleet ``least(w)`` is that least work at ``w``'s own pace (its
profile's prefill time of the prompt against the least-work worker's): a
slower GPU gets fewer requests, in proportion to its speed, so its slower
compute delays the few behind it about as much as the faster GPU's would
delay its many. Charged the whole speed difference as harm, an idle A100
looked 15 s dearer than an H100 with a 3 s queue and a 28K-token burst
prompt waited out that queue (agent, every other worker an A100: p99 1.10x
Mooncake's). With one GPU kind ``least(w) = least``.

Charging the whole work to the whole rate, as this policy first did, made a
long prompt cached nowhere look cheapest on the worker chosen least lately,
the backlogged one, and kept long prompts away from workers whose traffic
was free to move: on production-shaped traffic near capacity that was a p99
ten times the best peer's (docs/benchmarks.md, "Production-shaped traffic").

With pooling, a request whose prefix is being pulled to ``w`` is queued there
only when its blocks land, behind whatever ``w`` started meanwhile: a long
prompt routed to ``w`` in between makes it wait its whole prefill. The
policy remembers when each pull it ordered should land; a candidate pays,
in its externality, the part of its work that each pull landing before its
prefill ends waits behind (``landing_s``). Blocks being pulled are not
speculated on their target either: a request that followed there before
they land would recompute them, so it prices its own pull instead. And a
pull is priced only for the blocks that fit in the HBM room admitted work
leaves on ``w`` (``hbm_room_blocks``): a worker imports only what fits, and
the cached copy is the first thing its queued requests' allocations evict.
A request loading its prefix beside the steps is the same case inside one
worker: admitted, but computed only once its load lands, it waits behind the
chunks of a prompt admitted meanwhile (running requests are scheduled in
order); the policy remembers when the loads it sent should land, and a
candidate pays for each landing while its own prefill runs.

What a request brings into ``w``'s HBM (the blocks it computes, pulls or
loads from DRAM and SSD) evicts cached blocks once the room admitted work
leaves is full, and the views cannot say which cached blocks anyone still
wants. The policy remembers which blocks its requests reused on each worker
within the last ``live_window_s`` (``policies.live_cache``): those are live,
the next request of a session, group or agent will come back for them. So
are the blocks of the homes it placed that nothing has returned to yet (see
below), weighed by the return probability: without them a worker just made
home to a burst's new prompts looks dead and draws the rest of the burst.
``displacement(w)`` is the reload of the live blocks (other than the
request's own) that its new blocks would evict (``displacement_seconds``):
a DRAM load, an SSD load on a worker without DRAM, a recompute on one with
HBM only (vLLM and SGLang without offloading), where an evicted block is
gone. A new system prompt then goes where the cache is dead rather than where
eight groups' prompts fill HBM, and a pull does not land on top of another
session's history for free. One-off traffic leaves nothing live and the
term vanishes. On the bench suite it brought ``groups`` p90 closer to
SGLang's and left the production-shaped cells within their run-to-run
spread (docs/benchmarks.md, "2026-12-04 (sixth)").

A prompt no worker holds half of (a new system prompt, document, session
or agent context; half is SGLang's cache threshold) makes a home where it
lands: whatever comes back for it comes back to that worker, so a worker's
homes are the load it will carry later, which no view shows. Placed by the
queues of the moment, a burst of new prompts piles onto whichever worker
is marginally ahead (on the bench suite's ``groups``, homes ended 6/6/9/11
where SGLang's smallest-tree rule made 8/8/8/8, and the crowded workers then
pulled their traffic elsewhere). The policy remembers the homes it made and
which were returned to within ``home_window_s`` (``policies.homes``), and
learns how likely a new prompt is to come back (taken as certain until
homes wait unreturned). Among the candidates within the prediction's own
error of the best score, the home goes to the worker expected to get the
fewest returns: its returned homes, plus its pending ones weighed by the
probability. The error is taken as ``home_band`` of the best candidate's
predicted wait plus ``home_band_s``, scaled by the probability: the wait is
where predictions err, while a prompt nobody holds computes the same on
every worker, so a long document is not sent behind a longer queue for
balance. Traffic whose new prompts never come back closes the band within
a window, and the score alone decides again.

With ``residency_tie_s`` > 0, a prompt the best candidate holds none of
goes, among the candidates within that many seconds of the best score, to
the one that received the
fewest new blocks lately (computed or pulled, decayed over a minute), as
SGLang's cache-aware router sends a prompt it matches nowhere to the worker
with the smallest tree, so new prefixes spread evenly instead of piling
onto whichever worker a near-tie favoured. It is off by default: on the
bench suite it brought ``groups`` closer to SGLang (p90 geomean over seeds
1-4 at 0.9 of capacity 21.9 -> 21.0 ms, SGLang 20.4) but the held-out
``rag`` cells, where it changes two to six early decisions per trace, came
out worse on both seeds tried (docs/benchmarks.md, "2026-12-03").

The minimum score wins; ties go to the fewest in-flight requests (including
those routed here and not yet visible), then the host name, so decisions are
reproducible. ``predicted_ttft_s`` is the chosen worker's TTFT (not its
score). Speculative prefix entries (``policies.speculation``, kept until the
request's predicted TTFT has passed, plus the TTL) make a burst of requests
sharing one system prompt see each other: the second request finds
the first's prefix on the first's worker, and that worker's longer queue, so
the burst spreads once queueing costs more than recomputing the prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from indexer.media import Medium
from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from policies.arrivals import RouteRates
from policies.base import Decision, NoWorkerError, RouteRequest, Scored
from policies.cost_model import (
    async_load_seconds,
    decode_batch,
    displacement_seconds,
    hbm_room_blocks,
    load_seconds,
    memory_wait_seconds,
    peer_pull_seconds,
    prefill_seconds,
    queue_seconds,
    queued_load_seconds,
    resolve_profile,
    split_prompt,
    step_in_progress,
)
from policies.homes import HomeDemand
from policies.live_cache import LiveCache
from policies.speculation import Speculation

__all__ = ["KvTtftPolicy"]


@dataclass(slots=True)
class _KvScored(Scored):
    """What :meth:`KvTtftPolicy.commit` needs of a scoring."""

    request: RouteRequest
    matches: Mapping[str, PrefixMatch]
    views: dict[str, WorkerView]
    #: Per candidate: (matched, pulled, new) blocks and tokens as scored.
    blocks: dict[str, tuple[int, int, int]]
    #: :meth:`KvTtftPolicy._home`'s returned homes and new home's first block.
    home: tuple[list[int], int | None]


class KvTtftPolicy:
    """Predicted-TTFT routing with speculative prefix entries and load.

    Args:
        speculative_ttl_s: How long speculative entries outlive their request's
            predicted TTFT, and speculative load its routing (default 2 s: well above
            the event-to-index and heartbeat delays of a healthy cluster).
        catchup_s: A view taken this long after a routing already counts it.
        mean_decode_context: KV tokens per running sequence assumed for the decode term
            when a view does not publish its running batch's context.
        mean_output_tokens: Output length assumed for how long requests hold KV memory
            when neither the worker (its measured mean) nor the request says.
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
        excess_work: Charge later requests only the work beyond the least any worker
            would spend, the whole work only to those bound to the worker by its cache
            (see the module docstring). False charges the whole work to every request
            routed behind it, as the first version did (kept to compare the two).
        pooling: Price pulling a longer cached prefix from a peer as one more source
            next to the worker's own tiers; the decision then names the peer
            (``kv_source``). Off by default: only a gateway that performs the pull
            (``--pooling``) turns it on.
        residency_tie_s: A prompt the best candidate holds none of goes to the worker
            that received the fewest new blocks lately among those scoring within this
            many seconds of the best (0, the default, turns it off; see the module
            docstring). 5 ms is the prediction's median absolute error on the suite.
            The homes' balance below supersedes it.
        residency_tau_s: Time constant of "lately" for ``residency_tie_s``.
        live_window_s: A block its requests reused on a worker stays live there this
            long after the last reuse, and evicting it costs its reload (see the module
            docstring); 0 turns the displacement term off. The default 60 s spans the
            reuse distances of the suite's workloads (agent steps, group requests,
            conversation turns: think times of ~7 s median, 43 s p99, per Alibaba's
            ATC'25 chatbot traces).
        home_window_s: A home (where a prompt nobody held was placed) is forgotten
            this long after its last return, or after it was placed if nothing came
            back, which counts against the return probability; 0 turns the homes'
            balance off. 60 s, as ``live_window_s``.
        home_band: The band of scores within which a new prompt's home goes to the
            worker expected to get the fewest returns, as a share of the best
            candidate's predicted wait, at return probability 1 (it scales with the
            probability). 0.2 is the prediction's typical relative error on the suite
            (mean |log(simulated / predicted)| 0.19, docs/benchmarks.md).
        home_band_s: Absolute part of that band (5 ms: the prediction's median
            absolute error on the suite), scaled likewise.
    """

    name = "kv_ttft"

    def __init__(
        self,
        *,
        speculative_ttl_s: float = 2.0,
        catchup_s: float = 0.05,
        mean_decode_context: int = 2048,
        mean_output_tokens: int = 256,
        default_profile: TimingProfile | None = None,
        speculative_load: bool = True,
        externality_weight: float = 2.0,
        busy_period: bool = True,
        excess_work: bool = True,
        pooling: bool = False,
        residency_tie_s: float = 0.0,
        residency_tau_s: float = 60.0,
        live_window_s: float = 60.0,
        home_window_s: float = 60.0,
        home_band: float = 0.2,
        home_band_s: float = 0.005,
    ) -> None:
        if mean_decode_context < 0:
            raise ValueError(f"mean_decode_context must be >= 0, got {mean_decode_context}")
        self.speculation = Speculation(speculative_ttl_s, catchup_s)
        self.mean_decode_context = mean_decode_context
        if mean_output_tokens < 0:
            raise ValueError(f"mean_output_tokens must be >= 0, got {mean_output_tokens}")
        self.mean_output_tokens = mean_output_tokens
        self.default_profile = default_profile
        self.speculative_load = speculative_load
        if externality_weight < 0:
            raise ValueError(f"externality_weight must be >= 0, got {externality_weight}")
        self.externality_weight = externality_weight
        self.routed = RouteRates()
        self.affine = RouteRates()
        self.switching = RouteRates()
        self.busy_period = busy_period
        self.excess_work = excess_work
        self.pooling = pooling
        if residency_tie_s < 0:
            raise ValueError(f"residency_tie_s must be >= 0, got {residency_tie_s}")
        self.residency_tie_s = residency_tie_s
        if residency_tau_s <= 0:
            raise ValueError(f"residency_tau_s must be > 0, got {residency_tau_s}")
        self.grown = RouteRates(residency_tau_s)
        if live_window_s < 0:
            raise ValueError(f"live_window_s must be >= 0, got {live_window_s}")
        self.live = LiveCache(live_window_s) if live_window_s > 0 else None
        if home_window_s < 0:
            raise ValueError(f"home_window_s must be >= 0, got {home_window_s}")
        if home_band < 0 or home_band_s < 0:
            raise ValueError(
                f"home_band and home_band_s must be >= 0, got {home_band} and {home_band_s}"
            )
        self.homes = HomeDemand(home_window_s) if home_window_s > 0 else None
        self.home_band = home_band
        self.home_band_s = home_band_s
        self._busy = 0.0
        self._landing: dict[str, list[float]] = {}
        #: Per worker, when the requests this policy sent there to load their prefix
        #: beside the steps become computable.
        self._loaded: dict[str, list[float]] = {}

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        """Pick the worker with the smallest predicted TTFT; see the module docstring.

        :meth:`score`, then :meth:`commit` of the chosen worker.

        Raises:
            NoWorkerError: ``workers`` is empty.
            ValueError: A bad block size, or a worker without any profile to use.
        """
        scored = self.score(request, workers, matches)
        self.commit(scored, scored.decision.worker)
        return scored.decision

    def score(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> _KvScored:
        """Score every candidate and pick one as :meth:`choose` does, recording no
        placement (:class:`~policies.base.PlacingPolicy`)."""
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
        self._expire_landings(now)
        if self.live is not None:
            self.live.expire(now)
        stretch = 1.0 / max(1.0 - self._busy, 0.1) if self.busy_period else 1.0
        keys = request.block_keys
        holders = self._holders(keys, matches) if self.pooling else []
        views = {v.host: v for v in workers}
        scores: dict[str, dict[str, float]] = {}
        rank: dict[str, tuple[float, int, str]] = {}
        blocks: dict[str, tuple[int, int, int]] = {}
        sources: dict[str, str] = {}
        profiles: dict[str, TimingProfile] = {}
        for view in workers:
            profile = profiles[view.host] = resolve_profile(view, self.default_profile)
            match = self.speculation.merge(view.host, keys, matches.get(view.host))
            matched = min(match.blocks, len(keys)) if match is not None else 0
            cached, new = split_prompt(request.num_tokens, matched, request.block_size)
            spec_tokens, spec_requests = (
                self.speculation.pending(view, now) if self.speculative_load else (0, 0)
            )
            output = view.mean_output_tokens or request.max_tokens or self.mean_output_tokens
            pulled = 0
            if self.pooling:
                source, source_blocks = self._peer(view.host, holders)
                if source_blocks > matched:
                    pulled = source_blocks - matched
                    # Pulled blocks land as cached blocks: those beyond the room admitted
                    # work leaves in HBM do not fit, or are evicted before this runs.
                    room = hbm_room_blocks(view, request.block_size, output)
                    if room is not None:
                        pulled = min(pulled, max(int(room), 0))
            batch, kv = decode_batch(view, self.mean_decode_context)
            queue = queue_seconds(
                profile,
                view.queued_prefill_tokens + spec_tokens,
                batch,
                kv,
                view.queued_prefill_context,
                step_in_progress(view, now),
            )
            # Loads stall the steps: the queue drains that much later. Beside the steps,
            # they are a channel this request's own load waits on.
            loads = queued_load_seconds(view, profile)
            if not view.async_loads:
                queue, loads = queue + loads, 0.0
            # Blocks it brings up from DRAM or SSD, and cached free HBM blocks (no running
            # request holds them: the router's annotation), leave the room it is priced on.
            lower = match.on(Medium.DRAM) + match.on(Medium.SSD) if match is not None else 0
            taken = 0
            if match is not None:
                taken = min(lower + (match.idle_hbm or 0), matched)
            memory = memory_wait_seconds(
                view, profile, new, request.block_size, output, taken, now=now
            )
            wait = max(queue, memory)
            load = load_seconds(view, profile, match, request.block_size)
            if load > 0 and view.async_loads:
                # Its own DRAM/SSD blocks come up after the loads before them, while it
                # queues, and it computes in the first step starting after they land.
                ready = wait + async_load_seconds(
                    profile, load, max(loads - wait, 0.0), view.queued_prefill_tokens, batch, kv
                )
            else:
                ready = wait + load
            prefill = prefill_seconds(profile, new, cached, batch, kv)
            ttft = ready + prefill
            # The compute it holds the worker for (and the load, where that stalls it).
            stall = 0.0 if view.async_loads else load
            work = stall + profile.prefill_seconds(new, cached)
            pull = 0.0
            if pulled:
                # The peer's longer prefix as one more source: its blocks cross the network
                # instead of being computed; they need HBM all the same (same memory wait).
                pooled_cached, pooled_new = split_prompt(
                    request.num_tokens, matched + pulled, request.block_size
                )
                # The peer reads what it keeps on DRAM or SSD as it streams: no faster
                # than its own loads would be (a peer outside these candidates, e.g. a
                # decode worker while prefill workers are chosen, read at this one's pace).
                peer = views.get(source, view)
                pull = peer_pull_seconds(
                    view, profile, peer, resolve_profile(peer, self.default_profile),
                    matches[source], pulled, request.block_size,
                )  # fmt: skip
                pooled_prefill = prefill_seconds(profile, pooled_new, pooled_cached, batch, kv)
                pooled = ready + pull + pooled_prefill
                if pooled < ttft:
                    sources[view.host] = source
                    cached, new, prefill, ttft = pooled_cached, pooled_new, pooled_prefill, pooled
                    work = stall + profile.prefill_seconds(new, cached)
                else:
                    pulled, pull = 0, 0.0
            # What it brings into HBM evicts live cached blocks once the spare room is
            # gone (its own matched blocks are not evicted: it uses them).
            displace = 0.0
            live = 0
            if self.live is not None:
                live = self.live.count(view.host, now, view.epoch)
                if self.homes is not None:
                    # Homes placed here and not yet returned to will be: their blocks
                    # are as live as those already reused (weighed by the probability).
                    live += round(self.homes.pending_blocks(view.host, now))
                added = -(-new // request.block_size) + pulled + min(lower, matched)
                displace = displacement_seconds(
                    view, profile, added, max(live - matched, 0), request.block_size, output
                )
            in_flight = view.in_flight + spec_requests
            scores[view.host] = {
                "wait_s": wait,
                "queue_s": queue,
                "memory_wait_s": memory,
                "load_s": load,
                "load_queue_s": loads,
                "pull_s": pull,
                "pulled_blocks": float(pulled),
                "prefill_s": prefill,
                "cached_tokens": float(cached),
                # Cached blocks its admission takes from the free pool (lower tiers, idle
                # HBM, pulled): the router counts them as queued until its first byte.
                "taken_blocks": float(taken + pulled),
                # Of those, the ones its admitting step brings up from DRAM and SSD (the
                # router counts them as the queue's loads until its first byte).
                "load_dram_blocks": float(match.on(Medium.DRAM) if match is not None else 0),
                "load_ssd_blocks": float(match.on(Medium.SSD) if match is not None else 0),
                "speculative_tokens": float(spec_tokens),
                "in_flight": float(in_flight),
                "ttft_s": ttft,
                "work_s": work,
                "live_blocks": float(live),
                "displace_s": displace,
            }
            blocks[view.host] = (matched, pulled, new)
        # The compute this request adds delays those routed behind it on this worker,
        # (routing rate x the time until this prefill ends) requests stretched by the busy
        # period: by the excess over the least work any worker would spend (at this
        # worker's pace), or by the whole work (capped by what moving would cost them) for
        # those bound here by the cache. An idle worker delays nobody.
        least_host = min(scores, key=lambda h: scores[h]["work_s"])
        least, least_profile = scores[least_host]["work_s"], profiles[least_host]
        least_pace = 0.0
        for host, s in scores.items():
            rate = self.routed.rate(host, now)
            affine = min(self.affine.rate(host, now), rate)
            work = s["work_s"]
            if self.excess_work:
                switching = self.switching.rate(host, now)
                floor = least
                if profiles[host] is not least_profile and profiles[host] != least_profile:
                    # A mixed fleet: the least work at this worker's pace.
                    least_pace = least_pace or least_profile.prefill_seconds(request.num_tokens)
                    if least_pace > 0:
                        floor *= profiles[host].prefill_seconds(request.num_tokens) / least_pace
                delayed = min(work * affine, switching) + max(work - floor, 0.0) * (rate - affine)
            else:
                delayed = work * rate
            # Requests whose pulled prefix lands here before this prefill ends queue behind
            # it (they are bound here by the pull): each waits the rest of this work.
            end = now + s["ttft_s"]
            landing = sum(min(work, end - t) for t in self._landing.get(host, ()) if t < end)
            # Requests loading their prefix beside the steps there are admitted already
            # but computed only once it lands: landing while this prefill runs, they wait
            # for its chunks (running requests are scheduled in order, and it came first);
            # landing before it starts, they go first.
            start = end - s["prefill_s"]
            landing += sum(
                min(work, end - t) for t in self._loaded.get(host, ()) if start < t < end
            )
            s["landing_s"] = landing
            s["externality_s"] = externality = (delayed * s["ttft_s"] + landing) * stretch
            s["total"] = total = (
                s["ttft_s"] + self.externality_weight * externality + s["displace_s"]
            )
            rank[host] = (total, int(s["in_flight"]), host)
        best = min(rank, key=rank.__getitem__)
        home: tuple[list[int], int | None] = ([], None)
        if self.homes is not None:
            best, home = self._home(request, scores, rank, best)
        if self.residency_tie_s > 0 and scores[best]["cached_tokens"] == 0:
            # The best candidate holds none of the prompt (usually: nobody does): among the
            # near-ties, the worker that took the fewest new blocks lately.
            bound = rank[best][0] + self.residency_tie_s
            near = [h for h in rank if rank[h][0] <= bound]
            best = min(near, key=lambda h: (self.grown.rate(h, now), rank[h]))
        matched, pulled, _ = blocks[best]
        decision = Decision(
            worker=best,
            policy=self.name,
            scores=scores,
            predicted_ttft_s=scores[best]["ttft_s"],
            matched_blocks=matched + pulled,
            kv_source=sources.get(best),
        )
        return _KvScored(decision, request, matches, views, blocks, home)

    def commit(self, scored: Scored, worker: str, ttft_s: float | None = None) -> None:
        """Record that the request of ``scored`` runs on ``worker``
        (:class:`~policies.base.PlacingPolicy`).

        On the policy's own choice this records what :meth:`choose` does. Elsewhere
        (session affinity, or the PD planner colocating on a decoder) it is credited
        with computing what it lacks, at ``ttft_s`` (else the score's TTFT there, else
        the choice's); a pull the plan orders there is not remembered as landing later
        (its blocks are speculated at once, as computed ones are).
        """
        assert isinstance(scored, _KvScored), "commit takes what this policy scored"
        request, keys, now = scored.request, scored.request.block_keys, scored.request.now
        scores = scored.decision.scores
        terms = scores.get(worker)
        if worker == scored.decision.worker:
            matched, pulled, new = scored.blocks[worker]
        else:
            if terms is not None:
                matched = scored.blocks[worker][0]
            else:
                match = self.speculation.merge(worker, keys, scored.matches.get(worker))
                matched = min(match.blocks, len(keys)) if match is not None else 0
            pulled, new = 0, split_prompt(request.num_tokens, matched, request.block_size)[1]
        if ttft_s is None:
            ttft_s = (terms or scores[scored.decision.worker])["ttft_s"]
        if self.homes is not None:
            returned, position = scored.home
            if position is not None:
                self.homes.place(worker, keys, position, now)
            self.homes.follow(returned, worker)
        if self.residency_tie_s > 0:
            self.grown.record(worker, now, float(new + pulled * request.block_size))
        if pulled:
            # The pulled blocks are not on ``worker`` until the pull lands: a request that
            # followed this one there before then would recompute them, so they are not
            # speculated; the next request sees the peer's copy and prices its own pull.
            self._landing.setdefault(worker, []).append(now + scores[worker]["pull_s"])
            self.speculation.record(worker, keys[:matched], new, now, ttft_s)
        else:
            self.speculation.record(worker, keys, new, now, ttft_s)
            if terms is not None and terms["load_s"] > 0 and scored.views[worker].async_loads:
                # Computable once its load lands: the step after (see async_load_seconds).
                self._loaded.setdefault(worker, []).append(
                    now + terms["ttft_s"] - terms["prefill_s"]
                )
        self.routed.record(worker, now)
        if terms is None:
            return  # not a candidate: nothing to weigh it against
        if self.live is not None:
            # Its matched prefix (pulled blocks included) is reused on ``worker``: live there.
            self.live.touch(worker, keys[: matched + pulled], now, scored.views[worker].epoch)
        # How much this request is bound to its worker: the share of its prompt only that
        # worker held, and the compute per second the choice saved against the next best.
        others = max((c["cached_tokens"] for h, c in scores.items() if h != worker), default=0.0)
        advantage = (terms["cached_tokens"] - others) / max(request.num_tokens, 1)
        self.affine.record(worker, now, min(max(advantage, 0.0), 1.0))
        mine = terms["work_s"]
        saved = min((c["work_s"] for h, c in scores.items() if h != worker), default=mine) - mine
        self.switching.record(worker, now, max(saved, 0.0))

    def _home(
        self,
        request: RouteRequest,
        scores: dict[str, dict[str, float]],
        rank: Mapping[str, tuple[float, int, str]],
        best: str,
    ) -> tuple[str, tuple[list[int], int | None]]:
        """The candidate a prompt nobody holds half of makes its home on; see the module
        docstring. Returns it with what :meth:`commit` records: the keys of the older
        homes the request returns to, and the block its own home starts at (None: it
        makes none)."""
        assert self.homes is not None
        keys = request.block_keys
        returned = self.homes.observe(keys, request.now)
        p = self.homes.return_probability(request.now)
        for host, s in scores.items():
            s["home_demand"] = self.homes.demand(host, request.now)
        held = max(s["cached_tokens"] for s in scores.values())
        if held * 2 < request.num_tokens and p > 0:
            # Within the prediction's own error of the best score, the candidates are
            # alike for this request; the home goes where fewer homes will come back. The
            # error is the wait's (a prompt nobody holds computes the same everywhere).
            slack = self.home_band * scores[best]["wait_s"] + self.home_band_s
            bound = rank[best][0] + p * slack
            near = [h for h in rank if rank[h][0] <= bound]
            best = min(near, key=lambda h: (scores[h]["home_demand"], rank[h]))
            return best, (returned, int(held) // request.block_size)
        return best, (returned, None)

    def _expire_landings(self, now: float) -> None:
        """Forget the pulls and loads that have landed by ``now``."""
        for landings in (self._landing, self._loaded):
            for host in list(landings):
                left = [t for t in landings[host] if t > now]
                if left:
                    landings[host] = left
                else:
                    del landings[host]

    @staticmethod
    def _holders(keys: Sequence[int], matches: Mapping[str, PrefixMatch]) -> list[tuple[str, int]]:
        """The two workers indexed as holding the longest prefixes of ``keys``, and their
        blocks, longest first (then by host name): each candidate's best peer is one of them.

        Blocks on every medium count: a peer serves its DRAM and SSD blocks too, and the
        pull is priced at the pace it reads them (``peer_read_seconds``).
        """
        held = []
        for peer, m in matches.items():
            n = min(m.blocks, len(keys))
            if n > 0:
                held.append((-n, peer))
        return [(peer, -negative) for negative, peer in heapq.nsmallest(2, held)]

    @staticmethod
    def _peer(host: str, holders: Sequence[tuple[str, int]]) -> tuple[str, int]:
        """The worker other than ``host`` holding the longest prefix, and its blocks."""
        return next(((peer, n) for peer, n in holders if peer != host), ("", 0))
