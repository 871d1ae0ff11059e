"""``kvrouter serve``: run one gateway replica."""

from __future__ import annotations

from typing import Annotated, Any

import typer

__all__ = ["register"]


def serve(
    port: Annotated[int | None, typer.Option(help="HTTP port")] = None,
    bind: Annotated[str, typer.Option(help="Address to listen on")] = "",
    model: Annotated[
        list[str] | None, typer.Option(help="Model spec whose tokenizer to load (repeatable)")
    ] = None,
    redis: Annotated[str, typer.Option("--redis", help="Redis URL (index + registry)")] = "",
    worker: Annotated[list[str] | None, typer.Option(help="Static worker URL (repeatable)")] = None,
    policy: Annotated[str, typer.Option(help="Routing policy")] = "",
    pd: Annotated[str, typer.Option(help="Prefill/decode split: never | always | auto")] = "",
    pooling: Annotated[
        bool | None,
        typer.Option("--pooling/--no-pooling", help="kv_ttft pulls a peer's longer prefix [on]"),
    ] = None,
    block_size: Annotated[int | None, typer.Option(help="Tokens per KV block")] = None,
    key_prefix: Annotated[str, typer.Option(help="Redis key prefix")] = "",
    log_level: Annotated[str, typer.Option(help="Log level")] = "info",
) -> None:
    """Run the OpenAI-compatible gateway (settings also from KVROUTER_* variables)."""
    from kvrouter.gateway.app import create_app
    from kvrouter.gateway.settings import RouterSettings
    from kvrouter.graceful import serve as serve_app
    from kvrouter.logs import configure_logging

    given: dict[str, Any] = {
        "port": port, "bind": bind, "models": model, "redis_url": redis, "workers": worker,
        "policy": policy, "block_size": block_size, "key_prefix": key_prefix, "pd": pd,
        "pooling": pooling,
    }  # fmt: skip
    settings = RouterSettings(**{k: v for k, v in given.items() if v not in (None, "", [])})
    configure_logging("gateway", log_level)
    serve_app(
        create_app(settings), host=settings.bind, port=settings.port,
        drain_s=settings.drain_s, keep_alive_s=settings.keep_alive_s,
    )  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the CLI."""
    app.command("serve")(serve)
