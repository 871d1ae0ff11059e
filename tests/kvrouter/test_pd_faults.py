"""PD under faults, with worker processes (sim runner) that are really SIGKILLed."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.servers import ServerProcess, serve_app

pytestmark = pytest.mark.slow

MODEL = "tiny"
FAST = {"KVWORKER_HEARTBEAT_INTERVAL_S": "0.2", "KVWORKER_HEARTBEAT_TTL_S": "2.0"}


class Worker:
    def __init__(self, name: str, role: str, redis_url: str, tmp_path: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            "worker", "--model", MODEL, "--runner", "sim", "--port", str(self.port),
            "--name", name, "--redis", redis_url, "--role", role, "--max-num-seqs", "64",
            "--time-scale", "0.05", "--hbm-blocks", "4096",
        ]  # fmt: skip
        self.proc = ServerProcess(
            args, health_url=f"{self.url}/health", log_path=tmp_path / f"{name}.log", env=FAST
        )

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(f"{self.url}/kv/stats", timeout=10).json()
        return out


@pytest.fixture
def pd_workers(redis_url: str, tmp_path: Path) -> Iterator[dict[str, Worker]]:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
    workers = {n: Worker(n, r, redis_url, tmp_path) for n, r in roles.items()}
    for w in workers.values():
        w.proc.start()
    yield workers
    for w in workers.values():
        w.proc.stop()


@pytest.fixture
def gateway(redis_url: str, pd_workers: dict[str, Worker]) -> Iterator[str]:
    port = free_port()
    settings = RouterSettings(
        port=port, models=[MODEL], redis_url=redis_url, pd="always",
        discovery_interval_s=0.1, load_sync_interval_s=0.1,
    )  # fmt: skip
    with serve_app(create_app(settings), port=port) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").json().get("workers") != len(pd_workers):
            assert time.monotonic() < deadline, "workers not discovered"
            time.sleep(0.05)
        yield url


def prompt(i: int, shared: int) -> list[int]:
    """Token ids: one of a few shared 512-token prefixes, then the request's own part."""
    return [*range(1000 + 512 * shared, 1512 + 512 * shared), *range(9000 + i, 9000 + i + 40)]


def test_a_prefill_worker_killed_before_the_pull_leaves_the_decoder_to_compute(
    pd_workers: dict[str, Worker],
) -> None:
    p, d = pd_workers["p0"], pd_workers["d0"]
    body = {"model": MODEL, "prompt": prompt(0, 0), "max_tokens": 8, "temperature": 0}
    r = httpx.post(
        f"{p.url}/v1/completions",
        json={**body, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == len(prompt(0, 0)) // 16
    p.proc.kill()
    decoded = httpx.post(
        f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=30
    )
    assert decoded.status_code == 200, decoded.text
    assert decoded.json()["usage"]["completion_tokens"] == 8
    assert decoded.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    assert 'kvworker_kv_transfer_failures_total{reason="http"} 1.0' in text
    assert d.stats()["in_use_blocks"] == 0


def test_a_thousand_pd_requests_with_killed_workers_leak_no_block_or_lease(
    gateway: str, pd_workers: dict[str, Worker]
) -> None:
    rng = random.Random(7)
    killed: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL, "prompt": prompt(i, rng.randrange(6)),
            "max_tokens": rng.randrange(1, 24), "stream": rng.random() < 0.5,
        }  # fmt: skip
        try:
            r = await client.post(f"{gateway}/v1/completions", json=body)
        except httpx.HTTPError:
            return 599
        return r.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            sem = asyncio.Semaphore(24)

            async def limited(i: int) -> int:
                async with sem:
                    if i == 300:
                        pd_workers["d1"].proc.kill()
                        killed.append("d1")
                    if i == 600:
                        pd_workers["p1"].proc.kill()
                        killed.append("p1")
                    return await one(client, i)

            return list(await asyncio.gather(*(limited(i) for i in range(1000))))

    statuses = asyncio.run(run())
    assert killed == ["d1", "p1"]
    # Requests on a worker at the moment it died may fail; nothing else does.
    failed = [s for s in statuses if s != 200]
    assert len(failed) <= 24 * 2, failed
    metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
    assert 'kvrouter_pd_requests_total{mode="disaggregated"}' in metrics
    # Every surviving worker returns to its idle baseline: no block referenced, no lease.
    deadline = time.monotonic() + 40  # unclaimed leases expire after 30 s
    for name in ("p0", "d0", "d2"):
        w = pd_workers[name]
        while (stats := w.stats())["in_use_blocks"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats["in_use_blocks"] == 0, (name, stats)
        assert (stats["running"], stats["waiting"]) == (0, 0)
        text = httpx.get(f"{w.url}/metrics", timeout=10).text
        assert "kvworker_kv_leases 0.0" in text
