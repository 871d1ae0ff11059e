"""Faults against real worker subprocesses (sim runner), a real Redis, the ingester and the audit.

A module-wide pool of three ``kvrouter worker --runner sim`` processes
(``f3`` drops 1% of its event batches on the way) serves the short tests;
the kill test starts its own victim, and the long scenario is marked slow.
Load goes through the workers' own OpenAI endpoints, prompts sharing
prefixes; small KV tiers make blocks move between HBM and DRAM and leave.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from indexer.audit import AuditReport, audit, live_workers, render
from indexer.events import decode_message
from indexer.index import RedisIndex
from indexer.ingest import Ingester
from indexer.wire import EVENT_FIELD
from tests.indexer.ingest_support import KS, eventually, fast_config
from tests.support.redis_proc import RedisProcess, free_port
from tests.support.servers import ServerProcess

TTL_S, DEAD_CHECK_S, QUIET_S = 2.0, 1.0, 0.5
WORKER_ENV = {"KVWORKER_HEARTBEAT_TTL_S": str(TTL_S), "KVWORKER_HEARTBEAT_INTERVAL_S": "0.5"}
INDEXER_ENV = {
    "KVINDEX_REFRESH_INTERVAL_S": "0.2", "KVINDEX_LEASE_TTL_S": "2",
    "KVINDEX_DEAD_CHECK_INTERVAL_S": str(DEAD_CHECK_S), "KVINDEX_BLOCK_MS": "50",
    "KVINDEX_QUIET_SNAPSHOT_S": str(QUIET_S),
}  # fmt: skip
SYSTEMS = [
    "You are a careful assistant. Answer briefly and cite the facts you use. " * 3,
    "Translate the following sentences into French and keep every name as it is. " * 3,
    "Summarize the text below in one line for a busy reader, without jargon. " * 3,
]
WORDS = [
    "cache",
    "block",
    "prefix",
    "token",
    "worker",
    "router",
    "memory",
    "disk",
    "index",
    "stream",
    "event",
    "host",
]


def worker(name: str, redis_url: str, logs: Path, **env: str) -> ServerProcess:
    port = free_port()
    args = [
        "worker", "--runner", "sim", "--model", "tiny", "--name", name, "--port", str(port),
        "--redis", redis_url, "--hbm-blocks", "48", "--dram-blocks", "48", "--max-num-seqs", "4",
    ]  # fmt: skip
    return ServerProcess(args, health_url=f"http://127.0.0.1:{port}/health",
                         log_path=logs / f"{name}.log", env={**WORKER_ENV, **env})  # fmt: skip


def start_all(procs: Sequence[ServerProcess]) -> None:
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: p.start(180), procs))


def base_url(proc: ServerProcess) -> str:
    return proc.health_url.removesuffix("/health")


@pytest.fixture(scope="module")
def redis_proc() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def pool(redis_proc: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    dict[str, ServerProcess]
]:  # fmt: skip
    logs = tmp_path_factory.mktemp("workers")
    procs = {
        "f1": worker("f1", redis_proc.url, logs),
        "f2": worker("f2", redis_proc.url, logs),
        "f3": worker("f3", redis_proc.url, logs, KVWORKER_EVENT_DROP_RATE="0.01",
                     KVWORKER_SEED="1"),
    }  # fmt: skip
    start_all(list(procs.values()))
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture
async def client(redis_proc: RedisProcess) -> AsyncIterator[aioredis.Redis]:
    redis_proc.start()
    c = aioredis.Redis.from_url(redis_proc.url)
    yield c
    await c.aclose()


@asynccontextmanager
async def ingesting(url: str, replica: str = "t") -> AsyncIterator[tuple[Ingester, RedisIndex]]:
    index = RedisIndex(url, KS)
    cfg = fast_config(replica, dead_check_interval_s=DEAD_CHECK_S, snapshot_timeout_s=2.0,
                      quiet_snapshot_s=QUIET_S)  # fmt: skip
    ing = Ingester(url, index, keyspace=KS, config=cfg)
    await ing.start()
    try:
        yield ing, index
    finally:
        await ing.stop()
        await index.close()


async def workload(urls: Sequence[str], n: int, *, seed: int, concurrency: int = 4) -> None:
    """``n`` completions spread over ``urls``: shared system prompts, distinct questions."""
    rng = random.Random(seed)
    prompts = [
        rng.choice(SYSTEMS) + f"Question {seed}.{i}: "
        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 80)))
        for i in range(n)
    ]  # fmt: skip
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as http:

        async def one(i: int) -> None:
            async with gate:
                r = await http.post(
                    f"{urls[i % len(urls)]}/v1/completions",
                    json={"model": "tiny", "prompt": prompts[i], "max_tokens": 3},
                )
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i) for i in range(n)))


def describe(report: AuditReport) -> str:
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(render(report, samples=2))
    return console.export_text()


async def audit_matches(
    client: aioredis.Redis, index: RedisIndex, hosts: Sequence[str], within: float = 15.0
) -> AuditReport:
    """Audit until every live worker matches (events may be in flight); the hosts hold blocks."""

    async def live() -> bool:
        return set(hosts) <= {v.host for v in await live_workers(client, KS)}

    await eventually(live, within=within, what=f"{hosts} live")
    report = await audit(client, index, keyspace=KS, retries=int(within / 0.25), interval_s=0.25)
    assert report.ok, describe(report)
    seen = {h.host: sum(h.worker_blocks.values()) for h in report.hosts}
    for host in hosts:
        assert seen.get(host, 0) > 0, f"{host} holds nothing: the audit would prove nothing"
    return report


async def stream(client: aioredis.Redis, host: str, after: bytes | None = None) -> list[Any]:
    """Decoded messages of a host's stream (after entry id ``after``, exclusive)."""
    start = b"-" if after is None else b"(" + after
    entries: Any = await client.xrange(KS.events(host), min=start)
    return [(eid, decode_message(f[EVENT_FIELD])) for eid, f in entries]


async def caught_up(client: aioredis.Redis, index: RedisIndex, hosts: Sequence[str]) -> bool:
    """Whether the index's cursor of each host is its stream's newest (epoch, seq)."""
    for host in hosts:
        messages = await stream(client, host)
        last = messages[-1][1]
        if await index.cursor(host) != (last.epoch, last.seq):
            return False
    return True


# -- the short tests ---------------------------------------------------------------------


async def test_dropped_batches_are_repaired_by_snapshots_and_the_audit_matches(
    pool: dict[str, ServerProcess], client: aioredis.Redis, redis_proc: RedisProcess
) -> None:
    urls = [base_url(p) for p in pool.values()]
    async with ingesting(redis_proc.url) as (ing, index):
        deadline = time.monotonic() + 90
        rnd = 0
        # The ingester trims the batches it applied, so the drop is seen by what it counted.
        while ing.metrics.batch_count("gap") < 1:
            assert time.monotonic() < deadline, "f3 dropped no batch: nothing was tested"
            rnd += 1
            await workload(urls, 24, seed=rnd)
        await audit_matches(client, index, list(pool))
        assert ing.metrics.registry.get_sample_value(
            "kvindex_ingest_snapshot_requests_total", {"reason": "gap"}
        )


async def test_a_killed_indexer_restarts_where_it_stopped(
    pool: dict[str, ServerProcess],
    client: aioredis.Redis,
    redis_proc: RedisProcess,
    tmp_path: Path,
) -> None:
    hosts = ["f1", "f2"]
    urls = [base_url(pool[h]) for h in hosts]
    index = RedisIndex(redis_proc.url, KS)

    def service() -> ServerProcess:
        port = free_port()
        args = ["indexer", "--redis", redis_proc.url, "--metrics-port", str(port)]
        return ServerProcess(args, health_url=f"http://127.0.0.1:{port}/ready",
                             log_path=tmp_path / "indexer.log", env=INDEXER_ENV)  # fmt: skip

    def counter(proc: ServerProcess, name: str, result: str) -> float:
        text = httpx.get(proc.health_url.replace("/ready", "/metrics"), timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and s.labels.get("result") == result:
                    return s.value
        raise AssertionError(f"{name} not exported")

    async def newest_seqs() -> dict[str, int]:
        # The ingester trims what it applied, so batches are counted by their seq numbers
        # (consecutive within an epoch, no drops here; snapshots take no seq of their own).
        out = {}
        for h in hosts:
            entries: Any = await client.xrevrange(KS.events(h), count=1)
            out[h] = decode_message(entries[0][1][EVENT_FIELD]).seq
        return out

    async def batches_after(marks: dict[str, int]) -> int:
        now = await newest_seqs()
        return sum(now[h] - marks[h] for h in hosts)

    first = service().start()
    try:
        await eventually(lambda: caught_up(client, index, hosts), what="first run caught up")
        before = counter(first, "kvindex_ingest_batches_total", "applied")
        marks = await newest_seqs()
        await workload(urls, 30, seed=100)
        await eventually(lambda: caught_up(client, index, hosts), what="workload A applied")
        applied_a = counter(first, "kvindex_ingest_batches_total", "applied") - before
        assert applied_a == await batches_after(marks) > 0
    finally:
        first.kill()
    marks = await newest_seqs()
    await workload(urls, 30, seed=101)
    second = service().start()
    try:
        await eventually(lambda: caught_up(client, index, hosts), within=30,
                         what="second run caught up")  # fmt: skip
        # Exactly the batches published while it was down: none lost, none applied twice.
        assert counter(second, "kvindex_ingest_batches_total", "applied") == await batches_after(
            marks
        )
        assert counter(second, "kvindex_ingest_batches_total", "duplicate") == 0
        assert counter(second, "kvindex_ingest_batches_total", "gap") == 0
        await audit_matches(client, index, hosts)
    finally:
        second.stop()
        await index.close()


async def test_after_a_redis_restart_snapshots_rebuild_the_index(
    pool: dict[str, ServerProcess], redis_proc: RedisProcess
) -> None:
    urls = [base_url(p) for p in pool.values()]
    client = aioredis.Redis.from_url(redis_proc.url)
    async with ingesting(redis_proc.url) as (ing, index):
        await workload(urls, 24, seed=200)
        await audit_matches(client, index, list(pool))
        redis_proc.restart()
        await client.aclose()
        client = aioredis.Redis.from_url(redis_proc.url)
        await workload(urls, 12, seed=201)
        await audit_matches(client, index, list(pool), within=30)
        assert ing.healthy
    await client.aclose()


async def test_a_killed_workers_entries_are_purged_within_the_heartbeat_ttl(
    pool: dict[str, ServerProcess],
    client: aioredis.Redis,
    redis_proc: RedisProcess,
    tmp_path: Path,
) -> None:
    victim = worker("victim", redis_proc.url, tmp_path)
    start_all([victim])
    try:
        async with ingesting(redis_proc.url) as (ing, index):
            await workload([base_url(victim), base_url(pool["f1"])], 16, seed=300)
            await audit_matches(client, index, ["victim", "f1"])
            killed = time.monotonic()
            victim.kill()

            async def gone() -> bool:
                return not any((await index.entries("victim")).values())

            await eventually(gone, within=TTL_S + DEAD_CHECK_S + 5, what="victim purged")
            assert time.monotonic() - killed <= TTL_S + DEAD_CHECK_S + 2.0
            assert await index.cursor("victim") is None
            assert ing.metrics.registry.get_sample_value("kvindex_ingest_dead_hosts_total") == 1
            report = await audit_matches(client, index, ["f1"])
            assert "victim" not in {h.host for h in report.hosts}
    finally:
        victim.kill()


# -- the long scenario -------------------------------------------------------------------


@pytest.mark.slow
async def test_long_run_with_drops_restarts_and_a_kill(
    redis_proc: RedisProcess, tmp_path: Path
) -> None:
    # ~220 batches in the first phase: at 5% dropped, the odds of none are about 1e-5.
    procs = [
        worker(f"l{i}", redis_proc.url, tmp_path, KVWORKER_EVENT_DROP_RATE="0.05",
               KVWORKER_SEED=str(i + 1))
        for i in range(3)
    ]  # fmt: skip
    start_all(procs)
    names = [f"l{i}" for i in range(3)]
    urls = [base_url(p) for p in procs]
    client = aioredis.Redis.from_url(redis_proc.url)
    try:
        async with ingesting(redis_proc.url, "a") as (ing, index):
            await workload(urls, 300, seed=400, concurrency=8)
            await audit_matches(client, index, names)
            # Batches were dropped on the way and the index still matches: the ingester saw
            # the holes (the stream itself is trimmed as batches are applied).
            assert ing.metrics.batch_count("gap") >= 1
        async with ingesting(redis_proc.url, "b") as (_, index):
            await workload(urls, 150, seed=401, concurrency=8)
            await audit_matches(client, index, names)
            redis_proc.restart()
            await client.aclose()
            client = aioredis.Redis.from_url(redis_proc.url)
            await workload(urls, 150, seed=402, concurrency=8)
            await audit_matches(client, index, names, within=30)
            procs[2].kill()

            async def gone() -> bool:
                return not any((await index.entries("l2")).values())

            await eventually(gone, within=TTL_S + DEAD_CHECK_S + 5, what="l2 purged")
            await workload(urls[:2], 100, seed=403, concurrency=8)
            await audit_matches(client, index, names[:2])
    finally:
        for p in procs:
            p.stop()
        await client.aclose()
