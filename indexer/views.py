"""What the router knows of a worker, and what the index answers for a prompt.

Both are plain msgspec structs so that the same objects travel in
heartbeats (msgpack in Redis), feed the policies, and drive the simulator.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from indexer.media import MEDIA, Medium
from indexer.profile import TimingProfile

__all__ = ["PrefixMatch", "Role", "WorkerView"]


class Role(StrEnum):
    """What a worker does: prefill only, decode only, or both (the default)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class WorkerView(msgspec.Struct, kw_only=True):
    """A worker as a policy sees it.

    Workers publish it in their heartbeat; the gateway overlays its own
    accounting (``in_flight`` and ``queued_prefill_tokens`` of requests it
    has routed but the worker has not reported yet).

    Attributes:
        host: Stable worker name; the ``host`` of its events and index entries.
        url: Base URL of the worker's HTTP API.
        model: Served model name (also the root of its block keys).
        block_size: Tokens per KV block; must match the router's.
        role: prefill, decode or both.
        epoch: The worker's current epoch (random per start).
        events_seq: The ``seq`` of the last event batch the worker formed in this
            epoch, sent or lost (0: none, or not published). The ingester compares
            it with what the stream delivered to see a lost tail.
        running: Requests being computed (prefill or decode).
        waiting: Requests queued, not started.
        in_flight: Requests accepted and not finished (running + waiting + routed).
        queued_prefill_tokens: Prompt tokens still to prefill across its queue.
        queued_prefill_context: Attention work of that prefill: over the queued
            requests, ``new * (cached + new / 2)`` tokens (0 when not published).
        queued_taken_blocks: HBM blocks the queued requests need besides those they
            compute: their cached prefix blocks on DRAM or SSD (brought up) and in HBM
            with no running request holding them (taken out of the free queue). A
            queue whose head cannot have them holds up everything behind it
            (0 when not published).
        queued_load_blocks: Of those, the blocks on each lower medium (DRAM, SSD), plus
            those being brought up now. Without ``async_loads`` the step that admits a
            request pays for its load, so the queue drains that much later; with it,
            they are the loads a new request's own load queues behind (empty when not
            published).
        running_kv_tokens: Context tokens the running requests hold, what every
            decode step reads (0 when not published).
        kv_active_blocks: HBM blocks held by running requests, cached free blocks
            excluded: the KV memory a new request competes for (0 when not published).
        mean_output_tokens: Recent mean of generated tokens per request (0.0: unknown).
        kv_capacity_blocks: Blocks per medium.
        kv_used_blocks: Blocks holding data per medium (in use or cached).
        load_bandwidth: Measured bytes/s moving KV from each medium into HBM.
        transfer_bandwidth: Measured bytes/s of KV pulled from other workers (0.0: none yet).
        profile: The worker's timing model.
        marks_first_token: Asked to (``x-kvworker-mark-first-token``), the worker sends
            a non-streaming answer's first byte with its first token, so a router
            knows from the first contact that a failure before any byte generated
            nothing and may be retried (False: not known; a vLLM engine's view).
        async_loads: The worker brings a request's cached DRAM and SSD blocks into HBM
            beside its steps, one load after another (vLLM's offloading connector
            does): the request computes nothing until its blocks are up, and the
            others compute on meanwhile. A load then delays its own request, after
            the loads before it (``queued_load_blocks``), and no one else. False:
            the step that admits a request loads its blocks first, and every request
            in that step and queued behind it waits for them (not known, our torch
            runner, a vLLM engine without an offloading connector).
        step_ends_ts: When the step in progress is expected to end (the publisher's
            clock, as ``ts``; 0.0: no step in progress, or not published). A request
            routed here waits out the rest of it before its first chunk can run.
        step_prefill_tokens: Of ``queued_prefill_tokens``, those the step in progress
            computes (its prefill chunks): done when it ends, not a step later.
        step_prefill_context: Their share of ``queued_prefill_context``.
        kv_release: When each running request should finish, and the HBM blocks that
            frees for others, one ``(prefill, output, blocks)`` per running request:
            ``prefill`` tokens of the running requests' prompts computed before its own
            prompt is done (0: decoding), ``output`` tokens it is still expected to
            generate (one step each), and ``blocks`` it holds then that no other
            running request shares and no queued request waits to reuse. A request
            queued behind a full HBM waits for these (empty: not published).
        ts: When the view was taken (seconds, the publisher's clock).
    """

    host: str
    url: str = ""
    model: str
    block_size: int
    role: Role = Role.BOTH
    epoch: int = 0
    events_seq: int = 0
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_context: int = 0
    queued_taken_blocks: int = 0
    queued_load_blocks: dict[Medium, int] = msgspec.field(default_factory=dict)
    running_kv_tokens: int = 0
    kv_active_blocks: int = 0
    mean_output_tokens: float = 0.0
    kv_capacity_blocks: dict[Medium, int] = msgspec.field(default_factory=dict)
    kv_used_blocks: dict[Medium, int] = msgspec.field(default_factory=dict)
    load_bandwidth: dict[Medium, float] = msgspec.field(default_factory=dict)
    transfer_bandwidth: float = 0.0
    profile: TimingProfile | None = None
    marks_first_token: bool = False
    async_loads: bool = False
    step_ends_ts: float = 0.0
    step_prefill_tokens: int = 0
    step_prefill_context: int = 0
    kv_release: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    ts: float = 0.0

    def kv_usage(self, medium: Medium = Medium.HBM) -> float:
        """Fraction of ``medium`` holding data, 0.0 when the worker has none of it."""
        cap = self.kv_capacity_blocks.get(medium, 0)
        return self.kv_used_blocks.get(medium, 0) / cap if cap > 0 else 0.0

    def bandwidth(self, medium: Medium) -> float | None:
        """Measured load bandwidth of ``medium`` (bytes/s), else the profile's, else None."""
        bw = self.load_bandwidth.get(medium)
        if bw is None and self.profile is not None:
            bw = self.profile.load_bandwidth.get(medium)
        return bw


class PrefixMatch(msgspec.Struct, frozen=True):
    """How much of a prompt's key chain one host holds.

    ``blocks`` is the length of the longest matched prefix (in blocks);
    ``per_medium[r]`` counts those blocks on the medium of rank ``r``
    (hbm, dram, ssd), so ``sum(per_medium) == blocks``. ``idle_hbm`` is the
    router's annotation, not the index's: of the HBM blocks, those no running
    request it routed holds (cached free, so taking them uses HBM room);
    None when the router does not know.
    """

    host: str
    blocks: int
    per_medium: tuple[int, int, int] = (0, 0, 0)
    idle_hbm: int | None = None

    def on(self, medium: Medium) -> int:
        """Matched blocks on ``medium``."""
        return self.per_medium[medium.rank]

    @classmethod
    def from_media(cls, host: str, media: list[Medium]) -> PrefixMatch:
        """Build from the medium of each matched block, in prefix order."""
        counts = [0] * len(MEDIA)
        for m in media:
            counts[m.rank] += 1
        return cls(host, len(media), (counts[0], counts[1], counts[2]))
