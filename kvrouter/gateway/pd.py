"""Prefill/decode disaggregation in the gateway: pools by role, and whether to split at all.

Workers advertise a role (``prefill``, ``decode`` or ``both``). The routing
policy already chose the prefill side (its views hold every worker but
decode-only ones). :class:`PdPlanner` then picks the decode worker and decides:

* ``never``: colocated, as without roles (decode-only workers take nothing);
* ``always``: prefill on the policy's choice, decode on the decode worker,
  whenever both pools have a worker;
* ``auto``: compare the two plans on predicted time, from the same cost model
  ``kv_ttft`` uses (``policies.cost_model``). Colocated on the decode worker
  costs its own TTFT (its queue, then prefilling what it lacks beside its
  running batch) *plus* what that prefill does to the requests decoding there:
  every running sequence waits out what the prefill's chunks add to the steps
  that carry them, ``running x added`` (:func:`~policies.cost_model.decode_stall_seconds`:
  a step runs for the decodes anyway, so a short remainder adds its tokens only).
  When the policy's choice decodes too (role ``both``), colocating there is a
  third option, costed the same way. Disaggregated costs the prefill worker's
  predicted TTFT plus moving the uncached part of the prompt's KV to the
  decoder at its measured transfer bandwidth (else
  :data:`DEFAULT_TRANSFER_BANDWIDTH`), plus the stall on the prefill worker's
  own decodes (none on a prefill-only worker); it does not stall the decoder.
  The cheapest wins.

The decode worker is the decode-capable worker (role ``decode`` or ``both``,
not the prefill worker itself) with the fewest requests in flight (heartbeat
and this gateway's own count, the larger), ties broken by the longer cached
prefix, then the name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, Role, WorkerView
from policies.cost_model import (
    DEFAULT_TRANSFER_BANDWIDTH,
    decode_batch,
    decode_stall_seconds,
    hbm_room_blocks,
    peer_pull_seconds,
    prefill_seconds,
    pull_seconds,
    queue_seconds,
    resolve_profile,
    split_prompt,
    step_in_progress,
)

__all__ = ["DEFAULT_TRANSFER_BANDWIDTH", "PdMode", "PdPlan", "PdPlanner"]

PdMode = Literal["never", "always", "auto"]


@dataclass(frozen=True, slots=True)
class PdPlan:
    """Where one request's prefill and decode run, and why.

    Attributes:
        disaggregate: Prefill on ``prefill``, decode on ``decode``; else colocated.
        prefill: The prefill worker (the policy's choice).
        decode: The decode worker (None when there is none).
        reason: ``never``, ``always``, ``no_decode_worker``, ``cheaper_local`` or
            ``cheaper_split``.
        predicted: The figures compared (seconds), for the decision header.
        matched_blocks: Colocated: the prompt's blocks ``prefill`` has cached or pulls
            (what it does not prefill).
        kv_source: Colocated: the peer ``prefill`` pulls those blocks from (None: it
            computes what it lacks).
    """

    disaggregate: bool
    prefill: str
    decode: str | None
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)
    matched_blocks: int = 0
    kv_source: str | None = None

    def header(self) -> dict[str, object]:
        """The ``pd`` part of the decision header."""
        return {
            "mode": "disaggregated" if self.disaggregate else "colocated",
            "prefill": self.prefill,
            "decode": self.decode,
            "reason": self.reason,
            "predicted_s": self.predicted,
            "kv_source": self.kv_source,
        }


class PdPlanner:
    """Chooses the decode worker and whether to disaggregate (see the module docstring).

    The views it gets have the router's own counts laid over them already
    (:func:`kvrouter.router_core.overlay`, called once by the router core).
    """

    def __init__(
        self,
        mode: PdMode,
        default_profile: TimingProfile | None = None,
        mean_decode_context: int = 2048,
        *,
        pooling: bool = False,
        mean_output_tokens: int = 256,
    ) -> None:
        self.mode = mode
        self.default_profile = default_profile
        self.mean_decode_context = mean_decode_context
        self.pooling = pooling
        self.mean_output_tokens = mean_output_tokens

    def decoder(
        self, workers: Sequence[WorkerView], prefill: str, matches: Mapping[str, PrefixMatch]
    ) -> WorkerView | None:
        """The decode worker for a request prefilled on ``prefill`` (None if there is none)."""
        pool = [v for v in workers if v.role in (Role.DECODE, Role.BOTH) and v.host != prefill]
        if not pool:
            return None

        def rank(v: WorkerView) -> tuple[int, int, str]:
            matched = matches[v.host].blocks if v.host in matches else 0
            return (v.in_flight, -matched, v.host)

        return min(pool, key=rank)

    def plan(
        self,
        workers: Sequence[WorkerView],
        prefill: str,
        prefill_ttft_s: float | None,
        num_tokens: int,
        block_size: int,
        matches: Mapping[str, PrefixMatch],
        now: float = 0.0,
    ) -> PdPlan:
        """Decide one request's plan; ``prefill_ttft_s`` is the policy's prediction there,
        ``now`` the routing clock (a view's step in progress is waited out from it)."""
        if self.mode == "never":
            return PdPlan(False, prefill, None, "never")
        decode = self.decoder(workers, prefill, matches)
        if decode is None:
            return PdPlan(False, prefill, None, "no_decode_worker")
        if self.mode == "always":
            return PdPlan(True, prefill, decode.host, "always")
        # Colocated options: the whole request on the decode worker, or on the policy's
        # choice when that one decodes too (role both).
        options: dict[str, _Local] = {}
        predicted: dict[str, float] = {}
        by_host = {v.host: v for v in workers}
        for label, view in (("decode", decode), ("prefill", by_host.get(prefill))):
            if view is None or (view.role is not Role.BOTH and label == "prefill"):
                continue
            local = options[view.host] = self._local(
                view, num_tokens, block_size, matches, by_host, now
            )
            predicted[f"{label}_local_ttft"] = local.ttft
            predicted[f"{label}_local_decode_stall"] = local.stall
            if local.source is not None:
                predicted[f"{label}_local_pull"] = local.pull
        profile = resolve_profile(decode, self.default_profile)
        cached = self._cached(decode, num_tokens, block_size, matches)
        transfer = pull_seconds(decode, profile, max(num_tokens - cached, 0))
        # The prefill worker stalls its own decodes too (none on a prefill-only worker),
        # computing what it lacks: a prefill-only request pulls nothing from a peer.
        prefill_view = by_host.get(prefill)
        stall = (
            self._local(
                prefill_view, num_tokens, block_size, matches, by_host, now, pool=False
            ).stall
            if prefill_view
            else 0.0
        )
        split = (prefill_ttft_s or 0.0) + transfer + stall
        predicted["split_prefill_ttft"] = prefill_ttft_s or 0.0
        predicted["split_transfer"] = transfer
        predicted["split_decode_stall"] = stall
        # A tie keeps the policy's choice: a decode-only worker takes prefill work only
        # where that is cheaper.
        host = min(options, key=lambda h: (options[h].cost, h != prefill))
        if split < options[host].cost:
            return PdPlan(True, prefill, decode.host, "cheaper_split", predicted)
        best = options[host]
        return PdPlan(
            False, host, None, "cheaper_local", predicted, best.matched, best.source
        )  # fmt: skip

    def _cached(
        self, view: WorkerView, num_tokens: int, block_size: int, matches: Mapping[str, PrefixMatch]
    ) -> int:
        matched = self._matched(view.host, num_tokens, block_size, matches)
        return split_prompt(num_tokens, matched, block_size)[0]

    @staticmethod
    def _matched(
        host: str, num_tokens: int, block_size: int, matches: Mapping[str, PrefixMatch]
    ) -> int:
        match = matches.get(host)
        return min(match.blocks, -(-num_tokens // block_size)) if match is not None else 0

    def _local(
        self,
        view: WorkerView,
        num_tokens: int,
        block_size: int,
        matches: Mapping[str, PrefixMatch],
        by_host: Mapping[str, WorkerView],
        now: float,
        *,
        pool: bool = True,
    ) -> _Local:
        """The request colocated on ``view``: its TTFT, the stall its prefill imposes on
        the running decodes, and the pull from a peer where pooling (and ``pool``) makes
        it cheaper."""
        profile = resolve_profile(view, self.default_profile)
        matched = self._matched(view.host, num_tokens, block_size, matches)
        batch, kv = decode_batch(view, self.mean_decode_context)
        queued = view.queued_prefill_tokens
        wait = queue_seconds(
            profile, queued, batch, kv, view.queued_prefill_context, step_in_progress(view, now)
        )

        def option(blocks: int, pull: float, source: str | None) -> _Local:
            cached, new = split_prompt(num_tokens, blocks, block_size)
            ttft = wait + pull + prefill_seconds(profile, new, cached, batch, kv)
            stall = batch * decode_stall_seconds(profile, new, cached, batch, kv)
            return _Local(ttft, stall, blocks, source, pull)

        best = option(matched, 0.0, None)
        if self.pooling and pool:
            peer, held = self._holder(view.host, num_tokens, block_size, matches, by_host)
            output = view.mean_output_tokens or self.mean_output_tokens
            room = hbm_room_blocks(view, block_size, output)
            pulled = held - matched if room is None else min(held - matched, max(int(room), 0))
            if peer is not None and pulled > 0:
                source = by_host[peer]
                pull = peer_pull_seconds(
                    view, profile, source, resolve_profile(source, self.default_profile),
                    matches[peer], pulled, block_size,
                )  # fmt: skip
                pooled = option(matched + pulled, pull, peer)
                if pooled.cost < best.cost:
                    best = pooled
        return best

    def _holder(
        self,
        host: str,
        num_tokens: int,
        block_size: int,
        matches: Mapping[str, PrefixMatch],
        by_host: Mapping[str, WorkerView],
    ) -> tuple[str | None, int]:
        """The routable worker other than ``host`` holding the longest prefix (then by
        name), and its blocks."""
        held = [
            (-self._matched(h, num_tokens, block_size, matches), h)
            for h in matches
            if h != host and h in by_host
        ]
        if not held:
            return None, 0
        blocks, peer = min(held)
        return peer, -blocks


@dataclass(frozen=True, slots=True)
class _Local:
    """A colocated option: TTFT, the stall on its running decodes, the prompt's blocks
    it has or pulls, and the peer it pulls from (None: none) at ``pull`` seconds."""

    ttft: float
    stall: float
    matched: int
    source: str | None
    pull: float

    @property
    def cost(self) -> float:
        return self.ttft + self.stall
