"""The whole system on a Redis Cluster: workers, ingester and gateway, cache-aware end to end.

The index and the ingester always spoke Cluster; the gateway (discovery, load
leases, rate buckets) and the workers (events, heartbeats) used single-node
clients and failed on every key another node owned. Three real cluster nodes
here, real sim workers, the real ingester and gateway.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis

from engine_worker.server import create_app as create_worker_app
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app as create_gateway_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.cluster import run_ingester, worker_settings
from tests.support.redis_cluster import RedisCluster
from tests.support.servers import serve_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as running:
        yield running


def test_gateway_and_workers_route_cache_aware_on_a_redis_cluster(cluster: RedisCluster) -> None:
    with ExitStack() as stack:
        for i in range(2):
            port = free_port()
            settings = worker_settings(
                f"c{i}", port, cluster.url, runner="sim", time_scale=0.0, heartbeat_interval_s=0.2
            )
            stack.enter_context(serve_app(create_worker_app(settings), port=port))
        stack.enter_context(run_ingester(cluster.url))
        port = free_port()
        gw_settings = RouterSettings(
            port=port, models=["tiny"], redis_url=cluster.url, discovery_interval_s=0.1,
            load_sync_interval_s=0.1, api_keys=["k"], rate_limit_rps=50.0,
        )  # fmt: skip
        gw = stack.enter_context(serve_app(create_gateway_app(gw_settings), port=port))
        deadline = time.monotonic() + 30
        while httpx.get(f"{gw}/ready").json().get("workers") != 2:
            assert time.monotonic() < deadline, "workers not discovered through the cluster"
            time.sleep(0.05)
        auth = {"authorization": "Bearer k"}
        body = {"model": "tiny", "prompt": list(range(100, 420)), "max_tokens": 2}
        first = httpx.post(f"{gw}/v1/completions", json=body, headers=auth, timeout=30)
        assert first.status_code == 200, first.text

        def second_hits() -> httpx.Response | None:
            r = httpx.post(f"{gw}/v1/completions", json=body, headers=auth, timeout=30)
            assert r.status_code == 200, r.text
            return r if r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] else None

        deadline = time.monotonic() + 15
        while (again := second_hits()) is None:
            assert time.monotonic() < deadline, "the index on the cluster never served a hit"
            time.sleep(0.2)
        assert again.headers["x-kvrouter-worker"] == first.headers["x-kvrouter-worker"]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 304
        scrape = httpx.get(f"{gw}/metrics").text
        assert re.search(r"^kvrouter_cache_aware_routing 1\.0$", scrape, re.M)
        assert "kvrouter_redis_errors_total{" not in scrape
        # Load leases and rate buckets live in the cluster (on whichever node owns them).
        client = redis.RedisCluster.from_url(cluster.url)
        try:
            assert client.zcard("kvr:load:replicas") == 1
            buckets = list(client.scan_iter("kvr:rl:*", target_nodes=client.ALL_NODES))
            assert len(buckets) == 1
        finally:
            client.close()
