"""The dashboards, rules and ``kvrouter top`` against a live ``kvrouter up --runner sim``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from kvrouter.ops.alerts import ALERTS, PLACEHOLDER_DEFAULTS
from kvrouter.ops.dashboards import DASHBOARDS
from kvrouter.ops.exposition import Scrape
from kvrouter.ops.promql import metric_names
from tests.ops.conftest import Cluster

pytestmark = pytest.mark.slow

#: Metrics a query reads that this cluster cannot show a sample of, and why. Each must
#: still be declared (``# TYPE``) by one of its processes, so a rename still fails here.
DECLARED_ONLY = {
    "kvrouter_retries_total": "only when an attempt fails before its first byte "
    "(a worker refuses the connection, dies or drains)",
    "kvrouter_redis_errors_total": "only when a Redis call fails",
    "kvindex_ingest_redis_errors_total": "only when a Redis call fails",
    "kvrouter_pd_fallbacks_total": "only when a disaggregated request's prefill fails",
    "kvworker_kv_load_bandwidth_bytes_per_second": "measured by the torch runner's tier "
    "storage; sim workers hold no KV tensors",
}
#: Metrics of other exporters (not ours to scrape here).
EXTERNAL = {
    "redis_memory_used_bytes": "oliver006/redis_exporter",
    "redis_memory_max_bytes": "oliver006/redis_exporter",
}


def used_names() -> set[str]:
    """Every metric name a dashboard or a rule reads."""
    names: set[str] = set()
    for build in DASHBOARDS.values():
        for expr in build().exprs():
            names |= metric_names(expr)
    for alert in ALERTS:
        expr = alert.expr
        for placeholder, default in PLACEHOLDER_DEFAULTS.items():
            expr = expr.replace(placeholder, default)
        names |= metric_names(expr)
    return names


def scrape_all(c: Cluster) -> list[Scrape]:
    """The gateway's, the indexer's and every worker's ``/metrics``."""
    urls = [c.gateway, c.indexer, *c.workers]
    return [Scrape.parse(httpx.get(f"{u}/metrics", timeout=10).text) for u in urls]


def test_every_metric_a_dashboard_or_rule_reads_is_in_a_live_scrape(cluster: Cluster) -> None:
    wanted = used_names() - EXTERNAL.keys()
    # Counters of events that end asynchronously (a client gone) land a moment later.
    deadline = time.monotonic() + 15
    while True:
        scrapes = scrape_all(cluster)
        sampled = set().union(*(s.samples for s in scrapes))
        missing = wanted - sampled - DECLARED_ONLY.keys()
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"read by a dashboard or rule, but in no scrape: {sorted(missing)}"
    declared = set().union(*(s.declared for s in scrapes))
    assert DECLARED_ONLY.keys() <= wanted, "allowlisted but no longer used"
    assert not (DECLARED_ONLY.keys() - declared), "allowlisted names no process declares"


def test_top_once_names_every_worker_with_its_role_and_figures(cluster: Cluster) -> None:
    def frame() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvrouter", "top", "--redis", cluster.redis_url,
             "--gateway", cluster.gateway, "--indexer", cluster.indexer, "--once"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "COLUMNS": "120", "NO_COLOR": "1"},
        )  # fmt: skip

    def cells_of(text: str) -> dict[str, list[str]]:
        rows = [line for line in text.splitlines() if "│ worker-" in line]
        return {r.split("│")[1].strip(): [c.strip() for c in r.split("│")[1:-1]] for r in rows}

    # The KV figures come from heartbeats (every 1 s in `kvrouter up`), which trail the
    # traffic by up to a beat: look again for a few beats before judging them.
    deadline = time.monotonic() + 5.0
    out = frame()
    while time.monotonic() < deadline and all(
        c[5] == "0/1024" for c in cells_of(out.stdout).values()
    ):
        time.sleep(0.5)
        out = frame()
    assert out.returncode == 0, out.stderr
    text = out.stdout
    cells = cells_of(text)
    assert set(cells) == {"worker-0", "worker-1"}, text
    assert all(c[1] == "both" for c in cells.values()), text
    # Both workers served requests (TTFT); KV blocks and hits show where the prompts went
    # (the KV figures come from heartbeats, which trail the traffic by up to a beat).
    assert any(c[5] != "0/1024" for c in cells.values()), text
    assert any(c[9] not in ("0", "-") for c in cells.values()), text
    assert all(c[10] not in ("-", "-/-") for c in cells.values()), text
    assert "1/1 replicas, routing cache-aware" in text
    observed = text.split("observed ")[1].split()[0]
    predicted = text.split("predicted ")[1].split()[0]
    assert "ms" in observed, text
    assert "ms" in predicted, text
    assert "apply lag p50/p90" in text, text
    assert "hosts 2," in text, text
