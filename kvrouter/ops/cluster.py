"""Take one :class:`~kvrouter.ops.top.Frame` of a running cluster (the I/O of ``kvrouter top``).

Workers are found the way the gateway finds them: the Redis host registry
and live heartbeats (:func:`kvrouter.bench.live.cluster_views`). Each
worker's ``/metrics`` (open without the internal token unless a worker
requires it) adds hits and latencies; the gateways' and the indexer's add
the cluster-wide figures. A process that does not answer is reported in
the frame's errors, never fatal.
"""

from __future__ import annotations

import asyncio

import httpx
from redis.exceptions import RedisError

from indexer.views import WorkerView
from kvrouter.bench.live import cluster_views
from kvrouter.ops.exposition import Buckets, Scrape
from kvrouter.ops.top import Frame, GatewayStats, IndexStats, WorkerStats

__all__ = ["take_frame"]


async def take_frame(
    redis_url: str,
    gateways: list[str],
    indexer: str | None = None,
    *,
    display_redis: str | None = None,
    http_timeout: float = 5.0,
) -> Frame:
    """Heartbeats from ``redis_url``, then every ``/metrics`` at once."""
    frame = Frame(redis=display_redis or redis_url)
    try:
        views = await cluster_views(redis_url)
    except (RedisError, OSError) as exc:
        frame.errors.append(f"Redis: {type(exc).__name__}: {exc}")
        views = []
    async with httpx.AsyncClient(timeout=http_timeout) as http:
        urls = [f"{v.url}/metrics" for v in views] + [_metrics(g) for g in gateways]
        if indexer:
            urls.append(_metrics(indexer))
        scrapes = await asyncio.gather(*(_scrape(http, u, frame.errors) for u in urls))
    worker_scrapes = scrapes[: len(views)]
    gateway_scrapes = scrapes[len(views) : len(views) + len(gateways)]
    frame.workers = [_worker(v, s) for v, s in zip(views, worker_scrapes, strict=True)]
    if gateways:
        frame.gateway = _gateway([s for s in gateway_scrapes if s is not None], len(gateways))
    if indexer and scrapes[-1] is not None:
        frame.index = _index(scrapes[-1])
    return frame


def _metrics(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/metrics") else f"{base}/metrics"


async def _scrape(http: httpx.AsyncClient, url: str, errors: list[str]) -> Scrape | None:
    try:
        r = await http.get(url)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        errors.append(f"{url}: {type(exc).__name__} {exc}")
        return None
    return Scrape.parse(r.text)


def _worker(view: WorkerView, scrape: Scrape | None) -> WorkerStats:
    out = WorkerStats(
        host=view.host,
        role=view.role.value,
        running=view.running,
        waiting=view.waiting,
        in_flight=view.in_flight,
        kv_used={m.value: n for m, n in view.kv_used_blocks.items()},
        kv_capacity={m.value: n for m, n in view.kv_capacity_blocks.items()},
    )
    if scrape is not None:
        out.scraped = True
        out.prompt_tokens = scrape.value("kvworker_prompt_tokens_total") or 0.0
        out.hit_tokens = scrape.by_label("kvworker_prefix_hit_tokens_total", "medium")
        out.ttft = scrape.buckets("kvworker_time_to_first_token_seconds")
        out.step = scrape.buckets("kvworker_engine_step_seconds")
    return out


def _gateway(scrapes: list[Scrape], asked: int) -> GatewayStats:
    requests: dict[str, float] = {}
    for s in scrapes:
        for status, n in s.by_label("kvrouter_requests_total", "status").items():
            requests[status] = requests.get(status, 0.0) + n
    return GatewayStats(
        replicas=(len(scrapes), asked),
        requests=requests,
        ttft=Buckets.merge(s.buckets("kvrouter_time_to_first_token_seconds") for s in scrapes),
        predicted=Buckets.merge(s.buckets("kvrouter_predicted_ttft_seconds") for s in scrapes),
        cache_aware=sum(1 for s in scrapes if s.value("kvrouter_cache_aware_routing") == 1.0),
    )


def _index(scrape: Scrape) -> IndexStats:
    return IndexStats(
        lag=scrape.buckets("kvindex_ingest_apply_lag_seconds"),
        hosts_owned=scrape.value("kvindex_ingest_hosts_owned") or 0.0,
        hosts_pending=scrape.value("kvindex_ingest_hosts_pending") or 0.0,
    )
