"""The router's pure core, shared by the gateway and the offline simulator.

One decision, from what a router knows at that instant::

    views (heartbeats)  + the router's own load counts -> overlay (the larger of each term)
    overlay - decode-only workers (while others exist)  -> candidates
    policy.choose(request, candidates, matches)          -> Decision
    session affinity (the session's last worker, if the scores allow) -> worker
    PD planner (decode worker, split or not)             -> plan

No I/O and no clock of its own: the gateway calls :meth:`RouterCore.decide`
between its index lookup and its dispatcher's ticket, with nothing suspending
in between; the simulator calls it at each arrival with its virtual clock. So
the simulator cannot drift from the gateway: it runs the same code on the
same kind of inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from indexer.keys import chained_prefix
from indexer.media import Medium
from indexer.views import PrefixMatch, Role, WorkerView
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.load import Load
from kvrouter.gateway.pd import PdPlan, PdPlanner
from policies.base import Decision, NoWorkerError, PlacingPolicy, Policy, RouteRequest

__all__ = [
    "CoreDecision",
    "HeldOf",
    "LoadOf",
    "RouterCore",
    "annotate_idle",
    "candidates",
    "overlay",
    "prefill_tokens",
    "route_request",
]

#: The router's own count of what it sent to a worker and not yet finished (or prefilled).
LoadOf = Callable[[str], Load]
#: The router's count for a worker when the heartbeat it is handed was taken
#: (None: not known for that heartbeat).
SeenOf = Callable[[WorkerView], Load | None]
#: The block keys running requests hold on a worker (None: none): the router's own
#: running requests (``kvrouter.gateway.load.HeldBlocks``), or with exact views the
#: worker's own pool.
HeldOf = Callable[[str], Container[int] | None]


#: The view's figures the router's own counts are laid over: (view field, ``Load`` field).
_LAID = (
    ("in_flight", "in_flight"),
    ("queued_prefill_tokens", "queued_tokens"),
    ("kv_active_blocks", "held_blocks"),
    ("queued_prefill_context", "queued_context"),
    ("queued_taken_blocks", "queued_taken"),
    ("running", "running"),
)
#: The per-medium figures laid over a view's ``queued_load_blocks``: (medium, ``Load`` field).
_LAID_LOADS = ((Medium.DRAM, "queued_dram"), (Medium.SSD, "queued_ssd"))


def overlay(
    views: Sequence[WorkerView], load_of: LoadOf | None, seen_of: SeenOf | None = None
) -> list[WorkerView]:
    """``views`` with the router's own counts laid over them (None: the views are exact).

    Heartbeats lag by up to one interval; the router's counts of what it routed are
    current, so a burst routed since the last heartbeat is seen at once: its
    requests in flight, the prompt tokens still to prefill, the HBM blocks that
    the prompts already prefilled hold (``kv_active_blocks``, which a heartbeat taken
    before they arrived shows empty) and the requests decoding (``running``: the batch
    every prefill chunk shares a step with; ``running_kv_tokens`` scaled with it, as a
    mean per request).

    Where ``seen_of`` gives the router's counts as they were when a worker's
    heartbeat was taken, each term is the router's count now plus what the
    heartbeat showed beyond the router's count then (load the router did not send,
    such as another router's, or a decode's growing KV): a request that got its
    first token or finished since the heartbeat leaves the figures at once instead
    of a whole interval later. Without it each term is the larger of the two.
    """
    if load_of is None:
        return list(views)
    out = []
    for v in views:
        now = load_of(v.host)
        then = seen_of(v) if seen_of is not None else None
        if then is None and now.empty():
            out.append(v)
            continue
        laid: dict[str, object] = {
            shown_as: _lay(getattr(v, shown_as), now, then, counted_as)
            for shown_as, counted_as in _LAID
        }
        running = laid["running"]
        assert isinstance(running, int)
        if running != v.running and v.running > 0:
            laid["running_kv_tokens"] = v.running_kv_tokens * running // v.running
        loads = {
            medium: n
            for medium, counted_as in _LAID_LOADS
            if (n := _lay(v.queued_load_blocks.get(medium, 0), now, then, counted_as))
        }
        if loads or v.queued_load_blocks:
            laid["queued_load_blocks"] = loads
        out.append(replace(v, **laid))
    return out


def _lay(shown: int, now: Load, then: Load | None, counted_as: str) -> int:
    """One figure of a view with the router's count laid over it (see :func:`overlay`)."""
    counted: int = getattr(now, counted_as)
    if then is None:
        return max(shown, counted)
    return counted + max(shown - int(getattr(then, counted_as)), 0)


def annotate_idle(
    matches: Mapping[str, PrefixMatch], keys: Sequence[int], held_of: HeldOf
) -> dict[str, PrefixMatch]:
    """``matches`` with ``idle_hbm`` set: matched HBM blocks none of the router's running
    requests holds.

    Blocks a running request references are in HBM, so every matched block that is not
    held and not on DRAM or SSD is a cached free HBM block: the worker takes it out of
    its free queue to admit the request, as it allocates a new one. Keys are chained (a
    request holding a block holds every block before it), so the held part of a prefix
    is itself a prefix, found by bisection: a few lookups per host at any length.
    """
    out = {}
    for host, m in matches.items():
        hbm = m.on(Medium.HBM)
        if hbm > 0:
            held = held_of(host)
            n = min(m.blocks, len(keys))
            unheld = n - (_held_prefix(keys, n, held) if held is not None else 0)
            m = replace(m, idle_hbm=max(0, min(hbm, unheld - (m.blocks - hbm))))
        out[host] = m
    return out


def _held_prefix(keys: Sequence[int], n: int, held: Container[int]) -> int:
    """How many of the first ``n`` keys ``held`` holds, as a prefix."""
    return chained_prefix(n, lambda i: keys[i] in held)


def candidates(views: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers that may take a whole request: decode-only ones only when no other is left."""
    prefill_capable = [v for v in views if v.role is not Role.DECODE]
    return prefill_capable or list(views)


def route_request(
    request_id: str,
    model: str,
    num_tokens: int,
    keys: Sequence[int],
    block_size: int,
    now: float,
    max_tokens: int = 0,
    session_id: str | None = None,
) -> RouteRequest:
    """The policy's view of a request."""
    return RouteRequest(
        request_id=request_id,
        model=model,
        num_tokens=num_tokens,
        block_keys=tuple(keys),
        block_size=block_size,
        now=now,
        max_tokens=max_tokens,
        session_id=session_id,
    )


def prefill_tokens(
    decision: Decision, plan: PdPlan | None, num_tokens: int, block_size: int
) -> dict[str, int]:
    """Per worker the request may run on, the prompt tokens it would still prefill (the
    router counts them as queued there until its first token).

    The policy's choice: all but its matched blocks (a pull included); another scored
    candidate (a retry, or where affinity sends it): all but its cached tokens; the
    worker a colocated plan moved it to: all but what the plan says it has or pulls.
    """
    out = {
        host: max(num_tokens - int(terms.get("cached_tokens", 0)), 1)
        for host, terms in decision.scores.items()
    }
    out[decision.worker] = max(num_tokens - decision.matched_blocks * block_size, 1)
    if plan is not None and not plan.disaggregate and plan.prefill != decision.worker:
        planned = max(num_tokens - plan.matched_blocks * block_size, 1)
        out[plan.prefill] = min(out.get(plan.prefill, planned), planned)
    return out


@dataclass(frozen=True, slots=True)
class CoreDecision:
    """One request's routing decision.

    Attributes:
        decision: The policy's decision (scores of every candidate).
        worker: Where the request goes: the policy's choice, or the session's last
            worker when affinity holds (before any PD plan).
        plan: The prefill/decode plan (None without a planner or with ``pd never``).
        views: The overlaid views the decision was made on (decode-only ones included).
    """

    decision: Decision
    worker: str
    plan: PdPlan | None
    views: list[WorkerView]


class RouterCore:
    """Policy, fallback, session affinity and PD planning over overlaid views.

    Args:
        policy: The routing policy.
        fallback: The load-only policy used while the index cannot answer.
        affinity: Session hints (None: none).
        planner: The PD planner (None: colocated always). It gets overlaid views, so it
            needs no load tracker of its own.
    """

    def __init__(
        self,
        policy: Policy,
        fallback: Policy | None = None,
        affinity: SessionAffinity | None = None,
        planner: PdPlanner | None = None,
    ) -> None:
        self.policy = policy
        self.fallback = fallback or policy
        # Whether each splits choose into score and commit, decided once: a runtime
        # protocol check costs ~20 us, on every request.
        self._placing = {
            id(p): p if isinstance(p, PlacingPolicy) else None for p in (policy, self.fallback)
        }
        self.affinity = affinity
        self.planner = planner

    def decide(
        self,
        request: RouteRequest,
        views: Sequence[WorkerView],
        load_of: LoadOf | None,
        matches: Mapping[str, PrefixMatch] | None,
        *,
        cache_aware: bool = True,
        clock: float | None = None,
        held_of: HeldOf | None = None,
        seen_of: SeenOf | None = None,
    ) -> CoreDecision:
        """Decide where ``request`` goes.

        Args:
            request: The request's features (``session_id`` drives affinity).
            views: Routable workers' heartbeat views (decode-only included).
            load_of: The router's own counts per worker (None: the views are exact).
            matches: The index's answer (None: the index failed).
            cache_aware: False routes with the fallback policy (the index is down).
            clock: Affinity's clock (None: monotonic time).
            held_of: The keys the router's running requests hold per worker, to mark
                the matched HBM blocks no one holds (None: not known, as with exact
                views).
            seen_of: The router's counts per worker when its heartbeat was taken
                (:func:`overlay`; None: not known).

        Raises:
            NoWorkerError: No worker to choose from.
        """
        if not views:
            raise NoWorkerError(f"no worker serves {request.model!r}")
        laid = overlay(views, load_of, seen_of)
        if held_of is not None and matches:
            matches = annotate_idle(matches, request.block_keys, held_of)
        policy = self.policy if cache_aware else self.fallback
        placing = self._placing[id(policy)]
        scored = None
        if placing is not None:
            scored = placing.score(request, candidates(laid), matches or {})
            decision = scored.decision
        else:
            decision = policy.choose(request, candidates(laid), matches or {})
        worker = decision.worker
        if self.affinity is not None:
            worker = self.affinity.prefer(request.session_id, decision, clock)
        plan = None
        if self.planner is not None and self.planner.mode != "never":
            plan = self.planner.plan(
                laid, worker, decision.predicted_ttft_s, request.num_tokens,
                request.block_size, matches or {}, request.now,
            )  # fmt: skip
        if placing is not None:
            assert scored is not None
            # The policy remembers the worker that prefills: its choice, or where affinity
            # or the planner (colocating on the decoder) sent the request instead.
            prefill = plan.prefill if plan is not None else worker
            ttft = plan.predicted.get("decode_local_ttft") if plan and prefill != worker else None
            placing.commit(scored, prefill, ttft)
        return CoreDecision(decision, worker, plan, laid)

    def served(self, session_id: str | None, worker: str, clock: float | None = None) -> None:
        """Remember that ``worker`` served ``session_id`` (feeds affinity)."""
        if self.affinity is not None:
            self.affinity.record(session_id, worker, clock)
