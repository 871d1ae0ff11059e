"""The policy suite: tune and report sets, loads, per-percentile comparison, prediction error."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvrouter.bench.suite import (
    ALL_TIERS,
    CASES,
    SETS,
    CellResult,
    _replay,
    parse_jitter,
    parse_tiers,
    prediction_error,
    run_suite,
    versus_best_peer,
)
from kvrouter.cli import app
from policies.registry import DEFAULT_POLICY, policy_names


def _refused(args: list[str], message: str) -> None:
    """The CLI refuses ``args`` with ``message`` in its output."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert message in result.output


def test_the_report_set_holds_other_seeds_and_workloads_never_tuned_on() -> None:
    tune, report = set(SETS["tune"]), set(SETS["report"])
    assert not tune & report
    tuned_cases = {case for case, _ in tune}
    held_out = {case for case, _ in report} - tuned_cases
    assert held_out >= {"longchat", "rag", "returning"}
    # Every production-shaped workload runs at three loads, one past the capacity.
    for case in ("conversation", "mixed", "longchat", "rag", "returning"):
        loads = [load for _, load in CASES[case].loads]
        assert len(loads) == 3
        assert loads == sorted(loads)
        assert loads[-1] > 1.0


def test_prediction_error_bins_by_prompt_length() -> None:
    samples = [(1_000, 0.1, 0.1), (1_500, 0.1, 0.3), (40_000, 2.0, 1.0), (200_000, 1.0, 1.0)]
    rows = prediction_error(samples, bins=(0, 2_048, 65_536, 1 << 30))
    assert [(r["lo"], r["n"]) for r in rows] == [(0.0, 2.0), (2_048.0, 1.0), (65_536.0, 1.0)]
    assert rows[0]["ratio_p50"] == pytest.approx(2.0)
    assert rows[1]["ratio_p50"] == pytest.approx(0.5)
    assert rows[1]["abs_error_p50_s"] == pytest.approx(1.0)


def test_a_quick_suite_compares_every_policy_at_each_load(tmp_path: Path) -> None:
    console = Console(width=200, record=True)
    cells = run_suite(
        tmp_path, console=console, quick=True, sets=["tune"], only=["conversation"], jobs=2,
        plots=False,
    )  # fmt: skip
    assert [c.load_label for c in cells] == [label for label, _ in CASES["conversation"].loads]
    assert all({s.policy for s in c.summaries} == set(policy_names()) for c in cells)
    # Higher load, busier workers (round robin does the same work at every load).
    busy = [c.summary("round_robin").busy_share for c in cells]
    assert busy == sorted(busy)
    # While requests arrive, the saturated cell keeps its workers busier than its
    # makespan share says (that counts the drain), and busier than a lighter load.
    arriving = [c.summary("round_robin").busy_share_arrivals or 0.0 for c in cells]
    assert all(arriving)
    assert arriving[-1] > max(busy[-1], arriving[0])
    assert all(c.prediction for c in cells)
    for cell in cells:
        row = versus_best_peer(cell)
        assert row["busy_peers_arriving"] == max(
            s.busy_share_arrivals or 0.0 for s in cell.summaries if s.policy != DEFAULT_POLICY
        )
        mine = cell.summary(DEFAULT_POLICY)
        peers = [s for s in cell.summaries if s.policy != DEFAULT_POLICY]
        best_p99 = min(peers, key=lambda s: s.ttft_p99_s)
        assert row["p99_best_peer"] == best_p99.policy
        assert row["p99_vs_best_peer"] == pytest.approx(mine.ttft_p99_s / best_p99.ttft_p99_s)
    written = json.loads((tmp_path / "suite.json").read_text())
    assert len(written["rows"]) == len(cells)
    assert written["prediction_error"]["tune"]
    text = console.export_text()
    assert "tune set: kv_ttft / best peer at each percentile" in text
    assert "preempt." in text
    assert "peers busy (arriving)" in text


def test_the_suite_command_refuses_unknown_sets_and_workloads(tmp_path: Path) -> None:
    out = ["--out-dir", str(tmp_path)]
    _refused(["bench", "suite", *out, "--set", "nope"], "sets are tune, report")
    _refused(["bench", "suite", *out, "--only", "chat,nope"], "unknown workload nope")


def test_the_suite_replays_only_the_policies_named(tmp_path: Path) -> None:
    # A shorter run for perturbation sweeps: kv_ttft against the peers that matter only,
    # each figure what a full run gives, the best peer chosen among those named.
    console = Console(width=200, record=True)
    args = {"console": console, "quick": True, "sets": ["tune"], "only": ["groups"],
            "jobs": 2, "plots": False, "loads": ["load90"]}  # fmt: skip
    full = run_suite(tmp_path / "full", **args)  # type: ignore[arg-type]
    named = ["round_robin", DEFAULT_POLICY, "round_robin"]
    cells = run_suite(tmp_path, policies=named, **args)  # type: ignore[arg-type]
    assert [s.policy for s in cells[0].summaries] == [DEFAULT_POLICY, "round_robin"]
    for policy in (DEFAULT_POLICY, "round_robin"):
        assert cells[0].summary(policy) == full[0].summary(policy)
    assert versus_best_peer(cells[0])["p99_best_peer"] == "round_robin"
    assert cells[0].prediction == full[0].prediction
    out = ["bench", "suite", "--out-dir", str(tmp_path / "cli"), "--quick", "--only", "groups"]
    _refused([*out, "--policies", "kv_ttft,nope"], "unknown policy 'nope'")
    _refused([*out, "--policies", "round_robin,random"], "compares kv_ttft with peers")
    assert not (tmp_path / "cli").exists()  # refused before anything ran or was written


def test_the_suite_replays_one_load_with_heartbeat_lagged_views(tmp_path: Path) -> None:
    # What a live gateway sees: views one heartbeat old, the router's own counts on top.
    console = Console(width=200, record=True)
    cells = run_suite(
        tmp_path, console=console, quick=True, sets=["tune"], only=["groups"], jobs=2,
        plots=False, loads=["load90"], view_interval_s=1.0,
    )  # fmt: skip
    assert [c.load_label for c in cells] == ["load90"]
    exact = run_suite(
        tmp_path / "exact", console=console, quick=True, sets=["tune"], only=["groups"],
        jobs=2, plots=False, loads=["load90"],
    )  # fmt: skip
    # Load-aware policies decide on different views, so some request lands elsewhere.
    lagged, now = cells[0].summary(DEFAULT_POLICY), exact[0].summary(DEFAULT_POLICY)
    assert (lagged.ttft_p50_s, lagged.ttft_p99_s) != (now.ttft_p50_s, now.ttft_p99_s)
    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["config"]["groups"]["view_interval_s"] == 1.0
    out = ["bench", "suite", "--out-dir", str(tmp_path), "--quick", "--only", "groups"]
    _refused([*out, "--load", "load90,heavy"], "unknown load heavy")
    _refused([*out, "--view-interval-ms", "-5"], "view interval must be >= 0")


def test_the_suite_replays_cells_on_workers_without_kv_offloading(tmp_path: Path) -> None:
    # vLLM and SGLang keep KV in HBM only unless offloading is configured: the same cells
    # on such a cluster, a configuration the policies were not tuned on.
    console = Console(width=200, record=True)
    args = dict(console=console, quick=True, sets=["tune"], only=["groups"], jobs=2,
                plots=False, loads=["load90"])  # fmt: skip
    hbm = run_suite(tmp_path, tiers=("hbm",), **args)  # type: ignore[arg-type]
    tiered = run_suite(tmp_path / "tiered", **args)  # type: ignore[arg-type]

    written = json.loads((tmp_path / "suite.json").read_text())
    assert (
        written["config"]["groups"]["dram_blocks"],
        written["config"]["groups"]["ssd_blocks"],
    ) == (0, 0)
    both = json.loads((tmp_path / "tiered" / "suite.json").read_text())
    assert both["config"]["groups"]["dram_blocks"] > 0
    assert hbm[0].capacity_rps > 0
    assert tiered[0].capacity_rps > 0
    # The full groups trace spills past HBM (the quick one does not): with the tiers,
    # round robin's requests are served some blocks from DRAM; without, none.
    served = {}
    for tiers in (ALL_TIERS, ("hbm",)):
        records, *_ = _replay("groups", 1, False, 1.0, "round_robin", tiers=tiers)
        served[tiers] = sum(r.cached_tokens[1] + r.cached_tokens[2] for r in records)
    assert served[ALL_TIERS] > 0
    assert served[("hbm",)] == 0
    assert parse_tiers("HBM, ssd") == ("hbm", "ssd")
    out = ["bench", "suite", "--out-dir", str(tmp_path), "--quick", "--only", "groups"]
    for bad, says in (("dram,ssd", "tiers must include hbm"), ("hbm,nvme", "unknown tier nvme")):
        refused = CliRunner().invoke(app, [*out, "--tiers", bad])
        assert refused.exit_code != 0
        assert says in refused.output


def test_the_suite_replays_cells_on_another_cluster_size(tmp_path: Path) -> None:
    # The generated cases run on 4 workers, the production-shaped ones on 8: a result
    # that holds only at the size it was tuned on shows on 2 or 16. Capacity is measured
    # on the cluster replayed, and the size is recorded.
    console = Console(width=200, record=True)
    args = dict(console=console, quick=True, sets=["tune"], only=["groups"], jobs=2,
                plots=False, loads=["load90"],
                policies=[DEFAULT_POLICY, "round_robin"])  # fmt: skip
    two = run_suite(tmp_path, cluster_size=2, **args)  # type: ignore[arg-type]
    own = run_suite(tmp_path / "own", **args)  # type: ignore[arg-type]
    assert set(two[0].summary(DEFAULT_POLICY).busy_s) == {"w0", "w1"}
    assert set(own[0].summary(DEFAULT_POLICY).busy_s) == {"w0", "w1", "w2", "w3"}
    assert 0 < two[0].capacity_rps < own[0].capacity_rps  # measured on the smaller cluster
    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["config"]["groups"]["workers"] == 2
    assert written["config"]["conversation"]["workers"] == 2
    stored = json.loads((tmp_path / "own" / "suite.json").read_text())
    assert stored["config"]["groups"]["workers"] == 4
    out = ["bench", "suite", "--out-dir", str(tmp_path / "cli"), "--quick", "--only", "groups"]
    _refused([*out, "--workers", "0"], "cluster size must be >= 1")
    assert not (tmp_path / "cli").exists()


def test_the_suite_replays_cells_on_a_mixed_fleet(tmp_path: Path) -> None:
    # Every other worker an A100 (about a third of an H100's prefill speed): capacity is
    # measured on that fleet, lower than on H100s alone, and the fleet is recorded.
    console = Console(width=200, record=True)
    args = dict(console=console, quick=True, sets=["tune"], only=["groups"], jobs=2,
                plots=False, loads=["load90"])  # fmt: skip
    fleet = ("llama3_8b_h100", "llama3_8b_a100")
    mixed = run_suite(tmp_path, profiles=fleet, **args)  # type: ignore[arg-type]
    h100 = run_suite(tmp_path / "h100", **args)  # type: ignore[arg-type]

    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["config"]["groups"]["worker_profiles"] == list(fleet)
    uniform = json.loads((tmp_path / "h100" / "suite.json").read_text())
    assert uniform["config"]["groups"]["worker_profiles"] == []
    assert 0 < mixed[0].capacity_rps < 0.9 * h100[0].capacity_rps
    # Each worker runs its own profile: w1's requests take longer than w0's.
    records, *_ = _replay("groups", 1, True, 1.0, "round_robin", profiles=fleet)
    mean = {w: statistics.mean(r.ttft_s or 0.0 for r in records if r.worker == w)
            for w in ("w0", "w1")}  # fmt: skip
    assert mean["w1"] > 1.5 * mean["w0"]
    out = ["bench", "suite", "--out-dir", str(tmp_path), "--quick", "--only", "groups"]
    refused = CliRunner().invoke(app, [*out, "--profile", "llama3_8b_h100,b300"])
    assert refused.exit_code != 0
    assert "b300" in refused.output


def test_the_suite_replays_seeds_no_stored_table_holds(tmp_path: Path) -> None:
    # A result measured on the stored seeds is checked on others: same workloads and
    # policies, new traces, printed as their own set.
    console = Console(width=200, record=True)
    fresh = run_suite(
        tmp_path, console=console, quick=True, only=["groups"], jobs=2, plots=False,
        loads=["load90"], seeds=[7, 8, 7],
    )  # fmt: skip
    assert [(c.set, c.seed) for c in fresh] == [("seeds", 7), ("seeds", 8)]
    assert all({s.policy for s in c.summaries} == set(policy_names()) for c in fresh)
    stored = run_suite(
        tmp_path / "stored", console=console, quick=True, sets=["tune"], only=["groups"],
        jobs=2, plots=False, loads=["load90"],
    )  # fmt: skip
    # Other traces: the same policy meets other requests.
    ttfts = {c.seed: c.summary(DEFAULT_POLICY).ttft_mean_s for c in (*fresh, *stored)}
    assert len(set(ttfts.values())) == 3
    assert "seeds set: kv_ttft / best peer at each percentile" in console.export_text()
    written = json.loads((tmp_path / "suite.json").read_text())
    assert [r["cell"] for r in written["rows"]] == ["groups_s7_load90", "groups_s8_load90"]
    out = ["bench", "suite", "--out-dir", str(tmp_path), "--quick", "--only", "groups"]
    word = CliRunner().invoke(app, [*out, "--seeds", "3,x"])
    assert word.exit_code != 0
    assert "seeds are comma-separated integers" in word.output
    negative = CliRunner().invoke(app, [*out, "--seeds=-1"])
    assert negative.exit_code != 0
    assert "seeds must be >= 0" in negative.output


def test_the_suite_replays_cells_under_an_arrival_perturbation(tmp_path: Path) -> None:
    # The same cells with every arrival up to 1 ms later: the same requests and policies,
    # another trajectory, and the written config says which perturbation it was.
    console = Console(width=200, record=True)

    def replay(out: Path, jitter: int) -> list[CellResult]:
        return run_suite(
            out, console=console, quick=True, sets=["tune"], only=["groups"], jobs=2,
            plots=False, loads=["load90"], jitter=[jitter],
        )  # fmt: skip

    plain, nudged = replay(tmp_path / "plain", 0), replay(tmp_path, 3)
    assert [c.label for c in nudged] == [c.label for c in plain]
    for a, b in zip(plain, nudged, strict=True):
        assert [s.requests for s in a.summaries] == [s.requests for s in b.summaries]
        assert (a.jitter, b.jitter, a.runs, b.runs) == ([0], [3], [], [])
    means = {
        (c.seed, p, run): c.summary(p).ttft_mean_s
        for run, cells in (("plain", plain), ("nudged", nudged))
        for c in cells
        for p in policy_names()
    }
    assert any(means[(1, p, "plain")] != means[(1, p, "nudged")] for p in policy_names())
    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["config"]["groups"]["jitter"] == [3]
    with pytest.raises(ValueError, match="jitter must be >= 0"):
        run_suite(tmp_path, console=console, quick=True, only=["groups"], jitter=[0, -1])
    with pytest.raises(ValueError, match="no jitter"):
        run_suite(tmp_path, console=console, quick=True, only=["groups"], jitter=[])
    out = ["bench", "suite", "--out-dir", str(tmp_path), "--quick", "--only", "groups"]
    for bad, says in (("-1", "jitter is k, a range"), ("4-2", "runs backwards")):
        refused = CliRunner().invoke(app, [*out, f"--jitter={bad}"])
        assert refused.exit_code != 0
        assert says in refused.output


def test_several_perturbations_give_medians_and_how_often_each_gap_held(tmp_path: Path) -> None:
    # One cell replayed under k = 0, 1, 2: each run is kept, the cell's figures are the
    # medians over them, and the ratio row counts the runs where kv_ttft was behind.
    console = Console(width=240, record=True)
    args = {"console": console, "quick": True, "sets": ["tune"], "only": ["groups"],
            "jobs": 2, "plots": False, "loads": ["load90"]}  # fmt: skip
    single = run_suite(tmp_path / "single", jitter=[0], **args)  # type: ignore[arg-type]
    cells = run_suite(tmp_path, jitter=[0, 1, 2, 1], **args)  # type: ignore[arg-type]
    assert len(cells) == len(single) == 1
    for cell, alone in zip(cells, single, strict=True):
        assert cell.jitter == [0, 1, 2]
        assert len(cell.runs) == 3
        assert cell.runs[0] == alone.summaries  # k = 0 is the plain replay, unchanged
        assert cell.prediction == alone.prediction
        for p in policy_names():
            p90s = sorted(next(s for s in run if s.policy == p).ttft_p90_s for run in cell.runs)
            assert cell.summary(p).ttft_p90_s == p90s[1]
        row = versus_best_peer(cell)
        assert row["runs"] == 3
        for name, attr in (("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s")):
            behind = 0
            for run in cell.runs:
                ours = next(s for s in run if s.policy == DEFAULT_POLICY)
                best = min(getattr(s, attr) for s in run if s.policy != DEFAULT_POLICY)
                behind += getattr(ours, attr) > best
            assert row[f"{name}_behind_runs"] == behind
        assert cell.runs[1] != cell.runs[0]  # another trajectory, not a copy
    text = console.export_text()
    assert "medians of 3 runs (jitter 0-2)" in text
    assert "behind at one of them in every run" in text
    written = json.loads((tmp_path / "suite.json").read_text())
    assert written["config"]["groups"]["jitter"] == [0, 1, 2]
    assert [len(c["runs"]) for c in written["cells"]] == [3]
    assert all("p90_behind_runs" in r for r in written["rows"])


def test_jitter_specs_name_perturbations() -> None:
    assert parse_jitter("3") == [3]
    assert parse_jitter("0-4") == [0, 1, 2, 3, 4]
    assert parse_jitter("0,2,5-6,2") == [0, 2, 5, 6]
    for bad in ("", "x", "1-", "-1", "3-1", "0,,1"):
        with pytest.raises(ValueError, match="jitter"):
            parse_jitter(bad)
