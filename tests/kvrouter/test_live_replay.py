"""The online replay drives a real gateway and produces the simulator's report."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvrouter.bench.live import replay_live
from kvrouter.bench.report import summarize
from kvrouter.bench.trace import TraceRecord
from tests.support.cluster import Cluster, run_cluster, run_ingester


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    import redis as sync_redis

    sync_redis.Redis.from_url(redis_server.url).flushall()
    with (
        run_ingester(redis_server.url),
        run_cluster(redis_server.url, workers=2, worker={"runner": "sim", "time_scale": 0.0}) as c,
    ):
        yield c


@pytest.mark.parametrize("stream", [True, False])
def test_live_replay_reports_every_request_and_the_shared_prefixes(
    cluster: Cluster, stream: bool
) -> None:
    # Three sessions of three turns: each turn extends the previous one's hash ids (each
    # run its own sessions: the cluster's caches outlive a run).
    trace = []
    base = 0 if stream else 100_000
    for s in range(3):
        ids = [base + 1000 * s + 1]
        for turn in range(3):
            ids = [*ids, base + 1000 * s + 10 + turn]
            record = TraceRecord(
                timestamp=turn * 300 + s * 50,
                input_length=len(ids) * 512 - 100,
                output_length=4,
                hash_ids=list(ids),
            )
            trace.append(record)
    trace.sort(key=lambda r: r.timestamp)
    result = asyncio.run(
        replay_live(
            trace,
            cluster.gateway,
            model="tiny",
            time_scale=1.0,
            redis_url=cluster.redis_url,
            stream=stream,
        )
    )
    assert result.errors == 0
    assert all(r.finish_s is not None for r in result.records)
    # A non-streaming client sees no first token.
    assert all((r.first_token_s is not None) == stream for r in result.records)
    assert all(r.output_tokens == 4 for r in result.records)
    assert {r.worker for r in result.records} <= set(cluster.workers)
    assert set(result.busy_s) == set(cluster.workers)
    assert result.oracle is not None
    summary = summarize("live", result.records, result.busy_s, result.oracle)
    assert summary.completed == len(trace)
    # Later turns reuse their session's earlier turns.
    assert summary.hit_rate > 0.3
    assert summary.hit_rate <= result.oracle.unbounded_hit_rate + 1e-9


def test_live_replay_leaves_out_workers_that_died_or_serve_another_model(
    cluster: Cluster,
) -> None:
    """A dead worker's heartbeat outlives it by up to its TTL: the replay must not trip
    over it, and it counts neither its capacity (oracle) nor its busy time."""
    import time

    import redis.asyncio as aioredis

    from indexer.media import Medium
    from indexer.registry import RedisHostRegistry
    from indexer.views import WorkerView
    from indexer.wire import Keyspace, encode_view
    from kvrouter.bench.live import cluster_views
    from kvrouter.embedded_redis import free_port

    ks = Keyspace()
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def register_ghosts() -> None:
        client = aioredis.Redis.from_url(cluster.redis_url)
        try:
            for host, model in (("ghost-tiny", "tiny"), ("ghost-other", "other-model")):
                await RedisHostRegistry(client, ks).get_or_create(host)
                view = WorkerView(
                    host=host, url=dead_url, model=model, block_size=16, ts=time.time(),
                    kv_capacity_blocks={Medium.HBM: 10**6},
                )  # fmt: skip
                await client.set(ks.heartbeat(host), encode_view(view), px=60_000)
        finally:
            await client.aclose()

    async def drop_ghosts() -> None:
        client = aioredis.Redis.from_url(cluster.redis_url)
        try:
            await client.delete(ks.heartbeat("ghost-tiny"), ks.heartbeat("ghost-other"))
        finally:
            await client.aclose()

    asyncio.run(register_ghosts())
    try:
        listed = {v.host for v in asyncio.run(cluster_views(cluster.redis_url, model="tiny"))}
        assert "ghost-tiny" in listed
        assert "ghost-other" not in listed
        trace = [
            TraceRecord(timestamp=i * 50, input_length=400, output_length=2, hash_ids=[7000 + i])
            for i in range(3)
        ]
        result = asyncio.run(
            replay_live(
                trace, cluster.gateway, model="tiny", time_scale=1.0, redis_url=cluster.redis_url
            )
        )
    finally:
        asyncio.run(drop_ghosts())
    assert result.errors == 0
    assert set(result.busy_s) == set(cluster.workers)
    assert result.oracle is not None
    # The ghost's million HBM blocks are not in the bound's capacity.
    assert result.oracle.capacity_blocks < 10**6
