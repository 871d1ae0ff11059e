"""``kvrouter up`` starts the whole system and leaves nothing behind when stopped."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner

from engine_worker.profiles import load_profile
from indexer.audit import AuditReport, audit
from indexer.index import RedisIndex
from indexer.wire import Keyspace
from kvrouter import embedded_redis
from kvrouter.bench.live import cluster_views
from kvrouter.cli import app
from kvrouter.embedded_redis import free_port
from tests.support.servers import free_port_run, wait_http

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """``kvrouter up`` with sim workers; killed (with its tree) if a test leaves it running."""
    proc, port, log = start_up(tmp_path)
    try:
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    log = tmp_path / "up.log"
    args = [
        sys.executable, "-m", "kvrouter", "up", "--workers", "2", "--runner", "sim",
        "--model", "tiny", "--port", str(port), "--worker-port", str(free_port_run(2)),
        "--indexer-port", str(free_port()), "--log-dir", str(tmp_path / "logs"), *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/ready", timeout=120, proc=proc)
    return proc, port, log


def child_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"\(pid (\d+)\)", log.read_text())]


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_up_serves_and_ctrl_c_stops_every_process(
    started: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, port, log = started
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": "hello there", "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200
    processes = child_pids(log)
    assert len(processes) == 5  # redis, indexer, 2 workers, gateway
    assert all(alive(p) for p in processes)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert wait_gone(processes) == []


def test_up_keeps_secrets_off_command_lines_and_workers_behind_a_token(
    started: tuple[subprocess.Popen[bytes], int, Path], tmp_path: Path
) -> None:
    """Every local user can read /proc/PID/cmdline: the Redis URL (it may hold a password)
    and the internal token must not be there, and a worker port must not serve without it."""
    proc, _, log = started
    processes = child_pids(log)
    token_file = tmp_path / "logs" / "internal-token"
    token = token_file.read_text()
    assert len(token) >= 24
    assert token_file.stat().st_mode & 0o777 == 0o600
    for pid in processes:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "redis://" not in cmdline or cmdline.startswith("redis-server"), cmdline
        assert token not in cmdline
    worker_ports = [
        int(args[args.index("--port") + 1])
        for pid in processes
        if "worker" in (args := Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
    ]
    assert len(worker_ports) == 2
    for wport in worker_ports:
        url = f"http://127.0.0.1:{wport}"
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        auth = {"authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/v1/models", headers=auth, timeout=10).status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert wait_gone(processes) == []


def test_up_starts_a_killed_worker_again_and_routes_to_it(tmp_path: Path, redis_url: str) -> None:
    # A worker killed by the OOM killer (or one whose engine loop died: it exits with
    # status 1) used to stay dead until `up` was run again.
    proc, port, log = start_up(tmp_path, "--redis", redis_url)
    try:
        deadline = time.monotonic() + 60
        while "kvrouter is up" not in log.read_text():  # past its start-up checks
            assert time.monotonic() < deadline
            time.sleep(0.1)
        started = {
            name: int(pid)
            for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", log.read_text())
        }
        victim = started["worker-0"]
        os.killpg(victim, signal.SIGKILL)
        again: list[str] = []
        while not again:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            again = re.findall(r"started worker-0 \(pid (\d+)\)", log.read_text())[1:]
        new = int(again[0])
        assert new != victim
        assert alive(new)
        # Back in the index's views, and served through the gateway.
        while "worker-0" not in {v.host for v in asyncio.run(cluster_views(redis_url))}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        args = Path(f"/proc/{new}/cmdline").read_bytes().decode().split("\0")
        wport = int(args[args.index("--port") + 1])
        wait_http(f"http://127.0.0.1:{wport}/health", timeout=60)
        served = set()
        for i in range(20):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "tiny", "prompt": f"request {i} " * 30, "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            served.add(r.headers.get("x-kvrouter-worker"))
        assert "worker-0" in served, served
        assert "exited with status -9" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    assert wait_gone(child_pids(log)) == []


def kill_redis(log: Path, deadline: float) -> str:
    """Once ``up`` (logging to ``log``) is up, SIGKILL its embedded Redis; its URL."""
    while "kvrouter is up" not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    found = re.search(r"started redis \(pid (\d+)\) at (\S+)", log.read_text())
    assert found is not None
    os.kill(int(found[1]), signal.SIGKILL)
    return found[2]


async def _audit(redis_url: str, token: str) -> AuditReport:
    """The index against every live worker's blocks, retried while events are in flight."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        return await audit(
            client, RedisIndex(client, Keyspace()), internal_token=token, retries=80,
            interval_s=0.25,
        )  # fmt: skip
    finally:
        await client.aclose()


def test_up_starts_its_redis_again_and_the_index_refills(tmp_path: Path) -> None:
    # The embedded Redis killed (the OOM killer): the gateway kept serving on load alone,
    # with no index and no discovery of a restarted worker, until `up` was run again.
    proc, port, log = start_up(tmp_path)
    try:
        deadline = time.monotonic() + 90
        redis_url = kill_redis(log, deadline)
        again: list[str] = []
        while not again:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            again = re.findall(r"started redis \(pid (\d+)\)", log.read_text())[1:]
        assert alive(int(again[0]))
        assert "redis exited with status -9; started it again" in log.read_text()
        for i in range(6):  # blocks for the index to hold
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": f"after the restart {i % 2} " * 20,
                    "max_tokens": 2,
                },
                timeout=30,
            )
            assert r.status_code == 200, r.text
        # The workers' heartbeats reach the new, empty Redis (within a period), and it
        # holds every block the workers hold again, and no other.
        while {v.host for v in asyncio.run(cluster_views(redis_url))} != {"worker-0", "worker-1"}:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        token = (tmp_path / "logs" / "internal-token").read_text()
        report = asyncio.run(_audit(redis_url, token))
        assert sorted(h.host for h in report.hosts) == ["worker-0", "worker-1"]
        assert report.ok, [h for h in report.hosts if not h.ok]
        assert sum(sum(h.worker_blocks.values()) for h in report.hosts) > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    assert wait_gone(child_pids(log)) == []


def test_without_restarts_up_stops_everything_when_its_redis_dies(tmp_path: Path) -> None:
    proc, _, log = start_up(tmp_path, "--no-restart")
    try:
        kill_redis(log, time.monotonic() + 90)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "redis exited; stopping" in log.read_text()
    assert "started it again" not in log.read_text()
    assert wait_gone(child_pids(log)) == []


def test_killing_up_takes_its_children_with_it(
    started: tuple[subprocess.Popen[bytes], int, Path],
) -> None:
    proc, _, log = started
    children = child_pids(log)
    proc.kill()
    proc.wait(10)
    assert wait_gone(children) == []


def test_up_starts_a_mixed_fleet_of_sim_workers(tmp_path: Path, redis_url: str) -> None:
    # Every other worker an A100: each publishes its own timing model, which the gateway
    # routes on.
    fleet = "llama3_8b_h100,llama3_8b_a100"
    proc, port, _ = start_up(tmp_path, "--profile", fleet, "--redis", redis_url)
    try:
        views = {v.host: v for v in asyncio.run(cluster_views(redis_url))}
        assert sorted(views) == ["worker-0", "worker-1"]
        h100, a100 = (views[h].profile for h in ("worker-0", "worker-1"))
        assert h100 is not None
        assert a100 is not None
        want = load_profile("llama3_8b_a100").prefill[1] / load_profile("llama3_8b_h100").prefill[1]
        assert a100.prefill[1] / h100.prefill[1] == pytest.approx(want)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "hello there", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--profile", "llama3_8b_a100"], "add --runner sim"),
        (["--runner", "sim", "--profile", "llama3_8b_h100,b300"], "b300"),
    ],
)
def test_up_refuses_a_fleet_it_cannot_start(args: list[str], says: str) -> None:
    result = CliRunner().invoke(app, ["up", *args])
    assert result.exit_code == 2
    assert says in result.output


def test_free_port_never_hands_out_a_port_it_handed_out_lately(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Servers started side by side each take a port and bind it seconds later (a worker
    # binds after loading its model). The kernel may offer a port just released to the
    # next bind(0): handed out twice, one server could not bind while the other answered
    # its health checks (seen in the indexer's fault tests). Scripted here: the kernel
    # offers 40001 twice, then 40002.
    offered = iter([40001, 40001, 40002])

    class Kernel:
        def __init__(self, *args: object) -> None:
            self.port = 0

        def __enter__(self) -> Kernel:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(socket, "socket", Kernel)
    # This process's memory starts empty here: a real 40001 or 40002 handed out by an
    # earlier test would otherwise be skipped too, and the script run out.
    monkeypatch.setattr(embedded_redis, "_HANDED", deque(maxlen=256))
    assert [free_port(), free_port()] == [40001, 40002]
    monkeypatch.undo()
    # Real ports: many in a row, all distinct and each still free to bind.
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
