"""mooncake_conductor: queue + prefill (+ transfer from the best holder), balancing threshold."""

from __future__ import annotations

import msgspec
import pytest

from indexer.media import Medium
from policies.base import NoWorkerError
from policies.mooncake_conductor import MooncakeConductorPolicy
from tests.policies.support import (
    BLOCK,
    PROFILE,
    chunked_seconds,
    match,
    queue_wait,
    request,
    tokens,
    view,
)

KV = PROFILE.kv_bytes_per_token
NET = 25e9
PROMPT = tokens(4096, seed=1)  # 256 blocks
WORKERS = [view("holder", queued=30_000), view("partial"), view("cold")]
MATCHES = {"holder": match("holder", hbm=256), "partial": match("partial", hbm=64)}


def transfer(blocks: int) -> float:
    return blocks * BLOCK * KV / NET


def test_pulls_the_hot_prefix_to_an_idle_instance_past_the_threshold() -> None:
    last = chunked_seconds(PROFILE, 1, cached=4095)
    expected = {
        "holder": queue_wait(PROFILE, 30_000) + last,
        "partial": transfer(256 - 64) + last,  # 256 / 64 = 4 >= 2: pull the difference
        "cold": transfer(256) + last,
    }

    decision = MooncakeConductorPolicy().choose(request(PROMPT), WORKERS, MATCHES)

    assert decision.worker == min(expected, key=expected.__getitem__) == "partial"
    assert decision.kv_source == "holder"
    # The blocks it will hold once the pull lands: the run a router asks it to pull.
    assert decision.matched_blocks == 256
    assert {h: decision.scores[h]["total"] for h in expected} == pytest.approx(expected)
    assert decision.predicted_ttft_s == pytest.approx(expected["partial"])


def test_below_the_threshold_an_instance_keeps_its_own_shorter_prefix() -> None:
    last = chunked_seconds(PROFILE, 1, cached=4095)
    expected = {
        "holder": queue_wait(PROFILE, 30_000) + last,
        "partial": chunked_seconds(PROFILE, 4096 - 1024, cached=1024),  # 4 < 8: no pull
        "cold": transfer(256) + last,  # no prefix at all: always worth pulling
    }

    decision = MooncakeConductorPolicy(balancing_threshold=8.0).choose(
        request(PROMPT), WORKERS, MATCHES
    )

    assert decision.scores["partial"]["pull"] == 0.0
    assert {h: decision.scores[h]["total"] for h in expected} == pytest.approx(expected)
    assert decision.worker == min(expected, key=expected.__getitem__) == "cold"
    assert decision.kv_source == "holder"


def test_a_local_hit_needs_no_source() -> None:
    decision = MooncakeConductorPolicy().choose(
        request(PROMPT), [view("holder"), view("cold")], {"holder": match("holder", hbm=256)}
    )

    assert decision.worker == "holder"
    assert decision.kv_source is None


@pytest.mark.parametrize("extra_tokens", [16, 14_336])
def test_layerwise_prefill_overlaps_loading_own_blocks_with_compute(extra_tokens: int) -> None:
    cached = 2048
    prompt = tokens(cached + extra_tokens, seed=2)
    load = (cached // BLOCK) * BLOCK * KV / PROFILE.load_bandwidth[Medium.SSD]
    compute = chunked_seconds(PROFILE, extra_tokens, cached=cached)

    decision = MooncakeConductorPolicy().choose(
        request(prompt), [view("w")], {"w": match("w", ssd=cached // BLOCK)}
    )

    assert decision.scores["w"]["prefill_s"] == pytest.approx(max(load, compute))
    # The short tail is bound by the load, the long one by compute.
    assert (load > compute) == (extra_tokens == 16)


def test_bad_options_and_no_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="balancing_threshold"):
        MooncakeConductorPolicy(balancing_threshold=0.5)
    with pytest.raises(NoWorkerError):
        MooncakeConductorPolicy().choose(request(PROMPT), [], {})


def test_pulls_are_priced_at_the_bandwidth_the_instances_publish() -> None:
    # Mooncake's conductor estimates a transfer on its own network. It was priced at a
    # fixed 25 GB/s: on a 1.25 GB/s fleet (a slowed live bench) every pull looked 20x
    # cheaper than it was, and the policy pulled on nearly every request.
    slow = 1.25e9
    workers = [
        msgspec.structs.replace(w, transfer_bandwidth=slow)
        for w in (view("holder", queued=2_000), view("partial"), view("cold"))
    ]
    last = chunked_seconds(PROFILE, 1, cached=4095)
    expected = {
        "holder": queue_wait(PROFILE, 2_000) + last,
        "partial": (256 - 64) * BLOCK * KV / slow + last,
        "cold": 256 * BLOCK * KV / slow + last,
    }

    decision = MooncakeConductorPolicy().choose(request(PROMPT), workers, MATCHES)

    assert {h: decision.scores[h]["total"] for h in expected} == pytest.approx(expected)
    assert decision.worker == min(expected, key=expected.__getitem__) == "holder"
    assert decision.kv_source is None
    # At the 25 GB/s it assumed before, the same fleet pulled to an idle instance.
    fixed = MooncakeConductorPolicy(transfer_bandwidth=25e9).choose(
        request(PROMPT), workers, MATCHES
    )
    assert fixed.worker == "partial"
    assert fixed.kv_source == "holder"
