"""Cross-node pooling through the gateway: a request routed away from the busy worker that
holds its prefix gets that prefix pulled, not recomputed (real Redis, indexer, sim workers)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import redis as sync_redis

from indexer.index.redis_index import RedisIndex
from indexer.keys import block_keys, root_parent
from indexer.views import PrefixMatch
from kvrouter.bench.live import cluster_views, served_by_medium
from tests.kvrouter.test_gateway_pd import metric
from tests.kvrouter.test_reliability import wait_until
from tests.support.cluster import Cluster, run_cluster, run_ingester

BLOCK = 16
PREFIX = list(range(1000, 1000 + 64 * BLOCK))  # 64 full blocks
DEBUG = {"x-kvrouter-debug": "1"}
#: Modeled steps 20x slower than the H100 profile: a few direct long prompts keep a
#: worker's prefill queue full for seconds, long enough to route around it.
SLOW = {"runner": "sim", "time_scale": 20.0, "hbm_blocks": 1024, "dram_blocks": 0,
        "max_model_len": 4096, "max_num_batched_tokens": 512}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    sync_redis.Redis.from_url(redis_server.url).flushall()
    with run_ingester(redis_server.url), run_cluster(redis_server.url, worker=SLOW) as c:
        yield c


def complete(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


async def match(redis_url: str, keys: list[int]) -> dict[str, PrefixMatch]:
    index = RedisIndex(redis_url)
    try:
        return await index.match(keys)
    finally:
        await index.close()


@contextmanager
def busy(cluster: Cluster, host: str) -> Iterator[None]:
    """Keep worker ``host`` busy with long prompts sent to it directly, until the
    gateway has seen its queue in a heartbeat."""
    load = [
        threading.Thread(target=complete, args=(cluster.workers[host], list(range(s, s + 3000))))
        for s in (20_000, 30_000, 40_000)
    ]
    for t in load:
        t.start()
    try:

        def queued() -> bool:
            views = asyncio.run(cluster_views(cluster.redis_url))
            return any(v.host == host and v.queued_prefill_tokens > 3000 for v in views)

        wait_until(queued, 20.0)
        # Redis shows the queue; the test cluster's gateway reads heartbeats every 0.1 s.
        # Give it ten to see the queue too (which lasts seconds at this time scale): routed
        # before that, the request finds the holder idle and stays with its prefix.
        time.sleep(1.0)
        assert queued(), f"{host}'s queue drained before the gateway could see it"
        yield
    finally:
        for t in load:
            t.join()


def wait_indexed(cluster: Cluster, host: str, keys: list[int]) -> None:
    """Wait until the index shows ``host`` holding all of ``keys``."""

    def indexed() -> bool:
        matches = asyncio.run(match(cluster.redis_url, keys))
        return host in matches and matches[host].blocks == len(keys)

    wait_until(indexed, 20.0)


def test_a_prefix_held_by_a_busy_worker_is_pulled_to_the_idle_one(cluster: Cluster) -> None:
    first = complete(cluster.gateway, [*PREFIX, 7, 8, 9], DEBUG)
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvrouter-worker"]
    (other,) = set(cluster.workers) - {holder}
    keys = block_keys(PREFIX, BLOCK, root_parent("tiny"))
    wait_indexed(cluster, holder, keys)
    with busy(cluster, holder):
        received = metric(cluster.workers[other], "kvworker_kv_transfer_blocks_total",
                          'direction="received"')  # fmt: skip
        r = complete(cluster.gateway, [*PREFIX, 4, 5, 6], DEBUG)
        assert r.status_code == 200, r.text
        decision = json.loads(r.headers["x-kvrouter-decision"])
        assert r.headers["x-kvrouter-worker"] == other, decision["scores"]
        assert decision["kv_source"] == holder
        assert decision["scores"][other]["pulled_blocks"] == len(keys)
        usage = r.json()["usage"]
        # The prefix was pulled, not computed: the worker says so, and the live replay's
        # hit count (what `bench live` and `bench compare` report) includes it.
        assert usage["cached_tokens_by_medium"]["remote"] == len(PREFIX)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
        assert served_by_medium(usage["cached_tokens_by_medium"])[0] == len(PREFIX)
        after = metric(cluster.workers[other], "kvworker_kv_transfer_blocks_total",
                       'direction="received"')  # fmt: skip
        assert after - received == len(keys)
        assert metric(cluster.gateway, "kvrouter_pooled_pulls_total") >= 1
