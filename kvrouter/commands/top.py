"""``kvrouter top``: a live terminal view of a running cluster.

Grafana is where a deployed cluster is watched; ``kvrouter top`` is the same
look from a laptop: workers from the Redis registry and heartbeats (role,
load, KV blocks per medium), their ``/metrics`` (hit rate, TTFT, step
time), the gateways' TTFT observed vs predicted and the indexer's lag.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

import typer

__all__ = ["register"]


def top(
    redis: Annotated[
        str, typer.Option("--redis", envvar="KVROUTER_REDIS_URL", help="The cluster's Redis URL")
    ],
    gateway: Annotated[
        list[str] | None,
        typer.Option("--gateway", help="Gateway base URL (repeat for each replica)"),
    ] = None,
    indexer: Annotated[
        str, typer.Option("--indexer", help="Indexer metrics URL (http://host:8090)")
    ] = "",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit")] = False,
) -> None:
    """Show workers, hit rates, TTFT and index lag of a running cluster, refreshing."""
    from rich.console import Console
    from rich.live import Live

    from kvrouter.commands.up import masked
    from kvrouter.ops.cluster import take_frame
    from kvrouter.ops.top import Frame, render

    gateways = list(gateway or [])
    console = Console()

    async def frame() -> Frame:
        return await take_frame(redis, gateways, indexer or None, display_redis=masked(redis))

    if once:
        console.print(render(asyncio.run(frame())))
        return

    async def loop() -> None:
        previous = await frame()
        with Live(render(previous), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval)
                current = await frame()
                live.update(render(current, previous), refresh=True)
                previous = current

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(loop())


def register(app: typer.Typer) -> None:
    """Add ``top`` to the CLI."""
    app.command("top")(top)
