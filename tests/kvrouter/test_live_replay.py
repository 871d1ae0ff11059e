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


def test_live_replay_reports_every_request_and_the_shared_prefixes(cluster: Cluster) -> None:
    # Three sessions of three turns: each turn extends the previous one's hash ids.
    trace = []
    for s in range(3):
        ids = [1000 * s + 1]
        for turn in range(3):
            ids = [*ids, 1000 * s + 10 + turn]
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
            trace, cluster.gateway, model="tiny", time_scale=1.0, redis_url=cluster.redis_url
        )
    )
    assert result.errors == 0
    assert all(r.first_token_s is not None and r.finish_s is not None for r in result.records)
    assert all(r.output_tokens == 4 for r in result.records)
    assert {r.worker for r in result.records} <= set(cluster.workers)
    assert set(result.busy_s) == set(cluster.workers)
    assert result.oracle is not None
    summary = summarize("live", result.records, result.busy_s, result.oracle)
    assert summary.completed == len(trace)
    # Later turns reuse their session's earlier turns.
    assert summary.hit_rate > 0.3
    assert summary.hit_rate <= result.oracle.unbounded_hit_rate + 1e-9
