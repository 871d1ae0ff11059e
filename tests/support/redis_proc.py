"""A throwaway ``redis-server`` on a free loopback port.

Tests talk to a real Redis, never a mock; each session gets its own server
so nothing touches the machine's shared Redis on 6379. ``stop``/``start``
let fault tests restart it on the same port (data lost, as in production
without persistence).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["RedisProcess", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisProcess:
    """One redis-server process; ``url`` stays the same across restarts."""

    def __init__(self, port: int | None = None, *, extra_args: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install Redis 7 to run the tests")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = extra_args
        self.dir = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if self._ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer in {timeout}s")

    def _ping(self) -> bool:
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
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Stop then start on the same port."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop and remove the working directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
