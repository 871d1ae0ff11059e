"""A small kvrouter cluster for tests: real Redis, real workers, a real gateway, on loopback.

Workers and the gateway run in-process (uvicorn threads) for speed; fault
tests that must SIGKILL a worker use :class:`tests.support.servers.ServerProcess`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine_worker.server import create_app as create_worker_app
from engine_worker.settings import WorkerSettings
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app as create_gateway_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.servers import serve_app, wait_http

__all__ = ["Cluster", "run_cluster"]


@dataclass
class Cluster:
    """URLs of what runs."""

    gateway: str
    workers: dict[str, str] = field(default_factory=dict)
    redis_url: str = ""
    stack: ExitStack = field(default_factory=ExitStack)

    def worker_stats(self, name: str) -> dict[str, Any]:
        """A worker's pool counters."""
        result: dict[str, Any] = httpx.get(f"{self.workers[name]}/kv/stats", timeout=30).json()
        return result


def worker_settings(name: str, port: int, redis_url: str | None, **kw: Any) -> WorkerSettings:
    """Small tiny-model worker settings for tests."""
    base: dict[str, Any] = {
        "model": "tiny", "runner": "torch", "name": name, "port": port, "redis_url": redis_url,
        "hbm_blocks": 256, "dram_blocks": 128, "max_model_len": 2048,
        "max_num_batched_tokens": 512, "heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0,
    }  # fmt: skip
    base.update(kw)
    return WorkerSettings(**base)


@contextmanager
def run_cluster(
    redis_url: str | None,
    workers: int = 2,
    *,
    gateway: dict[str, Any] | None = None,
    worker: dict[str, Any] | None = None,
    static: bool = False,
    roles: Sequence[str] = (),
) -> Iterator[Cluster]:
    """Start ``workers`` tiny workers and a gateway; yields the cluster. Worker ``wi`` has
    role ``roles[i]`` where given (else ``both``)."""
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for i in range(workers):
            name = f"w{i}"
            port = free_port()
            role = {"role": roles[i]} if i < len(roles) else {}
            settings = worker_settings(name, port, redis_url, **{**(worker or {}), **role})
            urls[name] = stack.enter_context(serve_app(create_worker_app(settings), port=port))
        gw_port = free_port()
        gw_settings = RouterSettings(
            port=gw_port,
            models=["tiny"],
            redis_url=redis_url,
            workers=list(urls.values()) if static else [],
            discovery_interval_s=0.1,
            load_sync_interval_s=0.1,
            **(gateway or {}),
        )
        gw = stack.enter_context(serve_app(create_gateway_app(gw_settings), port=gw_port))
        wait_http(f"{gw}/ready", timeout=30)
        cluster = Cluster(gw, urls, redis_url or "", stack)
        yield cluster


@contextmanager
def run_ingester(redis_url: str) -> Iterator[Any]:
    """The indexer's ingester, in-process on its own event loop thread."""
    import asyncio
    import threading

    from indexer.index.redis_index import RedisIndex
    from indexer.ingest import IngestConfig, Ingester

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="ingester", daemon=True)
    thread.start()
    index = RedisIndex(redis_url)
    config = IngestConfig(refresh_interval_s=0.1, block_ms=50, dead_check_interval_s=0.5)
    ingester = Ingester(redis_url, index, config=config)
    asyncio.run_coroutine_threadsafe(ingester.start(), loop).result(30)
    try:
        yield ingester
    finally:
        asyncio.run_coroutine_threadsafe(ingester.stop(), loop).result(30)
        asyncio.run_coroutine_threadsafe(index.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
