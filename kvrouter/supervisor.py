"""A small process supervisor for ``kvrouter up``: start children, wait until healthy, stop all.

Children run in their own process groups and, on Linux, get SIGTERM if
this process dies (``PR_SET_PDEATHSIG``), so a crashed or killed ``up``
leaves no orphans. Shutdown sends SIGTERM to every group, waits, then
SIGKILLs what is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["Child", "Supervisor", "die_with_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """``preexec_fn``: own process group, and (Linux) SIGTERM when the parent dies.

    NOTE: Linux delivers the signal when the *thread* that spawned the child
    exits, so spawn long-lived children from the main thread.
    """
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class Child:
    """One supervised process."""

    name: str
    args: list[str]
    health_url: str | None
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None


@dataclass(slots=True)
class Supervisor:
    """Starts and stops a set of children."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, args: Sequence[str], health_url: str | None = None) -> Child:
        """Start ``args`` (stdout/stderr to ``log_dir/name.log``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, list(args), health_url, self.log_dir / f"{name}.log")
        with child.log_path.open("ab") as out:
            child.proc = subprocess.Popen(
                child.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=die_with_parent,
            )
        self.children.append(child)
        log.info("started %s (pid %d), logs in %s", name, child.proc.pid, child.log_path)
        return child

    def wait_healthy(self, children: Sequence[Child], timeout: float) -> None:
        """Wait until every child's health URL answers 200; raise if one exits or time runs out."""
        deadline = time.monotonic() + timeout
        pending = [c for c in children if c.health_url]
        while pending:
            for c in list(pending):
                if not c.alive:
                    tail = c.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{c.name} exited during start-up:\n{tail}")
                try:
                    assert c.health_url is not None
                    if httpx.get(c.health_url, timeout=1.0).status_code == 200:
                        pending.remove(c)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names}")
            if pending:
                time.sleep(0.2)

    def dead(self) -> list[Child]:
        """Children that exited."""
        return [c for c in self.children if not c.alive]

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group (newest first), then SIGKILL stragglers."""
        for c in reversed(self.children):
            if c.alive and c.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", c.name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(5)
