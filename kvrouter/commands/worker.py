"""``kvrouter worker``: run one inference worker."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["register", "torch_missing"]


def torch_missing(runner: str) -> str | None:
    """Why ``runner`` cannot run here, or None: the torch runner needs the ``worker`` extra.

    Checked before anything starts, so that a router-only install (``pip install
    kvrouter``, the router image) says what to do instead of failing deep in start-up.
    """
    if runner != "torch" or importlib.util.find_spec("torch") is not None:
        return None
    return (
        "the torch runner needs torch, which is not installed: "
        "pip install 'kvrouter[worker]' (or use --runner sim)"
    )


def worker(
    model: Annotated[str, typer.Option(help="smollm2 | tiny | .gguf file | HF directory")] = "",
    runner: Annotated[str, typer.Option(help="torch (real model) | sim (timing model)")] = "",
    port: Annotated[int | None, typer.Option(help="HTTP port")] = None,
    bind: Annotated[str, typer.Option(help="Address to listen on")] = "",
    name: Annotated[str, typer.Option(help="Worker name (default worker-PORT)")] = "",
    redis: Annotated[str, typer.Option("--redis", help="Redis URL for events/heartbeats")] = "",
    block_size: Annotated[int | None, typer.Option(help="Tokens per KV block")] = None,
    hbm_blocks: Annotated[int | None, typer.Option(help="HBM KV blocks")] = None,
    dram_blocks: Annotated[int | None, typer.Option(help="DRAM KV blocks (0 = off)")] = None,
    ssd_blocks: Annotated[int | None, typer.Option(help="SSD KV blocks (0 = off)")] = None,
    ssd_path: Annotated[Path | None, typer.Option(help="Directory of the SSD tier")] = None,
    device: Annotated[str, typer.Option(help="torch device of the model and HBM tier")] = "",
    max_num_seqs: Annotated[int | None, typer.Option(help="Requests per step")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Tokens per step")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length (0 = model's)")] = None,
    profile: Annotated[str, typer.Option(help="sim: timing profile name or JSON")] = "",
    time_scale: Annotated[float | None, typer.Option(help="sim: scale modeled times")] = None,
    role: Annotated[str, typer.Option(help="prefill | decode | both")] = "",
    key_prefix: Annotated[str, typer.Option(help="Redis key prefix")] = "",
    vllm_events: Annotated[
        str, typer.Option(help="Bind vLLM-format KV events here (ZMQ PUB, e.g. tcp://*:5557)")
    ] = "",
    vllm_events_replay: Annotated[
        str, typer.Option(help="Bind the vLLM events replay socket here (e.g. tcp://*:5558)")
    ] = "",
    log_level: Annotated[str, typer.Option(help="Log level")] = "info",
) -> None:
    """Run one worker (settings also come from KVWORKER_* environment variables)."""
    from engine_worker.server import create_app
    from engine_worker.settings import WorkerSettings
    from kvrouter.graceful import serve as serve_app
    from kvrouter.logs import configure_logging

    given: dict[str, Any] = {
        "model": model, "runner": runner, "port": port, "bind": bind, "name": name,
        "redis_url": redis, "block_size": block_size, "hbm_blocks": hbm_blocks,
        "dram_blocks": dram_blocks, "ssd_blocks": ssd_blocks, "ssd_path": ssd_path,
        "device": device, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
        "profile": profile, "time_scale": time_scale, "role": role, "key_prefix": key_prefix,
        "vllm_events_endpoint": vllm_events, "vllm_events_replay_endpoint": vllm_events_replay,
    }  # fmt: skip
    settings = WorkerSettings(**{k: v for k, v in given.items() if v not in (None, "")})
    problem = torch_missing(settings.runner)
    if problem is not None:
        typer.echo(f"kvrouter worker: {problem}", err=True)
        raise typer.Exit(code=2)
    configure_logging("worker", log_level)
    serve_app(
        create_app(settings), host=settings.bind, port=settings.port,
        drain_s=settings.drain_s, keep_alive_s=settings.keep_alive_s,
    )  # fmt: skip


def register(app: typer.Typer) -> None:
    """Add ``worker`` to the CLI."""
    app.command("worker")(worker)
