"""``kvrouter top``'s pure parts: quantiles from buckets, and what a frame shows."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvrouter.ops.exposition import Buckets, Scrape
from kvrouter.ops.top import Frame, GatewayStats, IndexStats, WorkerStats, render

INF = float("inf")


def text(frame: Frame, previous: Frame | None = None) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(render(frame, previous))
    return console.export_text()


def test_quantiles_interpolate_inside_a_bucket_like_histogram_quantile() -> None:
    b = Buckets((0.1, 0.5, 1.0, INF), (0.0, 50.0, 100.0, 100.0))
    assert b.quantile(0.5) == pytest.approx(0.5)
    assert b.quantile(0.25) == pytest.approx(0.3)
    assert b.quantile(0.9) == pytest.approx(0.9)
    assert Buckets((1.0, INF), (0.0, 10.0)).quantile(0.9) == 1.0  # in +Inf: the top bound
    assert Buckets().quantile(0.5) is None
    assert Buckets((1.0, INF), (0.0, 0.0)).quantile(0.5) is None


def test_a_window_is_the_difference_of_two_scrapes_unless_a_process_restarted() -> None:
    before = Buckets((1.0, INF), (10.0, 10.0))
    after = Buckets((1.0, INF), (10.0, 20.0))
    assert after.minus(before).counts == (0.0, 10.0)
    assert before.minus(after) == before  # counts fell: a restart, keep the cumulative
    merged = Buckets.merge([before, after, Buckets()])
    assert merged.counts == (20.0, 30.0)


def test_scrape_reads_samples_histograms_and_declared_names() -> None:
    s = Scrape.parse(
        "# HELP kvrouter_retries_total Retries\n# TYPE kvrouter_retries_total counter\n"
        "# HELP x_seconds X\n# TYPE x_seconds histogram\n"
        'x_seconds_bucket{le="0.5"} 3.0\nx_seconds_bucket{le="+Inf"} 4.0\n'
        "x_seconds_sum 1.0\nx_seconds_count 4.0\n"
        '# HELP hits_total Hits\n# TYPE hits_total counter\nhits_total{medium="hbm"} 5.0\n'
        'hits_total{medium="dram"} 2.0\n'
    )
    assert "kvrouter_retries_total" in s.declared
    assert "kvrouter_retries_total" not in s.samples
    assert {"x_seconds_bucket", "x_seconds_count"} <= s.declared
    assert s.buckets("x_seconds") == Buckets((0.5, INF), (3.0, 4.0))
    assert s.by_label("hits_total", "medium") == {"hbm": 5.0, "dram": 2.0}
    assert s.value("hits_total") == 7.0
    assert s.value("hits_total", medium="hbm") == 5.0
    assert s.value("nothing") is None


def frame(hits: float = 48.0, prompt: float = 64.0, count: float = 4.0) -> Frame:
    ttft = Buckets((0.01, 0.1, INF), (0.0, count, count))
    return Frame(
        redis="redis://r:6379/0",
        workers=[
            WorkerStats("worker-1", "decode", running=1, waiting=2, in_flight=3,
                        kv_used={"hbm": 7, "dram": 1}, kv_capacity={"hbm": 64, "dram": 128},
                        scraped=True, prompt_tokens=prompt, hit_tokens={"hbm": hits},
                        ttft=ttft, step=ttft),
            WorkerStats("worker-0", "prefill"),
        ],
        gateway=GatewayStats((1, 2), {"200": 9.0, "502": 1.0}, ttft, ttft, cache_aware=0),
        index=IndexStats(ttft, hosts_owned=2, hosts_pending=1),
        errors=["http://g2/metrics: ConnectError"],
    )  # fmt: skip


def test_a_frame_shows_each_worker_and_the_cluster_figures() -> None:
    out = text(frame())
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if "│ worker-" in line}
    assert list(lines) == ["worker-0", "worker-1"]  # sorted by name
    cells = [c.strip() for c in lines["worker-1"].split("│")[1:-1]]
    assert cells[:7] == ["worker-1", "decode", "1", "2", "3", "7/64", "1/128"]
    assert cells[7] == "-"  # no SSD tier
    assert cells[8:] == ["75%", "hbm:48", "55ms/91ms", "55ms"]
    assert lines["worker-0"].count(" - ") >= 4  # /metrics did not answer: no figures
    assert "1/2 replicas, routing load only on 1 of 1" in out
    assert "10 (200: 9, 502: 1)" in out
    assert "observed 55ms/91ms   predicted 55ms/91ms" in out
    assert "hosts 2, 1 waiting for a snapshot" in out
    assert "! http://g2/metrics: ConnectError" in out


def test_with_a_previous_frame_the_figures_cover_the_window() -> None:
    out = text(frame(hits=60.0, prompt=80.0, count=6.0), previous=frame())
    row = next(line for line in out.splitlines() if "│ worker-1" in line)
    assert "75%" in row
    assert "hbm:12" in row
