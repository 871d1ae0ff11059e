"""The report: figures from per-request records, the table, JSON and PNG plots."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from rich.console import Console

from kvrouter.bench.oracle import OracleBound
from kvrouter.bench.report import (
    BenchReport,
    PolicySummary,
    RequestRecord,
    median_summary,
    plot_hit_rates,
    plot_ttft_cdf,
    render_table,
    summarize,
    write_json,
)

PNG = b"\x89PNG\r\n\x1a\n"


def records() -> list[RequestRecord]:
    """Ten requests arriving every second; request i waits 0.1*(i+1) s and streams 1+i tokens."""
    out = []
    for i in range(10):
        first = i + 0.1 * (i + 1)
        out.append(
            RequestRecord(
                index=i,
                worker=f"w{i % 2}",
                arrival_s=float(i),
                prompt_tokens=1000,
                first_token_s=first,
                finish_s=first + 0.02 * i,
                output_tokens=1 + i,
                cached_tokens=(100 * (i % 3), 50, 0),
            )
        )
    return out


def test_latency_figures_follow_their_definitions() -> None:
    recs = records()
    s = summarize("p", recs, {"w0": 1.0, "w1": 1.0})
    ttfts = [0.1 * (i + 1) for i in range(10)]
    assert s.ttft_mean_s == pytest.approx(statistics.mean(ttfts))
    q = statistics.quantiles(ttfts, n=100, method="inclusive")
    assert s.ttft_p50_s == pytest.approx(statistics.median(ttfts))
    assert s.ttft_p90_s == pytest.approx(q[89])
    assert s.ttft_p99_s == pytest.approx(q[98])
    # Request 0 has one output token: no inter-token time; the others stream at 20 ms.
    assert s.tpot_mean_s == pytest.approx(0.02)
    assert s.tpot_p90_s == pytest.approx(0.02)


def test_throughput_is_over_the_makespan() -> None:
    recs = records()
    s = summarize("p", recs, {"w0": 1.0})
    end = max(r.finish_s for r in recs if r.finish_s is not None)
    assert s.makespan_s == pytest.approx(end)
    assert s.throughput_rps == pytest.approx(10 / end)
    assert s.output_tps == pytest.approx(sum(1 + i for i in range(10)) / end)


def test_hit_rate_splits_by_medium_and_compares_to_the_oracle() -> None:
    recs = records()
    oracle = OracleBound(
        capacity_blocks=10, prompt_tokens=10_000, hit_tokens=4000, unbounded_hit_tokens=5000
    )
    s = summarize("p", recs, {"w0": 1.0}, oracle)
    hbm = sum(100 * (i % 3) for i in range(10)) / 10_000
    assert s.hit_rate_by_medium == {"hbm": pytest.approx(hbm), "dram": 0.05, "ssd": 0.0}
    assert s.hit_rate == pytest.approx(hbm + 0.05)
    assert s.oracle_hit_rate == 0.4
    assert s.hit_vs_oracle == pytest.approx((hbm + 0.05) / 0.4)


def test_load_imbalance_is_the_coefficient_of_variation_of_busy_time() -> None:
    assert summarize("p", records(), {"a": 2.0, "b": 2.0}).load_cv == 0.0
    busy = {"a": 1.0, "b": 3.0, "c": 8.0}
    cv = statistics.pstdev(busy.values()) / statistics.mean(busy.values())
    assert summarize("p", records(), busy).load_cv == pytest.approx(cv)


def test_busy_share_is_the_mean_busy_time_over_the_makespan() -> None:
    recs = records()
    makespan = max(r.finish_s or 0.0 for r in recs) - recs[0].arrival_s
    summary = summarize("p", recs, {"a": makespan, "b": makespan / 2})
    assert summary.busy_share == pytest.approx(0.75)
    assert summarize("p", [], {}).busy_share == 0.0


def test_unfinished_requests_count_as_not_completed() -> None:
    recs = records()
    recs[3].finish_s = None
    recs[4].first_token_s = recs[4].finish_s = None
    s = summarize("p", recs, {"w0": 1.0})
    assert (s.requests, s.completed) == (10, 8)
    assert s.ttft_mean_s == pytest.approx(
        statistics.mean(0.1 * (i + 1) for i in range(10) if i != 4)
    )


def test_an_empty_run_reports_no_latency() -> None:
    s = summarize("p", [], {})
    assert math.isnan(s.ttft_p90_s)
    assert (s.completed, s.hit_rate, s.throughput_rps) == (0, 0.0, 0.0)


def test_json_and_table_carry_every_policy(tmp_path: Path) -> None:
    a = summarize("alpha", records(), {"w0": 1.0})
    b = summarize("beta", [], {})
    path = write_json(
        BenchReport(trace="t", config={"workers": 2}, oracle=None, summaries=[a, b]),
        tmp_path / "r.json",
    )
    data = json.loads(path.read_text())
    assert [s["policy"] for s in data["summaries"]] == ["alpha", "beta"]
    assert data["summaries"][1]["ttft_p90_s"] is None
    assert data["summaries"][0]["completed"] == 10
    console = Console(width=200, record=True)
    render_table([a, b], console)
    text = console.export_text()
    assert "alpha" in text
    assert "beta" in text
    assert f"{a.ttft_p90_s * 1e3:,.0f}" in text


def test_plots_are_written_as_png(tmp_path: Path) -> None:
    recs = records()
    s = summarize("alpha", recs, {"w0": 1.0})
    oracle = OracleBound(10, 100, 50, 60)
    cdf = plot_ttft_cdf({"alpha": [r.ttft_s or 0.0 for r in recs], "empty": []}, tmp_path / "c.png")
    bars = plot_hit_rates([s], tmp_path / "h.png", oracle)
    for path in (cdf, bars):
        data = path.read_bytes()
        assert data[:8] == PNG
        assert len(data) > 5000


def _run(
    policy: str, p90: float, preemptions: int, hbm: float, busy: dict[str, float]
) -> PolicySummary:
    return PolicySummary(
        policy=policy, requests=10, completed=10, ttft_mean_s=p90 / 2, ttft_p50_s=p90 / 4,
        ttft_p90_s=p90, ttft_p99_s=2 * p90, tpot_mean_s=0.01, tpot_p90_s=0.02,
        makespan_s=5.0, throughput_rps=2.0, output_tps=40.0, hit_rate=0.5,
        hit_rate_by_medium={"hbm": hbm}, load_cv=0.1, busy_s=busy, preemptions=preemptions,
        oracle_hit_rate=0.6, hit_vs_oracle=0.5 / 0.6,
    )  # fmt: skip


def test_a_median_summary_is_each_fields_median_over_the_runs() -> None:
    # One unlucky run (p90 9 s, 40 preemptions) moves neither the median p90 nor the count.
    runs = [
        _run("kv_ttft", 0.30, 2, 0.40, {"w0": 1.0, "w1": 3.0}),
        _run("kv_ttft", 9.00, 40, 0.10, {"w0": 2.0}),
        _run("kv_ttft", 0.20, 3, 0.30, {"w0": 5.0, "w1": 1.0}),
        _run("kv_ttft", 0.25, 1, 0.20, {"w0": 4.0, "w1": 2.0}),
    ]
    m = median_summary(runs)
    assert m.policy == "kv_ttft"
    assert m.ttft_p90_s == pytest.approx(0.275)
    assert m.ttft_p99_s == pytest.approx(0.55)
    assert m.preemptions == 2  # the low median: a count one run had
    assert isinstance(m.preemptions, int)
    assert m.hit_rate_by_medium == {"hbm": pytest.approx(0.25)}
    assert m.busy_s == {"w0": 3.0, "w1": 1.5}  # a worker missing from a run counts 0 there
    assert m.oracle_hit_rate == 0.6
    assert m.hit_vs_oracle == pytest.approx(0.5 / 0.6)
    assert median_summary(runs[:1]) == runs[0]
    with pytest.raises(ValueError, match="no runs"):
        median_summary([])
    with pytest.raises(ValueError, match="several policies"):
        median_summary([runs[0], _run("round_robin", 0.3, 0, 0.1, {})])
