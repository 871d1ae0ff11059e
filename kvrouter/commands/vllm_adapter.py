"""``kvrouter vllm-adapter``: put a vLLM engine into the global index as one host.

vLLM publishes its KV cache events when started with, for example::

    vllm serve MODEL --kv-events-config \\
      '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'

This command subscribes to that publisher (one data-parallel rank per
adapter; rank r publishes on the endpoint's port + r), keys the blocks as
our workers do (:mod:`indexer.vllm_adapter`), and heartbeats the engine's
view, so that gateways discover and route to it like any worker. SIGINT or
SIGTERM stops it and withdraws the heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated

import typer

__all__ = ["register"]

log = logging.getLogger("kvrouter.vllm_adapter")


def vllm_adapter(
    endpoint: Annotated[str, typer.Option(help="vLLM's KV events PUB endpoint to connect to")],
    host: Annotated[str, typer.Option("--host", help="The engine's name in the index")],
    model: Annotated[
        str, typer.Option(help="Served model name, as clients send it (the root of block keys)")
    ],
    url: Annotated[str, typer.Option(help="The engine's OpenAI base URL, for discovery")],
    redis: Annotated[str, typer.Option("--redis", help="Redis URL of the index")] = (
        "redis://127.0.0.1:6379/0"
    ),
    replay_endpoint: Annotated[
        str, typer.Option(help="vLLM's ROUTER replay endpoint (recovers missed batches)")
    ] = "",
    topic: Annotated[str, typer.Option(help="Topic to subscribe to ('' for all)")] = "",
    block_size: Annotated[int, typer.Option(min=1, help="vLLM's block size (the cluster's)")] = 16,
    hbm_blocks: Annotated[
        int, typer.Option(min=0, help="The engine's GPU KV blocks, for routers (0: unknown)")
    ] = 0,
    dram_blocks: Annotated[int, typer.Option(min=0, help="Its CPU offload blocks")] = 0,
    async_loads: Annotated[
        bool,
        typer.Option(
            help="Its CPU offloading brings blocks back beside the steps (vLLM's "
            "OffloadingConnector does), so a load delays only its own request; off: "
            "the step that loads them waits (routers price it as a stall)"
        ),
    ] = False,
    key_prefix: Annotated[str, typer.Option(help="Redis key prefix")] = "kvr",
    heartbeat_interval: Annotated[float, typer.Option(min=0.05, help="Seconds")] = 1.0,
    heartbeat_ttl: Annotated[float, typer.Option(min=0.1, help="Seconds")] = 5.0,
    log_level: Annotated[str, typer.Option(help="Log level")] = "info",
) -> None:
    """Feed a vLLM engine's KV events (ZMQ) into the index and heartbeat it for discovery."""
    from indexer.index import RedisIndex
    from indexer.ingest_reader import open_client
    from indexer.media import Medium
    from indexer.views import WorkerView
    from indexer.vllm_adapter import VllmAdapter, VllmTranslator
    from indexer.wire import Keyspace
    from kvrouter.logs import configure_logging

    if heartbeat_ttl <= heartbeat_interval:
        raise typer.BadParameter("--heartbeat-ttl must exceed --heartbeat-interval")
    configure_logging("vllm-adapter", log_level)
    capacity = {m: n for m, n in ((Medium.HBM, hbm_blocks), (Medium.DRAM, dram_blocks)) if n}
    view = WorkerView(
        host=host, url=url.rstrip("/"), model=model, block_size=block_size,
        kv_capacity_blocks=capacity, async_loads=async_loads,
    )  # fmt: skip

    async def run() -> None:
        keyspace = Keyspace(key_prefix)
        client = await open_client(redis)
        index = RedisIndex(client, keyspace)
        adapter = VllmAdapter(
            index, host, VllmTranslator(model, block_size), endpoint=endpoint,
            replay_endpoint=replay_endpoint or None, topic=topic, heartbeat=(client, view),
            keyspace=keyspace, heartbeat_interval_s=heartbeat_interval,
            heartbeat_ttl_s=heartbeat_ttl,
        )  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await adapter.start()
            log.info("vLLM engine %s (%s, model %s): events from %s into %s", host, url, model,
                     endpoint, redis)  # fmt: skip
            await stop.wait()
            s = adapter.stats
            log.info("stopping: %d batches, %d applied, %d replays, %d lost, %d resyncs",
                     s.batches, s.applied, s.replays, s.lost, s.resyncs)  # fmt: skip
        finally:
            await adapter.stop()
            await index.close()
            await client.aclose()

    asyncio.run(run())


def register(app: typer.Typer) -> None:
    """Add ``vllm-adapter`` to the CLI."""
    app.command("vllm-adapter")(vllm_adapter)
