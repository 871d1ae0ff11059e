"""``kvrouter up``: the whole system on one machine, as one process tree.

    embedded Redis  <- events, heartbeats, index
    kvrouter indexer            (consumes the workers' event streams)
    kvrouter worker x N         (ports worker_port, worker_port + 1, ...)
    kvrouter serve              (the gateway, on --port)

Ctrl-C (or SIGTERM) stops everything: children in reverse order, then
Redis. Children die with this process even if it is killed. The Redis URL
and a generated internal token (workers require it on every route but
``/health`` and ``/metrics``; kept in ``LOG_DIR/internal-token``, mode 0600)
reach the children through their environment, not their command lines.
A child that exits is started again after a back-off, and so is the
embedded Redis (empty: the workers resend their blocks); ``--no-restart``
stops everything instead when the indexer, the gateway or Redis exits.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlsplit, urlunsplit

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from kvrouter.embedded_redis import EmbeddedRedis

__all__ = ["register"]

log = logging.getLogger(__name__)


def up(
    workers: Annotated[int, typer.Option(min=0, help="Workers that prefill and decode")] = 2,
    prefill_workers: Annotated[int, typer.Option(min=0, help="Prefill-only workers")] = 0,
    decode_workers: Annotated[int, typer.Option(min=0, help="Decode-only workers")] = 0,
    pd: Annotated[str, typer.Option(help="Prefill/decode split: never | always | auto")] = "",
    pooling: Annotated[
        bool, typer.Option("--pooling/--no-pooling", help="Workers pull a peer's longer prefix")
    ] = True,
    runner: Annotated[str, typer.Option(help="torch (real model) | sim (timing model)")] = "torch",
    profile: Annotated[
        str,
        typer.Option(
            help="sim workers' timing profiles, packaged names or files; several, "
            "comma-separated: a mixed fleet, the workers taking them in turn "
            "(e.g. llama3_8b_h100,llama3_8b_a100)"
        ),
    ] = "",
    model: Annotated[str, typer.Option(help="smollm2 | tiny | .gguf file | HF directory")] = (
        "smollm2"
    ),
    port: Annotated[int, typer.Option(help="Gateway port")] = 8000,
    worker_port: Annotated[int, typer.Option(help="First worker port")] = 8100,
    indexer_port: Annotated[int, typer.Option(help="Indexer metrics port")] = 8090,
    redis: Annotated[str, typer.Option("--redis", help="Use this Redis instead of one")] = "",
    policy: Annotated[str, typer.Option(help="Routing policy")] = "kv_ttft",
    hbm_blocks: Annotated[int, typer.Option(help="HBM KV blocks per worker")] = 1024,
    dram_blocks: Annotated[int, typer.Option(help="DRAM KV blocks per worker")] = 2048,
    ssd_blocks: Annotated[int, typer.Option(help="SSD KV blocks per worker (0 = off)")] = 0,
    log_dir: Annotated[Path, typer.Option(help="Where children write their logs")] = Path("var/up"),
    start_timeout: Annotated[float, typer.Option(help="Seconds to wait for health")] = 600.0,
    drain_s: Annotated[
        float, typer.Option(min=0.0, help="On Ctrl-C: seconds in-flight requests may finish")
    ] = 10.0,
    restart: Annotated[
        bool,
        typer.Option(
            help="Start a process that exits again, after a back-off (1 s to 30 s); "
            "--no-restart stops everything when the indexer or gateway exits"
        ),
    ] = True,
) -> None:
    """Start Redis, the indexer, N workers and the gateway; Ctrl-C stops them all."""
    from rich.console import Console

    from kvrouter.commands.worker import torch_missing
    from kvrouter.embedded_redis import EmbeddedRedis
    from kvrouter.logs import configure_logging
    from kvrouter.supervisor import Supervisor

    problem = torch_missing(runner)
    if problem is not None:
        typer.echo(f"kvrouter up: {problem}", err=True)
        raise typer.Exit(code=2)
    profiles = [p.strip() for p in profile.split(",") if p.strip()]
    if profiles:
        from engine_worker.profiles import ProfileError, load_fleet

        if runner != "sim":
            typer.echo("kvrouter up: --profile sets the sim runner's timing model; "
                       "add --runner sim", err=True)  # fmt: skip
            raise typer.Exit(code=2)
        try:
            load_fleet(profiles)
        except ProfileError as exc:
            typer.echo(f"kvrouter up: {exc}", err=True)
            raise typer.Exit(code=2) from exc
    configure_logging("up", "info")
    console = Console(stderr=True)
    embedded = None if redis else EmbeddedRedis()
    if embedded is not None:
        embedded.start()
        assert embedded.proc is not None
        log.info("started redis (pid %d) at %s", embedded.proc.pid, embedded.url)
    redis_url = redis or (embedded.url if embedded else "")
    token = os.environ.get("KVWORKER_INTERNAL_TOKEN") or secrets.token_urlsafe(24)
    log_dir.mkdir(parents=True, exist_ok=True)
    token_file = log_dir / "internal-token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    # Secrets travel in the children's environment, never on their command lines
    # (which every local user can read in /proc): the Redis URL may hold a password.
    sup = Supervisor(
        log_dir,
        env={
            "KVINDEX_REDIS_URL": redis_url, "KVWORKER_REDIS_URL": redis_url,
            "KVROUTER_REDIS_URL": redis_url,
            "KVWORKER_INTERNAL_TOKEN": token, "KVROUTER_INTERNAL_TOKEN": token,
            # Children drain for drain_s on SIGTERM; stop_all waits a little longer.
            "KVWORKER_DRAIN_S": str(drain_s), "KVROUTER_DRAIN_S": str(drain_s),
        },
    )  # fmt: skip
    py = [sys.executable, "-m", "kvrouter"]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        indexer = sup.spawn(
            "indexer",
            [*py, "indexer", "--metrics-port", str(indexer_port)],
            f"http://127.0.0.1:{indexer_port}/metrics",
        )
        pool = []
        roles = ["both"] * workers + ["prefill"] * prefill_workers + ["decode"] * decode_workers
        if not roles:
            raise RuntimeError("no worker to start: give --workers, --prefill-workers or both")
        split = pd or ("always" if prefill_workers and decode_workers else "never")
        for i, role in enumerate(roles):
            wport = worker_port + i
            args = [
                *py, "worker", "--model", model, "--runner", runner, "--port", str(wport),
                "--name", f"worker-{i}", "--role", role,
                "--hbm-blocks", str(hbm_blocks), "--dram-blocks", str(dram_blocks),
            ]  # fmt: skip
            if profiles:
                args += ["--profile", profiles[i % len(profiles)]]
            if ssd_blocks:
                ssd_dir = log_dir / f"ssd-worker-{i}"
                args += ["--ssd-blocks", str(ssd_blocks), "--ssd-path", str(ssd_dir)]
            pool.append(sup.spawn(f"worker-{i}", args, f"http://127.0.0.1:{wport}/health"))
        gateway = sup.spawn(
            "gateway",
            [*py, "serve", "--port", str(port), "--model", model, "--policy", policy,
             "--pd", split, "--pooling" if pooling else "--no-pooling"],
            f"http://127.0.0.1:{port}/ready",
        )  # fmt: skip
        with console.status(f"starting {len(roles)} {runner} workers ({model})..."):
            sup.wait_healthy([indexer, *pool, gateway], start_timeout)
        console.print(
            f"[bold green]kvrouter is up[/]: gateway http://127.0.0.1:{port}/v1 "
            f"({len(roles)} workers, policy {policy}, pd {split}, Redis {masked(redis_url)}); "
            f"logs in {log_dir}/\n"
            f"Try: curl -s http://127.0.0.1:{port}/v1/models   (Ctrl-C stops everything)\n"
            f"Audit the index: KVWORKER_INTERNAL_TOKEN=$(cat {token_file}) "
            f"kvrouter index audit --redis {masked(redis_url)}"
        )
        redis_back = _RedisRevival(embedded, console) if embedded is not None else None
        while not stopping:
            if restart:
                for child in sup.revive():
                    console.print(
                        f"[yellow]{child.name} exited; started it again[/] "
                        f"(restart {child.restarts}, logs in {child.log_path})"
                    )
                if redis_back is not None:
                    redis_back.poll()
            else:
                dead = [c.name for c in sup.dead()]
                if embedded is not None and embedded.proc and embedded.proc.poll() is not None:
                    dead.append("redis")
                if set(dead) & {indexer.name, gateway.name, "redis"}:
                    console.print(f"[red]{', '.join(dead)} exited; stopping[/]")
                    code = 1
                    break
            time.sleep(0.5)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]start-up failed:[/] {exc}")
        code = 1
    finally:
        console.print("stopping...")
        sup.stop_all(grace_s=drain_s + 5.0)
        if embedded is not None:
            embedded.close()
    raise typer.Exit(code)


class _RedisRevival:
    """Starts the embedded Redis again when it exits, on the same port, after a back-off
    (1 s, doubling to 30 s while starts fail). Its data is gone (it keeps nothing on
    disk): the workers resend snapshots when Redis answers again and the indexer and
    the gateways' mirrors rebuild from them, as after any Redis restart; meanwhile the
    gateway routes on load alone."""

    def __init__(self, embedded: EmbeddedRedis, console: Console) -> None:
        self.embedded = embedded
        self.console = console
        self.backoff = 1.0
        self.next_try = 0.0
        self.restarts = 0

    def poll(self) -> None:
        """Start Redis again if it exited and its back-off has passed."""
        proc = self.embedded.proc
        if proc is None or proc.poll() is None or time.monotonic() < self.next_try:
            return
        status = proc.returncode
        try:
            self.embedded.start()
        except RuntimeError as exc:
            log.warning("redis exited (status %s) and did not start again: %s", status, exc)
            self.next_try = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, 30.0)
            return
        self.restarts += 1
        self.backoff = 1.0
        assert self.embedded.proc is not None
        log.info("started redis (pid %d) at %s", self.embedded.proc.pid, self.embedded.url)
        self.console.print(
            f"[yellow]redis exited with status {status}; started it again[/] (restart "
            f"{self.restarts}; its data is lost: the workers resend their blocks)"
        )


def masked(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def register(app: typer.Typer) -> None:
    """Add ``up`` to the CLI."""
    app.command("up")(up)
