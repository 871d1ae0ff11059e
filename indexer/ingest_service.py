"""The ``kvrouter indexer`` service: one ingester replica with a small HTTP side.

``create_app(settings)`` builds a FastAPI app whose lifespan owns the Redis
index and the :class:`~indexer.ingest.Ingester`; the HTTP side serves
``/metrics`` (``kvindex_`` metrics of the index and the ingester),
``/health`` (the process is up), ``/ready`` (200 once a round reached
Redis) and ``/status`` (hosts owned and pending). Settings come from
``KVINDEX_*`` variables or the CLI. A scrape also refreshes the index's
size gauges (entries per medium, memory), at most every
``stats_interval_s``: they are read from Redis, not counted in-process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from indexer.index import RedisIndex
from indexer.index.base import KVIndexError
from indexer.ingest import IngestConfig, Ingester, default_replica_id
from indexer.ingest_metrics import IngestMetrics
from indexer.metrics import IndexMetrics
from indexer.wire import Keyspace

__all__ = ["IndexerSettings", "create_app"]

log = logging.getLogger(__name__)


class IndexerSettings(BaseSettings):
    """Everything an ingester replica needs (environment prefix ``KVINDEX_``)."""

    model_config = SettingsConfigDict(env_prefix="KVINDEX_", extra="ignore")

    redis_url: str = Field(..., description="Redis (or Redis Cluster) URL of streams and index")
    key_prefix: str = "kvr"
    replica_id: str = Field("", description="Name in host leases; default hostname-pid-random")
    bind: str = "127.0.0.1"
    metrics_port: int = Field(8300, ge=0, le=65535, description="HTTP port of /metrics")
    read_count: int = Field(256, ge=1)
    block_ms: int = Field(200, ge=1)
    refresh_interval_s: float = Field(1.0, gt=0)
    lease_ttl_s: float = Field(10.0, gt=0)
    dead_check_interval_s: float = Field(2.5, gt=0, description="about half the heartbeat TTL")
    snapshot_timeout_s: float = Field(5.0, gt=0)
    quiet_snapshot_s: float = Field(10.0, ge=0, description="tail check of quiet hosts; 0 = off")
    tail_grace_s: float = Field(
        2.0, ge=0, description="heartbeat ahead of the stream this long: snapshot; 0 = off"
    )
    hold_limit: int = Field(10_000, ge=1)
    stats_interval_s: float = Field(5.0, ge=0, description="least time between size reads")

    def ingest_config(self) -> IngestConfig:
        """The ingester's configuration."""
        return IngestConfig(
            replica_id=self.replica_id or default_replica_id(),
            read_count=self.read_count,
            block_ms=self.block_ms,
            refresh_interval_s=self.refresh_interval_s,
            lease_ttl_s=self.lease_ttl_s,
            dead_check_interval_s=self.dead_check_interval_s,
            snapshot_timeout_s=self.snapshot_timeout_s,
            quiet_snapshot_s=self.quiet_snapshot_s,
            tail_grace_s=self.tail_grace_s,
            hold_limit=self.hold_limit,
        )


def create_app(settings: IndexerSettings, *, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the service; the ingester starts with the app and stops with it."""
    registry = registry or CollectorRegistry()
    index_metrics = IndexMetrics(registry)
    ingest_metrics = IngestMetrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        keyspace = Keyspace(settings.key_prefix)
        index = RedisIndex(settings.redis_url, keyspace, metrics=index_metrics)
        ingester = Ingester(
            settings.redis_url,
            index,
            keyspace=keyspace,
            config=settings.ingest_config(),
            metrics=ingest_metrics,
        )
        await ingester.start()
        try:
            yield {"ingester": ingester, "index": index}
        finally:
            await ingester.stop()
            await index.close()

    app = FastAPI(title="kvrouter indexer", version="0.1.0", lifespan=lifespan)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """The process is up (whether Redis answers is in ``healthy``)."""
        ingester: Ingester = request.state.ingester
        return {"status": "ok", "healthy": ingester.healthy}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """200 once a round reached Redis, 503 while it does not."""
        ingester: Ingester = request.state.ingester
        return JSONResponse(ingester.status(), status_code=200 if ingester.healthy else 503)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        """Hosts registered, owned and pending."""
        ingester: Ingester = request.state.ingester
        return ingester.status()

    last_stats = [float("-inf")]

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of the ``kvindex_`` metrics."""
        now = time.monotonic()
        if now - last_stats[0] >= settings.stats_interval_s:
            last_stats[0] = now
            index: RedisIndex = request.state.index
            try:
                await index.stats()  # sets kvindex_entries and kvindex_memory_bytes
            except KVIndexError as exc:
                log.warning("index size unknown for this scrape: %s", exc)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
