"""Worker views, prompts and requests for the policy tests.

Views carry the packaged Llama-3-8B/H100 profile, so the numbers the policies
weigh are the ones a real deployment would produce.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine_worker.profiles import default_profile
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from policies.base import RouteRequest

MODEL = "llama3-8b"
BLOCK = 16
PROFILE = default_profile()
ROOT = root_parent(MODEL)


def view(
    host: str,
    *,
    running: int = 0,
    waiting: int = 0,
    in_flight: int = 0,
    queued: int = 0,
    queued_context: int = 0,
    running_kv: int = 0,
    active: int = 0,
    mean_output: float = 0.0,
    hbm_used: int = 0,
    hbm_capacity: int = 10_000,
    dram_capacity: int = 0,
    ssd_capacity: int = 0,
    ts: float = 0.0,
    bandwidth: dict[Medium, float] | None = None,
    profile: TimingProfile | None = PROFILE,
) -> WorkerView:
    """A worker view with the given load; HBM capacity 10,000 blocks by default, and
    DRAM and SSD tiers only when given a capacity (as the vLLM adapter publishes them).

    ``queued_context``, ``running_kv``, ``active`` and ``mean_output`` are the view's
    ``queued_prefill_context``, ``running_kv_tokens``, ``kv_active_blocks`` and
    ``mean_output_tokens`` (0: not published, as from an older worker).
    """
    sizes = ((Medium.HBM, hbm_capacity), (Medium.DRAM, dram_capacity), (Medium.SSD, ssd_capacity))
    tiers = {m: n for m, n in sizes if n}
    return WorkerView(
        host=host,
        url=f"http://{host}:8000",
        model=MODEL,
        block_size=BLOCK,
        running=running,
        waiting=waiting,
        in_flight=in_flight,
        queued_prefill_tokens=queued,
        queued_prefill_context=queued_context,
        running_kv_tokens=running_kv,
        kv_active_blocks=active,
        mean_output_tokens=mean_output,
        kv_capacity_blocks=tiers,
        kv_used_blocks={Medium.HBM: hbm_used},
        load_bandwidth=dict(bandwidth or {}),
        profile=profile,
        ts=ts,
    )


def tokens(n: int, seed: int) -> list[int]:
    """``n`` pseudo-random token ids (vocabulary of Llama 3), reproducible by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(128_000) for _ in range(n)]


def request(
    prompt: Sequence[int], *, now: float = 0.0, rid: str = "r", max_tokens: int = 0
) -> RouteRequest:
    """The routing request for ``prompt``, with its real block keys."""
    return RouteRequest(
        request_id=rid,
        model=MODEL,
        num_tokens=len(prompt),
        block_keys=tuple(block_keys(prompt, BLOCK, ROOT)),
        block_size=BLOCK,
        now=now,
        max_tokens=max_tokens,
    )


def match(host: str, hbm: int = 0, dram: int = 0, ssd: int = 0) -> PrefixMatch:
    """An index answer: ``host`` holds a prefix of hbm + dram + ssd blocks."""
    return PrefixMatch(host, hbm + dram + ssd, (hbm, dram, ssd))


def chunked_seconds(profile: TimingProfile, tokens: int, cached: int = 0) -> float:
    """Prefill time of ``tokens`` fresh tokens after ``cached``, chunked at the budget,
    written out from the profile's coefficients (no decode batch)."""
    p0, p1, p2, p3 = profile.prefill
    total, done = 0.0, 0
    while done < tokens:
        n = min(profile.max_num_batched_tokens, tokens - done)
        total += p0 + p1 * n + p2 * n * n + p3 * n * (cached + done)
        done += n
    return total


def queue_wait(profile: TimingProfile, queued: int) -> float:
    """Draining ``queued`` tokens of other requests: chunks at the budget, no context."""
    p0, p1, p2, _ = profile.prefill
    total, left = 0.0, queued
    while left > 0:
        n = min(profile.max_num_batched_tokens, left)
        total += p0 + p1 * n + p2 * n * n
        left -= n
    return total
