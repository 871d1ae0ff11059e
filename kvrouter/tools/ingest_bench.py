"""Ingest rate through the ingester (the ``kvrouter indexer`` path) beside direct ``apply``.

``python -m kvrouter.tools.ingest_bench`` builds the same event batches for
N synthetic hosts as :mod:`kvrouter.tools.index_bench` (3/4 new blocks
stored, 1/4 earlier ones removed, in order per host) and measures, on a
fresh default-configured ``redis-server`` each round, alternating:

* direct: ``RedisIndex.apply`` of every batch, hosts concurrently, each in
  order (what index_bench's ingest figure measures);
* ingester: the hosts registered with a live heartbeat, their streams
  pre-filled with the encoded batches (XADD, as workers publish them), then
  one :class:`~indexer.ingest.Ingester` timed over the rounds
  (:meth:`~indexer.ingest.Ingester.step`, what its task loops on) until it
  has applied every batch: registry read, lease, XREAD, decode, apply,
  position writes -- the service's whole path.

Each keeps its best round (the machine is shared); the ratio comes from one run.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import redis.asyncio as aioredis
import typer
from prometheus_client import CollectorRegistry

from indexer.events import EventBatch, encode_message
from indexer.index import RedisIndex
from indexer.index.base import batch_blocks
from indexer.ingest import IngestConfig, Ingester
from indexer.ingest_metrics import IngestMetrics
from indexer.registry import RedisHostRegistry
from indexer.wire import EVENT_FIELD, Keyspace
from kvrouter.embedded_redis import EmbeddedRedis
from kvrouter.tools.index_bench import FORMAT, ingest_batches, ingest_rate
from kvrouter.tools.table import Row, report

__all__ = ["main", "run"]


async def ingester_rate(work: list[list[EventBatch]], read_count: int) -> float:
    """Block-events/s of one ingester draining pre-filled streams into a Redis index."""
    events = sum(batch_blocks(b) for hb in work for b in hb)
    total = sum(len(hb) for hb in work)
    keyspace = Keyspace()
    with EmbeddedRedis() as server:
        client = aioredis.Redis.from_url(server.url)
        registry = RedisHostRegistry(client, keyspace)
        for host_batches in work:
            host = host_batches[0].host
            await registry.get_or_create(host)
            await client.set(keyspace.heartbeat(host), b"bench", px=3_600_000)
            pipe = client.pipeline(transaction=False)
            for b in host_batches:
                pipe.xadd(keyspace.events(host), {EVENT_FIELD: encode_message(b)})
            await pipe.execute()
        index = RedisIndex(server.url, keyspace)
        await index.stats()
        metrics = IngestMetrics(CollectorRegistry())
        config = IngestConfig(replica_id="bench", read_count=read_count, block_ms=20)
        ingester = Ingester(server.url, index, keyspace=keyspace, config=config, metrics=metrics)
        start = time.perf_counter()
        while metrics.batch_count("applied") < total:
            await ingester.step()
        elapsed = time.perf_counter() - start
        await ingester.stop()
        await index.close()
        await client.aclose()
    return events / elapsed


async def run(hosts: int = 64, batches: int = 30, per_batch: int = 128, read_count: int = 256,
              repeat: int = 3, seed: int = 1) -> list[Row]:  # fmt: skip
    """Both paths, alternating ``repeat`` times on fresh servers; each keeps its best round."""
    work = ingest_batches(hosts, batches, per_batch, seed)
    rounds = [
        (await ingester_rate(work, read_count), (await ingest_rate("ours", work))[0])
        for _ in range(repeat)
    ]
    ours = max(r[0] for r in rounds)
    direct = max(r[1] for r in rounds)
    label = (
        f"ingester (XREAD {read_count}/stream, decode, apply, positions), {hosts} hosts' streams "
        f"pre-filled with {batches} batches of {per_batch} block events (best of {repeat})"
    )
    return [
        Row(label, "block-events/s", ours, direct, "RedisIndex.apply directly, hosts concurrently",
            section="ingest"),
    ]  # fmt: skip


def main(
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write rows here.")] = None,
    hosts: Annotated[int, typer.Option(help="Synthetic hosts (streams).")] = 64,
    batches: Annotated[int, typer.Option(help="Batches per host.")] = 30,
    per_batch: Annotated[int, typer.Option(help="Block events per batch.")] = 128,
    read_count: Annotated[int, typer.Option(help="Entries per stream per XREAD.")] = 256,
    repeat: Annotated[int, typer.Option(help="Rounds of each path (best kept).")] = 3,
    seed: Annotated[int, typer.Option(help="Random seed of the generated events.")] = 1,
) -> None:
    """Measure the ingester's block-events/s beside direct apply, same events, same run."""
    started = time.perf_counter()
    rows = asyncio.run(run(hosts, batches, per_batch, read_count, repeat, seed))
    report(rows, FORMAT, started=started, json_path=json_path)


if __name__ == "__main__":
    typer.run(main)
