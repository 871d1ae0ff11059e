"""The ``kvrouter indexer`` service app: ingests, exports metrics, lets go of its hosts on stop."""

from __future__ import annotations

import httpx
import redis.asyncio as aioredis

from indexer.events import Snapshot
from indexer.ingest_service import IndexerSettings, create_app
from tests.indexer.ingest_support import EPOCH, KS, add, batch, eventually, register, stored
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app


async def test_the_service_ingests_reports_and_releases_its_hosts(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await register(client, "a")
    await add(client, "a", Snapshot("a", EPOCH, 0, 0.0, {}), batch("a", 1, stored(1)),
              batch("a", 2, stored(2)))  # fmt: skip
    port = free_port()
    settings = IndexerSettings(
        redis_url=redis_url, metrics_port=port, replica_id="svc", refresh_interval_s=0.1,
        block_ms=50, lease_ttl_s=1.5, stats_interval_s=0.0,
    )  # fmt: skip
    with serve_app(create_app(settings), port=port) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:

            async def applied_both() -> bool:
                text = (await http.get("/metrics")).text
                return 'kvindex_ingest_batches_total{result="applied"} 2.0' in text

            await eventually(applied_both, what="two batches applied")
            metrics = (await http.get("/metrics")).text
            assert 'kvindex_batches_total{result="applied"} 2.0' in metrics
            assert 'kvindex_snapshots_total{result="replaced"} 1.0' in metrics
            # The size gauges are read from the index on scrape: 2 blocks held, in HBM.
            assert 'kvindex_entries{medium="hbm"} 2.0' in metrics
            assert "kvindex_memory_bytes 0.0" not in metrics
            ready = await http.get("/ready")
            assert ready.status_code == 200
            assert ready.json()["owned"] == ["a"]
            assert (await http.get("/health")).json()["healthy"] is True
    # A clean stop persists the position and lets the lease go at once.
    assert await client.get(KS.index("own:a")) is None
    assert await client.hget(KS.index("pos"), "a") is not None
    await client.aclose()
