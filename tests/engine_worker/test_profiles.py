"""The packaged default profile, and reading / writing profile files."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace

from engine_worker.profiles import (
    DEFAULT_PROFILE,
    ProfileError,
    default_profile,
    load_fleet,
    load_profile,
    packaged_profiles,
    save_profile,
)
from indexer.media import Medium


def test_default_profile_describes_llama3_8b_bf16_on_an_h100() -> None:
    profile = default_profile()

    assert profile.name == DEFAULT_PROFILE == "llama3_8b_h100"
    # 2 (k, v) x 32 layers x 8 KV heads x 128 dims x 2 bytes.
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert profile.max_num_batched_tokens == 8192
    for cited in ("BLIS", "arg_utils.py", "nvbandwidth", "NVMe", "FLOP"):
        assert cited in profile.source


def test_default_profile_predicts_what_an_h100_serving_llama3_8b_does() -> None:
    profile = default_profile()

    # A 1K-token prompt prefills in tens of milliseconds, a 32K one in seconds at most.
    assert 0.01 < profile.prefill_seconds(1024) < 0.1
    assert 0.3 < profile.prefill_seconds(32_768) < 3.0
    # Attention makes long prompts cost more than proportionally.
    assert profile.prefill_seconds(32_768) > 32 * profile.prefill_seconds(1024) * 0.9
    # One decode step of 64 sequences stays within an interactive inter-token latency.
    assert 0.005 < profile.decode_seconds(64, 64 * 2048) < 0.05


def test_the_a100_profile_serves_the_same_model_slower() -> None:
    h100, a100 = default_profile(), load_profile("llama3_8b_a100")

    assert a100.kv_bytes_per_token == h100.kv_bytes_per_token
    # vLLM's API-server default step budget on an A100.
    assert a100.max_num_batched_tokens == 2048
    for cited in ("BLIS", "A100-80", "arg_utils.py", "datasheet"):
        assert cited in a100.source
    # Against the H100: 2-4x the prefill time (their bf16 peaks are 989 and 312 TFLOP/s),
    # 1.5-3x the decode step (HBM 3.35 against 2.04 TB/s, and a longer step overhead).
    for tokens in (512, 4096, 32_768):
        assert 2.0 < a100.prefill_seconds(tokens) / h100.prefill_seconds(tokens) < 4.0
    assert 1.5 < a100.decode_seconds(64, 64 * 2048) / h100.decode_seconds(64, 64 * 2048) < 3.0
    assert a100.load_seconds(8192, Medium.DRAM) > h100.load_seconds(8192, Medium.DRAM)


def test_loading_a_cached_prefix_beats_recomputing_it_and_dram_beats_ssd() -> None:
    profile = default_profile()
    prefix = 8192

    recompute = profile.prefill_seconds(prefix)
    dram = profile.load_seconds(prefix, Medium.DRAM)
    ssd = profile.load_seconds(prefix, Medium.SSD)

    assert dram < ssd < recompute
    assert profile.load_seconds(prefix, Medium.HBM) == 0.0


def test_each_call_returns_an_independent_copy() -> None:
    first = default_profile()
    first.load_bandwidth[Medium.DRAM] = 1.0

    assert default_profile().load_bandwidth[Medium.DRAM] > 1e9


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = save_profile(default_profile(), tmp_path / "mine.json")

    assert load_profile(path) == default_profile()
    assert load_profile(str(path)) == default_profile()
    assert list(tmp_path.iterdir()) == [path]


def test_packaged_names_load_and_unknown_ones_are_listed() -> None:
    assert DEFAULT_PROFILE in packaged_profiles()
    assert load_profile(DEFAULT_PROFILE) == default_profile()
    with pytest.raises(ProfileError, match="llama3_8b_h100"):
        load_profile("gpt5_b300")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json", "not a valid timing profile"),
        (b'{"name": "x"}', "not a valid timing profile"),
        (
            b'{"name":"x","prefill":[-1,0,0,0],"decode":[0,0,0],"kv_bytes_per_token":1}',
            ">= 0",
        ),
    ],
)
def test_broken_files_are_refused(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)

    with pytest.raises(ProfileError, match=reason):
        load_profile(path)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.json")


def test_a_fleet_loads_from_names_and_serves_one_model(tmp_path: Path) -> None:
    h100, a100 = default_profile(), load_profile("llama3_8b_a100")
    assert load_fleet("llama3_8b_h100, llama3_8b_a100") == [h100, a100]
    assert load_fleet(["llama3_8b_a100"]) == [a100]
    other = save_profile(replace(h100, name="70b", kv_bytes_per_token=327_680), tmp_path / "o.json")
    with pytest.raises(ProfileError, match="a fleet serves one model"):
        load_fleet(["llama3_8b_h100", str(other)])
    with pytest.raises(ProfileError, match="no timing profile"):
        load_fleet(" , ")
    with pytest.raises(ProfileError, match="b300"):
        load_fleet("llama3_8b_h100,b300")
