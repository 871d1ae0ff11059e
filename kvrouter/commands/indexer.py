"""``kvrouter indexer`` (run an ingester replica) and ``kvrouter index audit``."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

__all__ = ["index_app", "register"]

index_app = typer.Typer(help="Inspect the global KV index.", no_args_is_help=True)


def indexer(
    redis: Annotated[str, typer.Option("--redis", help="Redis URL of streams and index")] = "",
    key_prefix: Annotated[str, typer.Option(help="Redis key prefix")] = "",
    replica_id: Annotated[
        str, typer.Option(help="Replica name (default hostname-pid-random)")
    ] = "",
    metrics_port: Annotated[int | None, typer.Option(help="HTTP port of /metrics")] = None,
    bind: Annotated[str, typer.Option(help="Address of the HTTP side")] = "",
    log_level: Annotated[str, typer.Option(help="Log level")] = "info",
) -> None:
    """Consume the workers' event streams into the index (settings also from KVINDEX_*)."""
    from indexer.ingest_service import IndexerSettings, create_app
    from kvrouter.graceful import serve as serve_app
    from kvrouter.logs import configure_logging

    given: dict[str, Any] = {
        "redis_url": redis, "key_prefix": key_prefix, "replica_id": replica_id,
        "metrics_port": metrics_port, "bind": bind,
    }  # fmt: skip
    settings = IndexerSettings(**{k: v for k, v in given.items() if v not in (None, "")})
    configure_logging("indexer", log_level)
    serve_app(create_app(settings), host=settings.bind, port=settings.metrics_port, drain_s=5.0)


@index_app.command("audit")
def audit_command(
    redis: Annotated[str, typer.Option("--redis", help="Redis URL of the index")],
    internal_token: Annotated[
        str, typer.Option(help="The workers' internal token", envvar="KVWORKER_INTERNAL_TOKEN")
    ] = "",
    retries: Annotated[int, typer.Option(min=0, help="Re-checks of hosts that differ")] = 3,
    interval: Annotated[float, typer.Option(min=0.0, help="Seconds between re-checks")] = 1.0,
    key_prefix: Annotated[str, typer.Option(help="Redis key prefix")] = "kvr",
    samples: Annotated[int, typer.Option(min=0, help="Sample keys shown per difference")] = 3,
) -> None:
    """Compare each live worker's blocks (GET /kv/keys) with the index; exit 1 if any differ."""
    from redis.exceptions import RedisError
    from rich.console import Console

    from indexer.audit import audit, render
    from indexer.index import KVIndexError, RedisIndex
    from indexer.ingest_reader import open_client
    from indexer.wire import Keyspace

    async def run() -> bool:
        keyspace = Keyspace(key_prefix)
        client = await open_client(redis)
        index = RedisIndex(client, keyspace)
        try:
            report = await audit(client, index, keyspace=keyspace,
                                 internal_token=internal_token or None, retries=retries,
                                 interval_s=interval)  # fmt: skip
        finally:
            await client.aclose()
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)
        console.print(render(report, samples))
        return report.ok

    try:
        ok = asyncio.run(run())
    except (KVIndexError, RedisError, OSError, ValueError) as exc:
        typer.echo(f"audit failed: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    raise typer.Exit(code=0 if ok else 1)


def register(app: typer.Typer) -> None:
    """Add ``indexer`` and the ``index`` group to the CLI."""
    app.command("indexer")(indexer)
    app.add_typer(index_app, name="index")
