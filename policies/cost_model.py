"""Time estimates the TTFT-predicting policies share: queue, prefill, KV loads.

Every estimate goes through :class:`indexer.profile.TimingProfile`, the same
model the ``sim`` runner uses to time its steps, so the router predicts with
the arithmetic the simulator executes.

Chunking follows vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``):
each step first gives one token of the step budget
(``max_num_batched_tokens``) to every running decode, then fills the rest with
prefill chunks. A worker with ``b`` running sequences therefore prefills at
most ``budget - b`` tokens per step, and every one of those steps also pays the
decode batch's cost (``d1*b + d2*k`` in the profile's step model). That is the
"decode batch slows the queue" term: ignoring it makes a worker with a big
decode batch look as fast as an idle one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from indexer.media import Medium
from indexer.profile import DEFAULT_TRANSFER_BANDWIDTH, TimingProfile
from indexer.views import PrefixMatch, WorkerView

__all__ = [
    "DEFAULT_TRANSFER_BANDWIDTH",
    "blocks_load_seconds",
    "decode_batch",
    "displacement_seconds",
    "hbm_room_blocks",
    "load_seconds",
    "memory_wait_seconds",
    "peer_pull_seconds",
    "peer_read_seconds",
    "prefill_context",
    "prefill_seconds",
    "pull_seconds",
    "queue_seconds",
    "queued_load_seconds",
    "reload_seconds",
    "resolve_profile",
    "split_prompt",
    "step_in_progress",
    "step_residual_seconds",
]


def resolve_profile(view: WorkerView, fallback: TimingProfile | None) -> TimingProfile:
    """The worker's own profile, else ``fallback``.

    Raises:
        ValueError: Neither exists, so no time can be predicted for this worker.
    """
    profile = view.profile if view.profile is not None else fallback
    if profile is None:
        raise ValueError(
            f"worker {view.host!r} publishes no timing profile and the policy has no "
            "default_profile to predict with"
        )
    return profile


def split_prompt(num_tokens: int, matched_blocks: int, block_size: int) -> tuple[int, int]:
    """(cached, new) tokens of a prompt whose first ``matched_blocks`` blocks are cached.

    Like vLLM, a fully cached prompt still computes its last token (the engine
    needs its logits), so ``new >= 1`` for any non-empty prompt.

    Raises:
        ValueError: For a non-positive block size or negative counts.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0 or matched_blocks < 0:
        raise ValueError("num_tokens and matched_blocks must be >= 0")
    if num_tokens == 0:
        return 0, 0
    cached = min(matched_blocks * block_size, num_tokens - 1)
    return cached, num_tokens - cached


def _chunk(profile: TimingProfile, decode_batch: int) -> int:
    return max(profile.max_num_batched_tokens - decode_batch, 1)


def decode_batch(view: WorkerView, mean_context: int) -> tuple[int, int]:
    """(sequences, KV tokens) of the worker's running batch, what each of its steps reads.

    The worker's published ``running_kv_tokens`` when it has any; otherwise (a view
    that does not publish it) ``mean_context`` tokens per running request.
    """
    if view.running_kv_tokens > 0 or view.running == 0:
        return view.running, view.running_kv_tokens
    return view.running, view.running * mean_context


def prefill_context(num_tokens: int, new_tokens: int) -> int:
    """The attention work of prefilling the last ``new_tokens`` of ``num_tokens``.

    ``new * (cached + new / 2)``: what a worker's ``queued_prefill_context`` sums over
    its queue (:func:`queue_seconds`).
    """
    new = max(min(new_tokens, num_tokens), 0)
    return new * (num_tokens - new) + new * new // 2


def step_in_progress(view: WorkerView, now: float) -> tuple[float, int, int] | None:
    """The step ``view``'s worker has in progress at ``now``: (seconds left, the prefill
    tokens it computes, their attention work), or None when that is not known.

    None also when the view says the step has ended by ``now`` (a heartbeat older than
    its step): what that step computed is gone from the worker's queue, or still in the
    router's own count until its first byte, and the next step's start is not known.
    """
    if view.step_ends_ts <= now:
        return None
    return view.step_ends_ts - now, view.step_prefill_tokens, view.step_prefill_context


def queue_seconds(
    profile: TimingProfile,
    queued_tokens: int,
    decode_batch: int = 0,
    decode_kv_tokens: int = 0,
    queued_context: int = 0,
    step: tuple[float, int, int] | None = None,
) -> float:
    """Time to drain ``queued_tokens`` of prefill ahead of a new request.

    The queue is costed in full chunks of the step budget, each step also paying the
    decode batch. ``queued_context`` (the view's ``queued_prefill_context``: over the
    queued requests, ``new * (cached + new / 2)``) adds the attention the queued tokens
    pay to the context before their own chunk, the term that makes a queued 100K-token
    prompt cost several times its linear part; without it (0) every chunk is costed as
    fresh tokens. With nothing queued, a worker only decoding still makes the request
    wait out the decode step in progress (:func:`step_residual_seconds`).

    With ``step`` (:func:`step_in_progress`) the step in progress is known: the request
    waits out what is left of it, whatever it computes, and the queued tokens it does
    not compute are chunked after it. Without it, a step that has run most of a long
    chunk would be counted whole: a request whose prefix sits on a worker just ending
    a 100 ms prefill is priced 100 ms of wait, and recomputes its prefix elsewhere.
    """
    if step is not None:
        left, tokens, context = step
        rest = queued_tokens - tokens
        if rest <= 0:
            return left
        return left + queue_seconds(
            profile, rest, decode_batch, decode_kv_tokens, max(queued_context - context, 0)
        )
    if queued_tokens <= 0:
        return step_residual_seconds(profile, queued_tokens, decode_batch, decode_kv_tokens)
    chunk = _chunk(profile, decode_batch)
    full, rest = divmod(queued_tokens, chunk)
    total = full * profile.step_seconds([(chunk, 0)], decode_batch, decode_kv_tokens)
    if rest:
        total += profile.step_seconds([(rest, 0)], decode_batch, decode_kv_tokens)
    # new * (cached + new/2) summed over chunks is sum(n*c) + sum(n^2)/2: the chunks'
    # own n^2 share is already in step_seconds, the rest is the cross-chunk attention.
    within = (full * chunk * chunk + rest * rest) / 2
    if queued_context > within:
        total += profile.prefill[3] * (queued_context - within)
    return total


def hbm_room_blocks(view: WorkerView, block_size: int, mean_output_tokens: float) -> float | None:
    """HBM blocks a new request can have on ``view`` without displacing admitted work.

    HBM less the blocks running requests hold (``kv_active_blocks``), the queued
    prefill's blocks, the cached prefix blocks the queued requests take on admission
    (``queued_taken_blocks``: brought up from DRAM or SSD, or out of the free queue;
    first come first served, a new request waits for them) and the output still to
    come of every admitted or queued request (half the mean output each). Requests in
    flight beyond the view's running and waiting ones (routed since its heartbeat,
    known from the router's own count) count a whole mean output: the view holds
    neither what they have generated so far nor what is still to come. Cached free
    blocks count as room: allocations evict them.
    Negative when the admitted work alone overflows HBM; None when the view does not
    publish its active blocks.
    """
    capacity = view.kv_capacity_blocks.get(Medium.HBM, 0)
    active = view.kv_active_blocks
    if capacity <= 0 or (active <= 0 and view.running > 0):
        return None
    queued = -(-view.queued_prefill_tokens // block_size) + view.queued_taken_blocks
    admitted = view.running + view.waiting
    unseen = max(view.in_flight - admitted, 0)
    growth = (admitted + 2 * unseen) * mean_output_tokens / 2 / block_size
    return capacity - active - queued - growth


def memory_wait_seconds(
    view: WorkerView,
    profile: TimingProfile,
    new_tokens: int,
    block_size: int,
    mean_output_tokens: float,
    loaded_blocks: int = 0,
    now: float | None = None,
) -> float:
    """Time a new request with ``new_tokens`` to prefill loses to the worker's full HBM.

    vLLM-style schedulers admit a request once its first chunk fits and preempt the
    newest running request (by recompute) when a later chunk or a decode step finds HBM
    full. Demand is the blocks running requests hold (``kv_active_blocks``), the queued
    prefill's blocks, the output still to come of every admitted or queued request (half
    the mean output each) and the new request's own blocks: those it computes and the
    ``loaded_blocks`` of its prefix it takes from elsewhere (brought up from DRAM or
    SSD, or cached free HBM blocks it removes from the free queue), which need HBM
    room just the same. When that exceeds HBM the new request, the newest, computes what fits, is
    preempted, waits until enough running requests finish, and starts over: the wait is
    ``k`` completions plus the wasted partial prefill. Where the view says when its
    running requests should finish and what each frees (``kv_release``), the
    completions are theirs (:func:`release_seconds`, counted from ``now`` when given);
    otherwise running requests finish one every ``mean output x decode step / running``
    seconds, freeing ``held / running`` blocks each. Returns 0.0 when the view does not
    publish its active blocks.
    """
    free = hbm_room_blocks(view, block_size, mean_output_tokens)
    if free is None:
        return 0.0
    excess = -(-new_tokens // block_size) + loaded_blocks - free
    if excess <= 0:
        return 0.0
    wasted = profile.prefill_seconds(min(new_tokens, max(int(free), 0) * block_size))
    floor = 0.0
    if view.kv_release:
        elapsed = max(now - view.ts, 0.0) if now is not None and view.ts > 0 else 0.0
        floor, freed = release_seconds(view, profile, excess, elapsed)
        if freed >= excess:
            return floor + wasted
    capacity = view.kv_capacity_blocks.get(Medium.HBM, 0)
    active = view.kv_active_blocks
    queued = -(-view.queued_prefill_tokens // block_size)
    running = max(view.running, 1)
    # An idle worker frees nothing by waiting: what is short of room there is the
    # request itself (a prompt or max_tokens beyond its HBM); counted as one block held,
    # the wait is long and finite, never a division by zero.
    held = max(active, min(capacity, active + queued), 1)
    turnover = mean_output_tokens * profile.decode_seconds(running, view.running_kv_tokens)
    completions = math.ceil(excess * running / held)
    # Beyond what the running requests free, the queued ones must run and finish too.
    return max(completions * turnover / running, floor) + wasted


def release_seconds(
    view: WorkerView, profile: TimingProfile, blocks: float, elapsed: float = 0.0
) -> tuple[float, int]:
    """How long after ``elapsed`` seconds past the view the running requests of ``view``
    have freed ``blocks`` HBM blocks, by its ``kv_release``, and the blocks freed by then.

    Each finishes after the prefill chunks up to the end of its own prompt and its
    expected output tokens, one step each; the steps carry the running prefill's chunks
    first, then only decode. When they free fewer than ``blocks`` in all: when the last
    finishes, and what they free.
    """
    batch, kv = view.running, view.running_kv_tokens
    chunk = _chunk(profile, batch)
    prefill = max(ahead for ahead, _, _ in view.kv_release)
    prefill_steps = -(-prefill // chunk)
    per_prefill_step = 0.0
    if prefill_steps:
        per_prefill_step = queue_seconds(profile, prefill, batch, kv) / prefill_steps
    per_decode_step = profile.decode_seconds(batch, kv)
    finishing = []
    for ahead, left, freed in view.kv_release:
        steps = -(-ahead // chunk) + left
        seconds = min(steps, prefill_steps) * per_prefill_step
        seconds += max(steps - prefill_steps, 0) * per_decode_step
        finishing.append((seconds, freed))
    finishing.sort()
    total, when = 0, 0.0
    for seconds, freed in finishing:
        total, when = total + freed, seconds
        if total >= blocks:
            break
    return max(when - elapsed, 0.0), total


def step_residual_seconds(
    profile: TimingProfile, queued_tokens: int, decode_batch: int, decode_kv_tokens: int
) -> float:
    """Expected wait for the decode step a worker is running to end, before a new
    request's first chunk can join the next one.

    A worker only decoding (no prefill queued) is mid-step when a request arrives:
    on average half a decode step remains (steps of near-constant length). With prefill
    queued, the step in progress is one of the queue's chunks, which
    :func:`queue_seconds` counts whole; an idle worker starts at once.
    """
    if queued_tokens > 0 or decode_batch <= 0:
        return 0.0
    return profile.decode_seconds(decode_batch, decode_kv_tokens) / 2


def prefill_seconds(
    profile: TimingProfile,
    new_tokens: int,
    cached_tokens: int,
    decode_batch: int = 0,
    decode_kv_tokens: int = 0,
) -> float:
    """Time to prefill ``new_tokens`` after ``cached_tokens`` beside a decode batch.

    With no decode batch this is exactly ``profile.prefill_seconds``.
    """
    chunk = _chunk(profile, decode_batch)
    total = 0.0
    done = 0
    while done < new_tokens:
        n = min(chunk, new_tokens - done)
        total += profile.step_seconds([(n, cached_tokens + done)], decode_batch, decode_kv_tokens)
        done += n
    return total


def decode_stall_seconds(
    profile: TimingProfile,
    new_tokens: int,
    cached_tokens: int,
    decode_batch: int,
    decode_kv_tokens: int,
) -> float:
    """What prefilling ``new_tokens`` after ``cached_tokens`` adds to each sequence
    decoding beside it.

    The steps that carry the prompt's chunks, less the decode steps they stand in for:
    each of them would have run anyway, paying the step overhead and the decode batch,
    so a short remainder costs its own tokens only, not a whole prefill step. 0 with
    no decode batch.
    """
    if decode_batch <= 0 or new_tokens <= 0:
        return 0.0
    batch, kv = decode_batch, decode_kv_tokens
    steps = -(-new_tokens // _chunk(profile, batch))
    alone = steps * profile.decode_seconds(batch, kv)
    return prefill_seconds(profile, new_tokens, cached_tokens, batch, kv) - alone


def pull_seconds(
    view: WorkerView, profile: TimingProfile, tokens: int, read_seconds: float = 0.0
) -> float:
    """Time for ``view``'s worker to pull ``tokens`` tokens of KV from a peer.

    At the worker's measured transfer bandwidth, else :data:`DEFAULT_TRANSFER_BANDWIDTH`;
    the peer streams the blocks as it reads them, so a pull takes no less than the
    ``read_seconds`` the peer spends reading them off its DRAM and SSD
    (:func:`peer_read_seconds`).
    """
    if tokens <= 0:
        return 0.0
    bandwidth = view.transfer_bandwidth or DEFAULT_TRANSFER_BANDWIDTH
    return max(tokens * profile.kv_bytes_per_token / bandwidth, read_seconds)


def peer_read_seconds(
    view: WorkerView, profile: TimingProfile, match: PrefixMatch, blocks: int, block_size: int
) -> float:
    """Time for the peer ``view`` to read the last ``blocks`` blocks of its cached prefix
    ``match`` off DRAM and SSD for a pull, at its load bandwidths.

    The match counts its blocks per medium, not where they sit; a worker evicts a
    prefix from its tail (vLLM's free-block order), so the blocks it still holds in HBM
    are the first ones and a pull, which takes the tail, is charged the lower tiers
    first: SSD, then DRAM.
    """
    ssd = min(match.on(Medium.SSD), blocks)
    dram = min(match.on(Medium.DRAM), blocks - ssd)
    return blocks_load_seconds(view, profile, {Medium.SSD: ssd, Medium.DRAM: dram}, block_size)


def peer_pull_seconds(
    view: WorkerView,
    profile: TimingProfile,
    peer: WorkerView,
    peer_profile: TimingProfile,
    peer_match: PrefixMatch,
    blocks: int,
    block_size: int,
) -> float:
    """Time for ``view``'s worker to pull the last ``blocks`` blocks of the prefix
    ``peer`` holds (``peer_match``): :func:`pull_seconds`, no faster than the peer reads
    them (:func:`peer_read_seconds`)."""
    read = peer_read_seconds(peer, peer_profile, peer_match, blocks, block_size)
    return pull_seconds(view, profile, blocks * block_size, read)


def load_seconds(
    view: WorkerView, profile: TimingProfile, match: PrefixMatch | None, block_size: int
) -> float:
    """Time to bring the matched blocks held on DRAM and SSD into HBM.

    Uses the worker's measured bandwidth per medium, else its profile's; a
    medium with neither costs nothing (as ``TimingProfile.load_seconds`` does).
    """
    if match is None:
        return 0.0
    return blocks_load_seconds(
        view, profile, {m: match.on(m) for m in (Medium.DRAM, Medium.SSD)}, block_size
    )


def queued_load_seconds(view: WorkerView, profile: TimingProfile) -> float:
    """Time the worker spends bringing its queue's cached DRAM and SSD blocks into HBM.

    The step that admits a request loads its lower-tier prefix before computing it
    (the view's ``queued_load_blocks``), so a new request queued behind waits for the
    loads as well as for the queued prefill: a queued 20K-token prefix on DRAM delays
    the next request by its transfer even though it computes nothing.
    """
    if not view.queued_load_blocks:
        return 0.0
    return blocks_load_seconds(view, profile, view.queued_load_blocks, view.block_size)


def async_load_seconds(
    profile: TimingProfile,
    load: float,
    after: float,
    queued_tokens: int,
    decode_batch: int,
    decode_kv_tokens: int,
) -> float:
    """From a request's admission to the first step that can compute it, when its
    DRAM/SSD blocks load beside the steps (``WorkerView.async_loads``).

    The scheduler admits it at a step boundary and starts its load, ``after`` seconds
    behind the loads queued before it; the step planned at that boundary runs without
    it, and so does every step that starts before the load lands (vLLM likewise takes a
    request whose KV is still arriving into the first schedule after it landed). On a
    worker only decoding, steps are decode steps: the load is rounded up to whole steps,
    at least one. With prefill queued, it is admitted while the queue ahead drains and
    the rounding is lost in the queue's own wait (which the caller takes the larger
    of); on an idle worker the load lands and a step starts at once.
    """
    if queued_tokens > 0 or decode_batch <= 0:
        return after + load
    step = profile.decode_seconds(decode_batch, decode_kv_tokens)
    if step <= 0:
        return after + load
    return step * math.ceil((after + load) / step)


def blocks_load_seconds(
    view: WorkerView, profile: TimingProfile, blocks: Mapping[Medium, int], block_size: int
) -> float:
    """Time to bring ``blocks`` (per medium) into HBM at the worker's bandwidths."""
    total = 0.0
    for medium, n in blocks.items():
        bandwidth = view.bandwidth(medium) or profile.load_bandwidth.get(medium)
        if n > 0 and bandwidth:
            total += n * block_size * profile.kv_bytes_per_token / bandwidth
    return total


def displacement_seconds(
    view: WorkerView,
    profile: TimingProfile,
    added_blocks: int,
    live_blocks: int,
    block_size: int,
    mean_output_tokens: float,
) -> float:
    """Reload time of the live cached blocks that ``added_blocks`` new HBM blocks evict.

    A request brings blocks into the worker's HBM (those it computes, pulls from a peer
    or loads from DRAM and SSD). They take the room admitted work leaves
    (``hbm_room_blocks``, where cached free blocks count as room); the live cached
    blocks (``live_blocks``: other requests will come back for them,
    ``policies.live_cache``) fill that room first, so whatever the request adds beyond
    the rest evicts live blocks, at most all of them, and each costs the request that
    comes back for it a reload (``reload_seconds``). 0.0 when nothing live is evicted,
    or when the view does not publish its active blocks.
    """
    if added_blocks <= 0 or live_blocks <= 0:
        return 0.0
    room = hbm_room_blocks(view, block_size, mean_output_tokens)
    if room is None:
        return 0.0
    spare = max(room - live_blocks, 0.0)
    evicted = min(max(added_blocks - spare, 0.0), live_blocks)
    return reload_seconds(view, profile, math.ceil(evicted), block_size)


def reload_seconds(view: WorkerView, profile: TimingProfile, blocks: int, block_size: int) -> float:
    """What bringing back ``blocks`` evicted from the worker's HBM costs a later request.

    The block pool demotes an evicted HBM block to the next slower tier the worker has
    (``engine_worker.block_pool``): a DRAM load then, else an SSD load; on a worker with
    HBM only (vLLM and SGLang without offloading) the blocks are gone and the request
    recomputes them: their prefill's compute, without the step overhead it pays anyway.
    A view that publishes no tier capacities is taken to have DRAM.
    """
    if blocks <= 0:
        return 0.0
    capacity = view.kv_capacity_blocks
    for medium in (Medium.DRAM, Medium.SSD):
        if not capacity or capacity.get(medium, 0) > 0:
            return blocks_load_seconds(view, profile, {medium: blocks}, block_size)
    tokens = blocks * block_size
    chunks = -(-tokens // profile.max_num_batched_tokens)
    return max(profile.prefill_seconds(tokens) - profile.prefill[0] * chunks, 0.0)
