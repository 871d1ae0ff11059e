"""The audit against real workers (sim runner, real HTTP, internal token) and a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner, Result

from engine_worker.server import create_app
from engine_worker.settings import WorkerSettings
from indexer.audit import MediumDiff, audit, compare
from indexer.events import Snapshot
from indexer.index import RedisIndex
from indexer.ingest import Ingester
from indexer.media import Medium
from kvrouter.cli import app
from tests.indexer.ingest_support import KS, eventually, fast_config
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
TOKEN = "s3cret"
HOSTS = ["a1", "a2"]


@pytest.fixture
def workers(redis_url: str) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        urls = {}
        for name in HOSTS:
            port = free_port()
            settings = WorkerSettings(
                model="tiny", runner="sim", name=name, port=port, redis_url=redis_url,
                hbm_blocks=24, dram_blocks=24, internal_token=TOKEN,
                heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0,
            )  # fmt: skip
            urls[name] = stack.enter_context(serve_app(create_app(settings), port=port))
        yield urls


@pytest.fixture
async def synced(
    redis_url: str, workers: dict[str, str]
) -> AsyncIterator[tuple[aioredis.Redis, RedisIndex]]:
    """Load on both workers, then the ingester stopped once the index caught up."""
    client = aioredis.Redis.from_url(redis_url)
    index = RedisIndex(client, KS)
    ing = Ingester(redis_url, index, keyspace=KS, config=fast_config())
    await ing.start()
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=60, headers=auth) as http:
        for i in range(12):
            prompt = "Shared instructions for every request. " * 4 + f"case {i} " * (i % 5 + 1)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            r = await http.post(f"{workers[HOSTS[i % 2]]}/v1/completions", json=body)
            assert r.status_code == 200, r.text

    async def matching() -> bool:
        return (await audit(client, index, keyspace=KS, internal_token=TOKEN)).ok

    await eventually(matching, what="the index caught up with the workers")
    await ing.stop()
    yield client, index
    await client.aclose()


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(app, ["index", "audit", *args])


async def test_matching_index_passes_and_the_command_exits_0(
    redis_url: str, synced: tuple[aioredis.Redis, RedisIndex]
) -> None:
    client, index = synced
    report = await audit(client, index, keyspace=KS, internal_token=TOKEN)
    assert report.ok
    assert [h.host for h in report.hosts] == HOSTS
    for h in report.hosts:
        assert sum(h.worker_blocks.values()) > 0
        assert h.worker_blocks == h.index_blocks
    result = await asyncio.to_thread(run_cli, "--redis", redis_url, "--internal-token", TOKEN)
    assert result.exit_code == 0, result.output
    assert result.output.count("ok") >= 2


async def test_missing_and_extra_entries_are_reported_and_the_command_exits_1(
    redis_url: str, synced: tuple[aioredis.Redis, RedisIndex]
) -> None:
    client, index = synced
    real = await index.entries("a1")
    gone = sorted(real[HBM])[:2]
    cursor = await index.cursor("a1")
    assert cursor is not None
    tampered = {HBM: sorted(real[HBM] - set(gone)), DRAM: [*real[DRAM], 0xDEADBEEF]}
    assert await index.replace(Snapshot("a1", *cursor, 0.0, tampered))
    report = await audit(client, index, keyspace=KS, internal_token=TOKEN)
    verdict = {h.host: h for h in report.hosts}
    assert verdict["a2"].ok
    assert verdict["a1"].diffs == [
        MediumDiff(HBM, missing=gone, extra=[]),
        MediumDiff(DRAM, missing=[], extra=[0xDEADBEEF]),
    ]
    result = await asyncio.to_thread(
        run_cli, "--redis", redis_url, "--internal-token", TOKEN, "--retries", "1",
        "--interval", "0.05",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "00000000deadbeef" in result.output
    assert f"{gone[0]:016x}" in result.output


async def test_a_worker_refusing_the_audit_counts_as_a_difference(
    redis_url: str, synced: tuple[aioredis.Redis, RedisIndex]
) -> None:
    client, index = synced
    report = await audit(client, index, keyspace=KS, internal_token="wrong")
    assert not report.ok
    assert all(h.error is not None and "401" in h.error for h in report.hosts)
    result = await asyncio.to_thread(run_cli, "--redis", redis_url, "--retries", "0")
    assert result.exit_code == 1, result.output
    assert "unreachable" in result.output


def test_unreachable_redis_exits_2() -> None:
    result = run_cli("--redis", f"redis://127.0.0.1:{free_port()}/0", "--retries", "0")
    assert result.exit_code == 2
    assert "audit failed" in result.output


def test_compare_lists_missing_and_extra_keys_per_medium() -> None:
    worker = {HBM: {1, 2, 3}, DRAM: {4}}
    index = {HBM: {1, 3}, DRAM: {4}, SSD: {9, 8}}
    assert compare(worker, index) == [
        MediumDiff(HBM, missing=[2], extra=[]),
        MediumDiff(SSD, missing=[], extra=[8, 9]),
    ]
    assert compare(worker, {HBM: {1, 2, 3}, DRAM: {4}, SSD: set()}) == []
