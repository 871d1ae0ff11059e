"""Media order, the timing model's arithmetic, and prefix-match bookkeeping."""

from __future__ import annotations

import msgspec
import pytest

from indexer.media import MEDIA, Medium
from indexer.profile import TimingProfile
from indexer.views import PrefixMatch, WorkerView
from indexer.wire import decode_view, encode_view


def test_media_are_ordered_fastest_first_and_demote_downwards() -> None:
    assert [m.rank for m in MEDIA] == [0, 1, 2]
    assert Medium.HBM.slower() is Medium.DRAM
    assert Medium.DRAM.slower() is Medium.SSD
    assert Medium.SSD.slower() is None
    assert Medium.from_rank(2) is Medium.SSD
    with pytest.raises(ValueError, match="rank"):
        Medium.from_rank(3)


@pytest.mark.parametrize(
    ("name", "medium"),
    [("GPU", Medium.HBM), ("cpu", Medium.DRAM), ("DISK", Medium.SSD), (None, Medium.HBM)],
)
def test_vllm_media_names(name: str | None, medium: Medium) -> None:
    assert Medium.from_vllm(name) is medium


def test_unknown_vllm_medium_is_refused() -> None:
    with pytest.raises(ValueError, match="TAPE"):
        Medium.from_vllm("TAPE")


PROFILE = TimingProfile(
    name="t",
    prefill=(0.01, 1e-4, 1e-8, 2e-8),
    decode=(0.005, 1e-4, 1e-7),
    kv_bytes_per_token=1000,
    load_bandwidth={Medium.DRAM: 1e9, Medium.SSD: 1e8},
    max_num_batched_tokens=1000,
)


def test_prefill_is_chunked_and_attends_to_earlier_chunks() -> None:
    one = PROFILE.prefill_seconds(1000, 0)
    assert one == pytest.approx(0.01 + 0.1 + 1e-8 * 1e6)
    two = PROFILE.prefill_seconds(2000, 0)
    second = 0.01 + 0.1 + 1e-8 * 1e6 + 2e-8 * 1000 * 1000
    assert two == pytest.approx(one + second)
    assert PROFILE.prefill_seconds(1000, 1000) == pytest.approx(second)
    assert PROFILE.prefill_seconds(0, 5000) == 0.0


def test_cached_tokens_make_prefill_cheaper_than_recompute() -> None:
    assert PROFILE.prefill_seconds(100, 1900) < PROFILE.prefill_seconds(2000, 0)


def test_step_shares_one_overhead_between_prefill_and_decode() -> None:
    mixed = PROFILE.step_seconds([(100, 0)], decode_batch=4, decode_kv_tokens=1000)
    assert mixed == pytest.approx(0.01 + 1e-2 + 1e-4 + 4e-4 + 1e-4)
    assert PROFILE.step_seconds([], 0, 0) == 0.0
    assert PROFILE.step_seconds([], 2, 10) == pytest.approx(PROFILE.decode_seconds(2, 10))


def test_load_time_is_bytes_over_bandwidth_and_free_from_hbm() -> None:
    assert PROFILE.load_seconds(1000, Medium.DRAM) == pytest.approx(1e-3)
    assert PROFILE.load_seconds(1000, Medium.SSD) == pytest.approx(1e-2)
    assert PROFILE.load_seconds(1000, Medium.HBM) == 0.0


def test_a_slowed_profile_takes_every_duration_that_many_times_longer() -> None:
    slow = PROFILE.slowed(7.0)
    assert slow.prefill_seconds(3000, 500) == pytest.approx(7 * PROFILE.prefill_seconds(3000, 500))
    mixed = PROFILE.step_seconds([(100, 50)], decode_batch=4, decode_kv_tokens=1000)
    assert slow.step_seconds([(100, 50)], 4, 1000) == pytest.approx(7 * mixed)
    assert slow.load_seconds(1000, Medium.SSD) == pytest.approx(7 * 1e-2)
    assert slow.kv_bytes_per_token == PROFILE.kv_bytes_per_token
    assert PROFILE.slowed(1.0) is PROFILE
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match="factor"):
            PROFILE.slowed(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill": (-1.0, 0.0, 0.0, 0.0)},
        {"decode": (float("nan"), 0.0, 0.0)},
        {"kv_bytes_per_token": 0},
        {"load_bandwidth": {Medium.DRAM: 0.0}},
    ],
)
def test_invalid_profiles_are_refused(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "name": "x",
        "prefill": (0.0,) * 4,
        "decode": (0.0,) * 3,
        "kv_bytes_per_token": 1,
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match="profile"):
        TimingProfile(**base)  # type: ignore[arg-type]


def test_prefix_match_counts_media() -> None:
    m = PrefixMatch.from_media("w", [Medium.HBM, Medium.HBM, Medium.SSD])
    assert m.blocks == 3
    assert (m.on(Medium.HBM), m.on(Medium.DRAM), m.on(Medium.SSD)) == (2, 0, 1)


def test_worker_view_usage_and_bandwidth_fallback() -> None:
    v = WorkerView(
        host="w",
        model="m",
        block_size=16,
        kv_capacity_blocks={Medium.HBM: 10},
        kv_used_blocks={Medium.HBM: 4},
        profile=PROFILE,
    )
    assert v.kv_usage() == pytest.approx(0.4)
    assert v.kv_usage(Medium.SSD) == 0.0
    assert v.bandwidth(Medium.DRAM) == 1e9
    v.load_bandwidth[Medium.DRAM] = 5e9
    assert v.bandwidth(Medium.DRAM) == 5e9


def test_worker_view_memory_fields_survive_the_heartbeat_and_old_payloads_still_decode() -> None:
    v = WorkerView(
        host="w",
        model="m",
        block_size=16,
        running=3,
        queued_prefill_tokens=900,
        queued_prefill_context=450_000,
        queued_taken_blocks=272,
        running_kv_tokens=12_000,
        kv_active_blocks=800,
        mean_output_tokens=212.5,
        kv_capacity_blocks={Medium.HBM: 1000},
        transfer_bandwidth=2.5e9,
        async_loads=True,
        kv_release=[(0, 40, 120), (2_048, 200, 300)],
    )
    assert decode_view(encode_view(v)) == v
    # A heartbeat from a worker that predates these fields: they read as "not published".
    old = msgspec.msgpack.encode({"host": "w", "model": "m", "block_size": 16, "running": 2})
    back = decode_view(old)
    assert back.running == 2
    assert (back.queued_prefill_context, back.running_kv_tokens, back.kv_active_blocks) == (0, 0, 0)
    assert back.mean_output_tokens == 0.0
    assert back.transfer_bandwidth == 0.0
    assert back.queued_taken_blocks == 0
    assert back.async_loads is False  # its loads stall the step that admits them
    assert back.kv_release == []
