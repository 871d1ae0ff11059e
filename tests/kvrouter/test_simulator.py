"""The offline simulator and the oracle bound, on small traces and small clusters."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from engine_worker.profiles import default_profile
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.profile import TimingProfile
from indexer.views import PrefixMatch
from kvrouter.bench.oracle import LruOracle, oracle_bound
from kvrouter.bench.report import summarize
from kvrouter.bench.simulator import (
    JITTER_S,
    SimConfig,
    SimResult,
    SimulationError,
    simulate,
    trace_oracle,
)
from kvrouter.bench.trace import PromptFactory, TraceRecord, write_trace
from kvrouter.bench.workloads import AgentWorkload, ChatWorkload, GroupsWorkload, generate
from kvrouter.cli import app
from policies.registry import make_policy, policy_names

SMALL = SimConfig(workers=3, hbm_blocks=400, dram_blocks=300, ssd_blocks=300, max_num_seqs=32)
CHAT = ChatWorkload(sessions=10, turns=3, system_tokens=512, session_rate=4.0, think_time_s=2.0)
GROUPS = GroupsWorkload(groups=4, users=3, system_tokens=1024, question_tokens=128, requests=40)
AGENT = AgentWorkload(
    agents=3, steps=4, system_tokens=512, context_min=1024, context_max=2048, output_tokens=16
)


def run(trace: list[TraceRecord], policy: str, config: SimConfig = SMALL) -> SimResult:
    return simulate(trace, make_policy(policy, seed=config.seed), config)


def hit_rate(result: SimResult) -> float:
    return summarize(result.policy, result.records, result.busy_s).hit_rate


# -- the oracle ---------------------------------------------------------------------------


def test_oracle_serves_a_repeated_prompt_except_its_last_block() -> None:
    keys = block_keys(list(range(64)), 16, 0)
    oracle = LruOracle(capacity_blocks=100, block_size=16)
    assert oracle.observe(64, keys) == 0
    assert oracle.observe(64, keys) == 48
    assert oracle.observe(70, [*keys, *block_keys([1] * 16, 16, keys[-1])][:4]) == 64
    assert oracle.bound().hit_rate == pytest.approx(112 / 198)


def test_oracle_capacity_bounds_what_it_remembers() -> None:
    prompts = [block_keys([p] * 64, 16, 0) for p in range(5)]
    seq = [(64, keys) for keys in prompts * 3]
    roomy = oracle_bound(seq, capacity_blocks=20, block_size=16)
    tight = oracle_bound(seq, capacity_blocks=8, block_size=16)
    assert roomy.hit_tokens == 10 * 48
    assert tight.hit_tokens < roomy.hit_tokens
    assert tight.unbounded_hit_tokens == roomy.unbounded_hit_tokens == roomy.hit_tokens


def test_oracle_evicts_a_prompts_tail_before_its_prefix() -> None:
    long = block_keys(list(range(160)), 16, 0)
    other = block_keys([7] * 32, 16, 0)
    oracle = LruOracle(capacity_blocks=10, block_size=16)
    oracle.observe(160, long)
    oracle.observe(32, other)
    assert oracle.observe(160, long) == 8 * 16


# -- simulator behaviour -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "seed"),
    [(CHAT, 1), (CHAT, 2), (GROUPS, 1), (GROUPS, 3), (AGENT, 1), (AGENT, 4)],
)
def test_kv_ttft_never_beats_the_oracle(workload: ChatWorkload, seed: int) -> None:
    trace = generate(workload, seed)
    config = SimConfig(
        workers=3, hbm_blocks=300, dram_blocks=100, ssd_blocks=100, max_num_seqs=32, seed=seed
    )
    result = run(trace, "kv_ttft", config)
    oracle = trace_oracle(trace, config)
    assert oracle.capacity_blocks == 3 * 500
    assert 0.0 < hit_rate(result) <= oracle.hit_rate <= oracle.unbounded_hit_rate


@pytest.mark.parametrize("policy", policy_names())
def test_a_replay_is_reproducible(policy: str) -> None:
    trace = generate(CHAT, seed=5)[:20]
    first, second = run(trace, policy), run(trace, policy)
    assert first.records == second.records
    assert first.busy_s == second.busy_s
    assert summarize(policy, first.records, first.busy_s) == summarize(
        policy, second.records, second.busy_s
    )


def test_a_perturbed_replay_moves_arrivals_by_under_a_millisecond_and_repeats() -> None:
    # jitter k replays the same requests, each arriving at most JITTER_S later; the same k
    # gives the same replay, another k another one, and k = 0 is the trace as it is.
    trace = generate(GROUPS, seed=4)
    plain = run(trace, "kv_ttft")
    nudged = [run(trace, "kv_ttft", dataclasses.replace(SMALL, jitter=k)) for k in (1, 1, 2)]
    assert nudged[0].records == nudged[1].records
    shifts = [
        [b.arrival_s - a.arrival_s for a, b in zip(plain.records, n.records, strict=True)]
        for n in nudged
    ]
    assert all(0.0 <= d < JITTER_S for row in shifts for d in row)
    assert shifts[0] != shifts[2]
    assert max(shifts[0]) > 0.0
    for n in nudged:
        assert all(r.finish_s is not None for r in n.records)
        assert set(n.in_use_blocks.values()) == {0}


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes() -> None:
    trace = generate(GROUPS, seed=2)
    roomy = SimConfig(workers=4, hbm_blocks=2000, dram_blocks=0, ssd_blocks=0)
    ours, rr = run(trace, "kv_ttft", roomy), run(trace, "round_robin", roomy)
    for result in (ours, rr):
        assert all(r.finish_s is not None for r in result.records)
        assert [r.output_tokens for r in result.records] == [t.output_length for t in trace]
        assert set(result.in_use_blocks.values()) == {0}
    assert hit_rate(ours) > hit_rate(rr)


def test_the_index_ends_up_holding_what_the_pools_hold() -> None:
    result = run(generate(CHAT, seed=1), "kv_ttft")
    assert result.index_entries == result.cached_blocks
    assert sum(result.cached_blocks.values()) > 0
    assert set(result.in_use_blocks.values()) == {0}


def test_one_request_on_an_idle_cluster_takes_the_profiles_step_times() -> None:
    profile = default_profile()
    config = SimConfig(workers=2, hbm_blocks=200, dram_blocks=0, ssd_blocks=0)
    trace = [TraceRecord(1000, 1000, 3, [1, 2])]
    (rec,) = run(trace, "round_robin", config).records
    prefill = profile.step_seconds([(1000, 0)], 0, 0)
    decode_1 = profile.step_seconds([], 1, 1001)
    decode_2 = profile.step_seconds([], 1, 1002)
    assert rec.arrival_s == 0.0
    assert rec.ttft_s == pytest.approx(prefill)
    assert rec.finish_s == pytest.approx(prefill + decode_1 + decode_2)
    assert rec.output_tokens == 3


@pytest.mark.parametrize("async_loads", [False, True])
def test_a_dram_load_stalls_a_running_decode_only_without_async_loads(async_loads: bool) -> None:
    # One worker whose DRAM is slow (100 MB/s): "x" is cached, pushed half out of HBM
    # by "y", and comes back while "d" decodes 200 tokens.
    profile = msgspec.structs.replace(default_profile(), load_bandwidth={Medium.DRAM: 1e8})
    config = SimConfig(
        profile=profile, workers=1, hbm_blocks=100, dram_blocks=1000, ssd_blocks=0,
        async_loads=async_loads,
    )  # fmt: skip
    trace = [
        TraceRecord(0, 1000, 1, [1, 2]),  # x
        TraceRecord(1000, 1000, 1, [3, 4]),  # y
        TraceRecord(2000, 16, 200, [5]),  # d
        TraceRecord(2100, 1020, 1, [1, 2]),  # x again: its tail is on DRAM
    ]
    policy = make_policy("round_robin", seed=0)
    choose = policy.choose
    seen: set[bool] = set()

    def spy(request: Any, views: Any, matches: Any) -> Any:
        seen.update(v.async_loads for v in views)
        return choose(request, views, matches)

    policy.choose = spy  # type: ignore[method-assign,assignment]
    result = simulate(trace, policy, config)
    assert seen == {async_loads}  # the workers' views say how they load
    _, _, d, again = result.records
    dram = again.cached_tokens[1]
    assert dram > 0
    load = profile.load_seconds(dram, Medium.DRAM)
    assert load > 0.2
    # The returning request waits for its load either way.
    assert again.ttft_s is not None
    assert again.ttft_s >= load
    # "d" takes the profile's decode steps (and a little more for the step it shares
    # with the 28 tokens "x" computes); without async loads, also the load of the step
    # that admits "x".
    assert d.first_token_s is not None
    assert d.finish_s is not None
    decoding = d.finish_s - d.first_token_s
    alone = sum(profile.step_seconds([], 1, 16 + i) for i in range(1, 200))
    stall = 0.0 if async_loads else load
    assert alone + stall < decoding < alone + stall + 0.05


def test_an_overloaded_replay_reports_its_workers_busy_while_requests_arrive() -> None:
    # 20 prompts of 4,000 tokens 10 ms apart overload two workers (each prefill takes
    # longer than the gaps), then the last one decodes 400 tokens alone while the other
    # worker idles: the drain dilutes the makespan's busy share, not the arrivals'.
    config = SimConfig(workers=2, hbm_blocks=2000, dram_blocks=0, ssd_blocks=0)
    trace = [
        TraceRecord(10 * i, 4000, 400 if i == 19 else 2, [1000 + 8 * i + j for j in range(8)])
        for i in range(20)
    ]
    result = run(trace, "round_robin", config)
    window = max(r.arrival_s for r in result.records)
    assert window == pytest.approx(0.19)
    for host, busy in result.busy_s.items():
        assert 0 < result.busy_arrivals_s[host] <= min(busy, window) + 1e-9
    # w1 takes its first request 10 ms in, and is busy from then on.
    assert result.busy_arrivals_s["w0"] == pytest.approx(window)
    assert result.busy_arrivals_s["w1"] == pytest.approx(window - 0.01)
    s = summarize(result.policy, result.records, result.busy_s, None, result.busy_arrivals_s)
    assert s.busy_share_arrivals == pytest.approx((2 * window - 0.01) / (2 * window))
    assert s.busy_share < 0.7
    # Without the arrivals' busy time (a live replay), the figure is absent, not zero.
    assert summarize(result.policy, result.records, result.busy_s).busy_share_arrivals is None


def slower(profile: TimingProfile, factor: float, name: str) -> TimingProfile:
    """``profile`` with every compute coefficient ``factor`` times larger (same model)."""
    return msgspec.structs.replace(
        profile,
        name=name,
        prefill=tuple(c * factor for c in profile.prefill),
        decode=tuple(c * factor for c in profile.decode),
    )


def test_a_mixed_fleet_runs_and_publishes_each_workers_own_profile() -> None:
    fast = default_profile()
    slow = slower(fast, 3.0, "slow")
    config = SimConfig(
        workers=4, hbm_blocks=200, dram_blocks=0, ssd_blocks=0, worker_profiles=(fast, slow)
    )
    # Round robin sends one prompt to each worker: w1 and w3 take three times as long.
    trace = [TraceRecord(i * 10_000, 1000, 2, [10 * i + 1, 10 * i + 2]) for i in range(4)]
    records = sorted(run(trace, "round_robin", config).records, key=lambda r: r.worker)
    assert [r.worker for r in records] == ["w0", "w1", "w2", "w3"]
    ttft = [r.ttft_s for r in records]
    assert ttft[0] == pytest.approx(fast.step_seconds([(1000, 0)], 0, 0))
    assert ttft[1] == pytest.approx(slow.step_seconds([(1000, 0)], 0, 0))
    assert ttft[1] == pytest.approx(3 * ttft[0])  # type: ignore[operator]
    assert ttft[2:] == pytest.approx(ttft[:2])
    # kv_ttft reads each view's profile: on an idle fleet a cold prompt goes to a fast one.
    swapped = dataclasses.replace(config, worker_profiles=(slow, fast))
    (rec,) = run(trace[:1], "kv_ttft", swapped).records
    assert rec.worker in ("w1", "w3")
    assert rec.ttft_s == pytest.approx(ttft[0])


def test_prefill_and_decode_workers_take_the_mixed_fleets_profiles_too() -> None:
    # As `kvrouter up --profile` hands them out: w*, then p*, then d*, in turn. A fast
    # prefill pool beside a slow decode pool (Splitwise's split) and the reverse.
    fast = default_profile()
    slow = slower(fast, 3.0, "slow")
    trace = [TraceRecord(5000.0 * i, 3000, 32, list(range(10 * i, 10 * i + 6))) for i in range(3)]
    pd = SimConfig(
        workers=0, prefill_workers=1, decode_workers=1, pd="always", hbm_blocks=2000,
        dram_blocks=0, ssd_blocks=0,
    )  # fmt: skip
    same = run(trace, "kv_ttft", pd).records
    fast_prefill = run(trace, "kv_ttft", dataclasses.replace(pd, worker_profiles=(fast, slow)))
    slow_prefill = run(trace, "kv_ttft", dataclasses.replace(pd, worker_profiles=(slow, fast)))
    for base, a, b in zip(same, fast_prefill.records, slow_prefill.records, strict=True):
        assert (a.prefill_worker, a.worker) == (b.prefill_worker, b.worker) == ("p0", "d0")
        assert a.tpot_s == pytest.approx(3 * base.tpot_s)  # type: ignore[operator]
        assert b.tpot_s == pytest.approx(base.tpot_s)
        assert b.ttft_s > a.ttft_s > base.ttft_s  # type: ignore[operator]


def test_a_mixed_fleet_serves_one_model() -> None:
    other = msgspec.structs.replace(default_profile(), name="70b", kv_bytes_per_token=327_680)
    with pytest.raises(ValueError, match="a mixed fleet serves one model"):
        SimConfig(worker_profiles=(default_profile(), other))


def test_sim_command_takes_a_mixed_fleet(tmp_path: Path) -> None:
    slow = slower(default_profile(), 2.0, "slow")
    (tmp_path / "slow.json").write_bytes(msgspec.json.encode(slow))
    trace_path = tmp_path / "g.jsonl"
    write_trace(trace_path, generate(GROUPS, seed=1))
    args = ["bench", "sim", "--trace", str(trace_path), "--workers", "2", "--hbm-blocks", "400"]
    args += ["--profile", f"llama3_8b_h100,{tmp_path / 'slow.json'}", "--policies", "kv_ttft"]
    args += ["--json", str(tmp_path / "r.json"), "--limit", "15"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["worker_profiles"] == ["llama3_8b_h100", "slow"]
    assert report["summaries"][0]["completed"] == 15


def test_a_repeated_prompt_hits_the_cache_on_the_same_worker() -> None:
    trace = [TraceRecord(0, 1100, 2, [1, 2, 3]), TraceRecord(5000, 1100, 2, [1, 2, 3])]
    config = SimConfig(workers=2, hbm_blocks=200, dram_blocks=0, ssd_blocks=0)
    first, second = run(trace, "kv_ttft", config).records
    assert first.cached_tokens == (0, 0, 0)
    assert second.worker == first.worker
    assert second.cached_tokens == (1088, 0, 0)
    assert second.ttft_s is not None
    assert first.ttft_s is not None
    assert second.ttft_s < first.ttft_s


def test_exact_views_mark_the_matched_hbm_blocks_no_request_holds_as_idle() -> None:
    # As the gateway marks them from its running requests' keys: "again" finds "first"'s
    # prompt cached in HBM with no request holding it (taking it leaves the free queue);
    # "third" arrives while "again" decodes and holds the same blocks (shared, nothing
    # taken).
    trace = [
        TraceRecord(0, 1024, 1, [1, 2]),  # first
        TraceRecord(1000, 1100, 400, [1, 2, 3]),  # again: decodes for a while
        TraceRecord(1200, 1100, 1, [1, 2, 4]),  # third: while "again" decodes
    ]
    config = SimConfig(workers=1, hbm_blocks=400, dram_blocks=0, ssd_blocks=0)
    policy = make_policy("round_robin", seed=0)
    choose = policy.choose
    seen: list[PrefixMatch | None] = []

    def spy(request: Any, views: Any, matches: Any) -> Any:
        seen.append(matches.get("w0"))
        return choose(request, views, matches)

    policy.choose = spy  # type: ignore[method-assign,assignment]
    _, again, third = simulate(trace, policy, config).records
    assert third.first_token_s is not None
    assert again.finish_s is not None
    assert again.first_token_s is not None
    assert again.first_token_s < third.arrival_s < again.finish_s
    assert seen[0] is None
    blocks = 1024 // config.block_size
    assert seen[1] == PrefixMatch("w0", blocks, (blocks, 0, 0), idle_hbm=blocks)
    assert seen[2] is not None
    assert seen[2].on(Medium.HBM) == blocks
    assert seen[2].idle_hbm == 0


def test_time_scale_compresses_arrivals() -> None:
    trace = generate(CHAT, seed=1)[:10]
    base = run(trace, "round_robin")
    fast = run(trace, "round_robin", dataclasses.replace(SMALL, time_scale=4.0))
    assert [r.arrival_s / 4 for r in base.records] == pytest.approx(
        [r.arrival_s for r in fast.records]
    )


def test_stale_views_are_overlaid_with_the_routers_own_accounting() -> None:
    trace = [TraceRecord(0, 600, 50, [i]) for i in range(8)]
    stale = SimConfig(
        workers=4, hbm_blocks=400, dram_blocks=0, ssd_blocks=0, view_interval_s=3600.0
    )
    records = run(trace, "least_load", stale).records
    per_worker = [sum(1 for r in records if r.worker == f"w{i}") for i in range(4)]
    assert per_worker == [2, 2, 2, 2]


def test_requests_that_cannot_fit_are_refused_before_the_replay() -> None:
    trace = [TraceRecord(0, 500, 10, [1]), TraceRecord(10, 3000, 10, [2])]
    with pytest.raises(SimulationError, match="request 1 needs 3010 tokens"):
        run(trace, "kv_ttft", dataclasses.replace(SMALL, max_model_len=2048))
    with pytest.raises(SimulationError, match="HBM holds"):
        run(trace, "kv_ttft", SimConfig(workers=1, hbm_blocks=100, dram_blocks=0, ssd_blocks=0))
    with pytest.raises(SimulationError, match="empty"):
        run([], "kv_ttft")


def test_default_hbm_is_an_h100_running_llama3_8b() -> None:
    profile = default_profile()
    cap = SimConfig().capacity()
    assert cap.hbm == int((80e9 * 0.9 - 16e9) // (profile.kv_bytes_per_token * 16))
    assert 26_000 < cap.hbm < 28_000
    assert cap.dram > 0
    assert cap.ssd > 0


def test_sim_command_writes_a_report_and_plots(tmp_path: Path) -> None:
    trace_path = tmp_path / "g.jsonl"
    write_trace(trace_path, generate(GROUPS, seed=1))
    args = ["bench", "sim", "--trace", str(trace_path), "--workers", "2", "--hbm-blocks", "400"]
    args += ["--dram-blocks", "100", "--ssd-blocks", "0", "--policies", "kv_ttft,round_robin"]
    args += ["--json", str(tmp_path / "r.json"), "--plots", str(tmp_path / "p"), "--limit", "15"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["policy"] for s in report["summaries"]] == ["kv_ttft", "round_robin"]
    assert all(s["completed"] == 15 for s in report["summaries"])
    assert report["config"]["capacity_blocks"] == {"hbm": 400, "dram": 100, "ssd": 0}
    for name in ("g_ttft_cdf.png", "g_hit_rate.png"):
        assert (tmp_path / "p" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(app, [*args[:4], "--policies", "nope"])
    assert bad.exit_code != 0
    assert "unknown policy 'nope'" in bad.output


def test_prompt_keys_route_and_cache_under_the_models_root() -> None:
    rec = TraceRecord(0, 100, 1, [3])
    factory = PromptFactory(16, root_parent(SMALL.model))
    assert factory.keys(rec) == block_keys(factory.tokens(rec), 16, root_parent("llama3-8b"))


@pytest.mark.parametrize(
    "options",
    [
        {"workers": 0},
        {"hbm_blocks": 0},
        {"dram_blocks": -1},
        {"max_num_seqs": 0},
        {"event_delay_s": -0.1},
        {"time_scale": 0.0},
        {"jitter": -1},
    ],
)
def test_a_bad_cluster_is_refused(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SimConfig(**options)  # type: ignore[arg-type]


def test_sim_command_reports_medians_over_arrival_perturbations(tmp_path: Path) -> None:
    # A percentile of one replay is one trajectory's luck: under several perturbations
    # the report holds each policy's medians and every replay's figures.
    trace_path = tmp_path / "g.jsonl"
    write_trace(trace_path, generate(GROUPS, seed=1))
    args = ["bench", "sim", "--trace", str(trace_path), "--workers", "2", "--hbm-blocks", "400"]
    args += ["--policies", "kv_ttft,round_robin", "--limit", "40", "--time-scale", "4"]
    result = CliRunner().invoke(app, [*args, "--jitter", "0-2", "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "median of 3 replays (jitter 0,1,2)" in result.output
    assert "jitter 2" in result.output  # the per-replay table
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["jitter"] == [0, 1, 2]
    assert [[s["policy"] for s in run] for run in report["runs"]] == [
        ["kv_ttft", "round_robin"]
    ] * 3
    # Each replay is its own trajectory (these 40 requests' p90 moves with the arrivals).
    assert len({run[0]["ttft_p90_s"] for run in report["runs"]}) > 1
    for i, summary in enumerate(report["summaries"]):
        for q in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"):
            assert summary[q] == statistics.median(run[i][q] for run in report["runs"])
    # One perturbation is one replay, as before: no runs in the report.
    single = CliRunner().invoke(app, [*args, "--jitter", "1", "--json", str(tmp_path / "s.json")])
    assert single.exit_code == 0, single.output
    one = json.loads((tmp_path / "s.json").read_text())
    assert one["runs"] == []
    assert one["config"]["jitter"] == 1
    assert one["summaries"] == report["runs"][1]
    bad = CliRunner().invoke(app, [*args, "--jitter", "2-1"])
    assert bad.exit_code != 0
    assert "runs backwards" in bad.output


def test_a_short_prompt_sent_to_a_decoding_worker_is_predicted_with_the_step_it_waits_out() -> None:
    # One worker decodes a long answer; short prompts arrive at arbitrary moments of its
    # steps. Each waits for the step in progress to end before its own chunk joins the
    # next one: on average half a decode step, which kv_ttft predicts. Without that term
    # the simulated TTFT ran ~1.5x the prediction here (1.2x over the suite's cells).
    rng = random.Random(5)
    trace = [TraceRecord(0.0, 512, 4000, [1])]
    trace += [
        TraceRecord(100.0 + 150.0 * i + rng.random() * 10.0, 64, 1, [100 + i]) for i in range(40)
    ]
    config = SimConfig(workers=1, hbm_blocks=2000, dram_blocks=0, ssd_blocks=0)
    records = run(trace, "kv_ttft", config).records[1:]
    ratios = [r.ttft_s / r.predicted_ttft_s for r in records if r.ttft_s and r.predicted_ttft_s]
    assert len(ratios) == 40
    assert 0.9 < statistics.median(ratios) < 1.1
