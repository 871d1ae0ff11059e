"""A small process supervisor for ``kvrouter up``: start children, wait until healthy,
restart the ones that exit, stop all.

Children run in their own process groups and, on Linux, get SIGTERM if
this process dies (``PR_SET_PDEATHSIG``), so a crashed or killed ``up``
leaves no orphans. Shutdown sends SIGTERM to every group, waits, then
SIGKILLs what is left.

A child that exits while the system runs (a worker killed by the OOM killer,
or one whose engine loop died: it exits with status 1 to be restarted) is
started again after a back-off, as Kubernetes restarts a container: 1 s, then
doubling up to 30 s while it keeps exiting within a minute of its start, and
back to 1 s once it has run for a minute (:meth:`Supervisor.revive`).
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
    #: When the process last started (monotonic seconds).
    started_at: float = 0.0
    #: How many times it was started again after exiting.
    restarts: int = 0
    #: While it is dead: when it starts again (None: its exit is not seen yet).
    restart_at: float | None = None
    #: The back-off before its next start again, in seconds.
    backoff_s: float = 0.0

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

    #: Back-off before a dead child starts again: ``min``, doubling while it keeps
    #: exiting within ``stable_s`` of its start, at most ``max``.
    backoff_min_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0

    def spawn(self, name: str, args: Sequence[str], health_url: str | None = None) -> Child:
        """Start ``args`` (stdout/stderr to ``log_dir/name.log``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, list(args), health_url, self.log_dir / f"{name}.log")
        self._start(child, time.monotonic())
        self.children.append(child)
        return child

    def _start(self, child: Child, now: float) -> None:
        with child.log_path.open("ab") as out:
            child.proc = subprocess.Popen(
                child.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=die_with_parent,
            )
        child.started_at = now
        log.info("started %s (pid %d), logs in %s", child.name, child.proc.pid, child.log_path)

    def revive(self, now: float | None = None) -> list[Child]:
        """Start again the children that exited, each after its back-off; returns those
        started now. Call it periodically while the system runs (``now``: monotonic
        seconds, the clock's by default)."""
        now = time.monotonic() if now is None else now
        started = []
        for child in self.children:
            if child.alive or child.proc is None:
                continue
            if child.restart_at is None:
                ran = now - child.started_at
                if ran >= self.stable_s or child.backoff_s <= 0:
                    child.backoff_s = self.backoff_min_s
                else:
                    child.backoff_s = min(child.backoff_s * 2, self.backoff_max_s)
                child.restart_at = now + child.backoff_s
                log.warning(
                    "%s (pid %d) exited with status %s after %.0f s; starting it again in "
                    "%.0f s (see %s)", child.name, child.proc.pid, child.proc.returncode, ran,
                    child.backoff_s, child.log_path,
                )  # fmt: skip
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                self._start(child, now)
                started.append(child)
        return started

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
