"""Failures under load: a worker killed, Redis stopped and restarted."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.redis_proc import RedisProcess
from tests.support.servers import ServerProcess, serve_app, wait_http

pytestmark = pytest.mark.slow

MODEL = "tiny"
FAST_HEARTBEAT = {"KVWORKER_HEARTBEAT_INTERVAL_S": "0.2", "KVWORKER_HEARTBEAT_TTL_S": "2.0"}


@dataclass
class Outcome:
    status: int
    first_byte: float | None
    done: bool
    error_event: bool


def sim_worker(name: str, redis_url: str, tmp_path: Path) -> ServerProcess:
    port = free_port()
    args = [
        "worker", "--model", MODEL, "--runner", "sim", "--port", str(port), "--name", name,
        "--redis", redis_url, "--max-num-seqs", "64",
    ]  # fmt: skip
    return ServerProcess(
        args, health_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / f"{name}.log",
        env=FAST_HEARTBEAT,
    )  # fmt: skip


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    procs = [sim_worker(f"s{i}", redis_url, tmp_path) for i in range(2)]
    for p in procs:
        p.start()
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def gateway(redis_url: str, workers: list[ServerProcess]) -> Iterator[str]:
    port = free_port()
    settings = RouterSettings(
        port=port, models=[MODEL], redis_url=redis_url, discovery_interval_s=0.1,
        load_sync_interval_s=0.1,
    )  # fmt: skip
    with serve_app(create_app(settings), port=port) as url:
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/ready").json().get("workers") != len(workers):
            assert time.monotonic() < deadline, "workers not discovered"
            time.sleep(0.05)
        yield url


async def one(client: httpx.AsyncClient, url: str, i: int, t0: float) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": f"request {i} " + "shared context " * 20,
        "max_tokens": 150,
        "stream": True,
    }
    first: float | None = None
    done = error = False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(r.status_code, None, False, False)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.monotonic() - t0
            data = line[6:]
            if data == "[DONE]":
                done = True
            elif "error" in json.loads(data):
                error = True
    return Outcome(200, first, done, error)


async def load(url: str, n: int, spacing_s: float, during: Any) -> list[Outcome]:
    """Send ``n`` streaming requests ``spacing_s`` apart while ``during()`` runs in a thread."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(client, url, i, t0)))
            if i == n // 3:
                await asyncio.to_thread(during)
            await asyncio.sleep(spacing_s)
        return list(await asyncio.gather(*tasks))


def test_a_worker_killed_under_load_loses_no_request_that_had_not_started(
    gateway: str, workers: list[ServerProcess]
) -> None:
    killed_at: list[float] = []

    def kill() -> None:
        workers[1].kill()
        killed_at.append(time.monotonic())

    outcomes = asyncio.run(load(gateway, 60, 0.02, kill))
    assert killed_at
    assert all(o.status == 200 for o in outcomes), [o.status for o in outcomes]
    broken = [o for o in outcomes if not o.done or o.error_event]
    # Only streams already under way on the killed worker may break, and they end cleanly.
    for o in broken:
        assert o.first_byte is not None
        assert o.error_event
        assert o.done
    assert len(broken) < len(outcomes) // 2
    # The dead worker is reported down at the latest once its heartbeat expires (sooner
    # when a request routed there failed): within the TTL plus a discovery round.
    deadline = killed_at[0] + float(FAST_HEARTBEAT["KVWORKER_HEARTBEAT_TTL_S"]) + 1.0
    while 'kvrouter_worker_up{worker="s1"} 0.0' not in httpx.get(f"{gateway}/metrics").text:
        assert time.monotonic() < deadline, "the killed worker is still reported up"
        time.sleep(0.05)


def test_redis_stopped_and_restarted_under_load_fails_no_request(
    gateway: str, redis_server: RedisProcess
) -> None:
    during_outage: list[str] = []

    def bounce() -> None:
        redis_server.stop()
        # The gateway's index mirror serves until its next round against Redis fails
        # (at most one read, ~0.2 s), then lookups fail over and routing is by load:
        # it must say so within a few rounds, answering every request meanwhile.
        deadline = time.monotonic() + 3.0
        statuses = []
        while True:
            # A prompt of whole blocks: one shorter than a block needs no lookup, so it
            # could not notice the index is away.
            r = httpx.post(
                f"{gateway}/v1/completions",
                json={"model": MODEL, "prompt": "the index is down " * 20, "max_tokens": 1},
                timeout=30,
            )
            statuses.append(r.status_code)
            scrape = httpx.get(f"{gateway}/metrics").text
            if "kvrouter_cache_aware_routing 0.0" in scrape or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        during_outage.append(str(sorted(set(statuses))))
        during_outage.append(scrape)
        time.sleep(1.0)  # the outage lasts while requests keep arriving
        redis_server.start()

    outcomes = asyncio.run(load(gateway, 60, 0.03, bounce))
    failed = [o for o in outcomes if not (o.status == 200 and o.done and not o.error_event)]
    assert not failed, failed
    assert during_outage[0] == "[200]"
    # While the index was away the gateway said so, and routed by load only.
    assert "kvrouter_cache_aware_routing 0.0" in during_outage[1]
    deadline = time.monotonic() + 20
    while True:
        # A request after the restart brings cache-aware routing back.
        httpx.post(
            f"{gateway}/v1/completions",
            json={"model": MODEL, "prompt": "after", "max_tokens": 1},
            timeout=30,
        )
        if "kvrouter_cache_aware_routing 1.0" in httpx.get(f"{gateway}/metrics").text:
            break
        assert time.monotonic() < deadline, "cache-aware routing did not resume"
        time.sleep(0.1)
    wait_http(f"{gateway}/ready")
