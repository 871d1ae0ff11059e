"""Real HTTP servers on loopback for tests: an app in a uvicorn thread, or a CLI subprocess."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.types import ASGIApp

from kvrouter.embedded_redis import free_port

__all__ = ["ServerProcess", "free_port_run", "serve_app", "wait_http"]


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1, below the ephemeral range.

    For a command that takes a first port and counts up (``kvrouter up --worker-port``):
    a port from :func:`free_port` is an ephemeral one, and the ports after it can be taken
    at any moment by the outgoing connections of every other process on the machine.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, max(10_001, low - n))
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200 (or raise after ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s ({last})")


@contextmanager
def serve_app(app: ASGIApp, port: int | None = None, timeout: float = 120.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    with running_server(app, port, timeout) as (base, _, _):
        yield base


@contextmanager
def running_server(
    app: ASGIApp,
    port: int | None = None,
    timeout: float = 120.0,
    server_cls: Callable[[uvicorn.Config, Any], uvicorn.Server] | None = None,
) -> Iterator[tuple[str, uvicorn.Server, threading.Thread]]:
    """Run ``app`` on 127.0.0.1 in a thread (``server_cls(config, app)``, plain uvicorn by
    default); yields its base URL, the server and the thread serving it."""
    port = port or free_port()
    # A bounded graceful shutdown: a request still open after it is cancelled, so the app's
    # lifespan shutdown (a worker's heartbeat stop) always runs and nothing outlives the test.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
        timeout_graceful_shutdown=10,
    )  # fmt: skip
    server = uvicorn.Server(config) if server_cls is None else server_cls(config, app)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"server on port {port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {port} did not start in {timeout}s")
            time.sleep(0.02)
        yield base, server, thread
    finally:
        server.should_exit = True
        thread.join(60)
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident or 0)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            raise RuntimeError(f"the server on port {port} did not stop within 60 s; at:\n{stack}")


class ServerProcess:
    """A ``kvrouter`` CLI command in its own process group (killable with SIGKILL).

    ``python`` is the interpreter that runs it (another venv's, say); this one by default.
    ``program`` runs another server instead (a peer router's binary): ``[*program, *args]``.
    """

    def __init__(self, args: Sequence[str], *, health_url: str, log_path: Path,
                 env: dict[str, str] | None = None, python: str = sys.executable,
                 program: Sequence[str] | None = None) -> None:  # fmt: skip
        prefix = list(program) if program is not None else [python, "-m", "kvrouter"]
        self.args = [*prefix, *args]
        self.health_url = health_url
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> ServerProcess:
        """Start and wait until healthy."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        try:
            wait_http(self.health_url, timeout, self.proc)
        except Exception:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group (no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    def logs(self) -> str:
        """What the process printed."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextmanager
def tcp_listener(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A loopback TCP listener handing each connection to ``handle`` (then closing it) on
    a thread; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    # Closing a socket does not wake a thread blocked in its accept(): poll a flag.
    listener.settimeout(0.05)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with conn:
                handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(10)
        assert not thread.is_alive()
        listener.close()
