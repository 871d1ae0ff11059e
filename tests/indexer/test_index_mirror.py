"""The gateway's index mirror against the Redis index it mirrors: real Redis, real ingester.

What a user would notice: a gateway replica started at any moment answers
lookups exactly as the shared Redis index does, after streams were trimmed,
across gaps, snapshots, worker restarts and dead hosts.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from engine_worker.server import create_app as create_worker_app
from engine_worker.settings import WorkerSettings
from indexer.audit import audit
from indexer.events import AllCleared, Event, EventBatch, Snapshot
from indexer.index import RedisIndex
from indexer.index.mirror import IndexMirror, MirrorConfig
from indexer.ingest import Ingester
from indexer.media import Medium
from indexer.metrics import MirrorMetrics
from tests.indexer.ingest_support import (
    EPOCH,
    KS,
    add,
    batch,
    eventually,
    fast_config,
    register,
    removed,
    stored,
)
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
FAST = MirrorConfig(block_ms=20, refresh_interval_s=0.05, resync_interval_s=0.05,
                    dead_grace_s=0.3)  # fmt: skip


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
async def ingester(redis_url: str, client: aioredis.Redis) -> AsyncIterator[RedisIndex]:
    index = RedisIndex(client, KS)
    ing = Ingester(redis_url, index, keyspace=KS, config=fast_config())
    await ing.start()
    yield index
    await ing.stop()


async def new_mirror(
    client: aioredis.Redis, registry: CollectorRegistry | None = None
) -> IndexMirror:
    metrics = MirrorMetrics(registry or CollectorRegistry())
    mirror = IndexMirror(RedisIndex(client, KS), client, keyspace=KS, config=FAST, metrics=metrics)
    await mirror.start()
    return mirror


async def same_as_index(
    mirror: IndexMirror, index: RedisIndex, hosts: list[str], chains: list[list[int]]
) -> bool:
    """Entries and cursors per host, and the lookups of ``chains``, all equal."""
    for h in hosts:
        if await mirror.entries(h) != await index.entries(h):
            return False
        if await mirror.cursor(h) != await index.cursor(h):
            return False
    return all([mirror.table.match_sync(c) == await index.match(c) for c in chains])


async def caught_up(client: aioredis.Redis, hosts: list[str]) -> bool:
    """Whether the ingester persisted a position at the end of every host's stream."""
    for h in hosts:
        info = await client.xinfo_stream(KS.events(h))
        if await client.hget(KS.index("pos"), h) != info["last-generated-id"]:
            return False
    return True


# -- (1) random event sequences: the mirror ends where the Redis index does ---------------


def random_messages(rng: random.Random, host: str, n: int) -> list[EventBatch | Snapshot]:
    """A host's stream with duplicates, gaps, restarts (new epoch) and snapshots."""
    pool = [rng.getrandbits(64) for _ in range(24)]
    out: list[EventBatch | Snapshot] = []
    epoch, seq = 1, 0
    for _ in range(n):
        roll = rng.random()
        if roll < 0.05:
            epoch, seq = epoch + 1, 0  # a restarted worker
        events: list[Event] = []
        for _ in range(rng.randint(1, 3)):
            keys = rng.sample(pool, rng.randint(1, 6))
            medium = rng.choice(list(Medium))
            kind = rng.random()
            events.append(
                stored(*keys, medium=medium) if kind < 0.6
                else removed(*keys, medium=medium) if kind < 0.95 else AllCleared()
            )  # fmt: skip
        if roll < 0.12:
            blocks = {m: rng.sample(pool, rng.randint(0, 8)) for m in Medium}
            out.append(Snapshot(host, epoch, seq, 0.0, blocks))
            continue
        step = rng.choices([1, 0, -1, 2], weights=[85, 6, 4, 5])[0]
        seq = max(1, seq + step)
        out.append(batch(host, seq, *events, epoch=epoch))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_streams_leave_mirror_and_index_equal(
    client: aioredis.Redis, ingester: RedisIndex, seed: int
) -> None:
    rng = random.Random(seed)
    hosts = ["h1", "h2", "h3"]
    await register(client, *hosts)
    streams = {h: random_messages(rng, h, 60) for h in hosts}
    mirror = await new_mirror(client)
    try:
        # Half before the mirror starts (read from the index), half while it follows.
        for h in hosts:
            await add(client, h, *streams[h][:30])
        await eventually(lambda: caught_up(client, hosts), what="the ingester caught up")
        await eventually(lambda: mirror.serving, what="the mirror serves")
        for h in hosts:
            await add(client, h, *streams[h][30:])
        await eventually(lambda: caught_up(client, hosts), what="the ingester caught up")
        keys = sorted({k for h in hosts for m in streams[h] for k in _keys(m)})
        chains = [rng.sample(keys, min(len(keys), 8)) for _ in range(20)] + [keys]
        await eventually(
            lambda: same_as_index(mirror, ingester, hosts, chains), what="mirror == index"
        )
    finally:
        await mirror.close()


def _keys(m: EventBatch | Snapshot) -> list[int]:
    if isinstance(m, Snapshot):
        return [k for keys in m.blocks.values() for k in keys]
    return [k for ev in m.events if not isinstance(ev, AllCleared) for k in ev.keys]


async def test_a_mirror_started_after_trimming_bootstraps_from_the_index(
    client: aioredis.Redis, ingester: RedisIndex
) -> None:
    await register(client, "a", "b")
    await add(client, "a", batch("a", 1, stored(1, 2, 3)), batch("a", 2, stored(4, medium=DRAM)))
    await add(client, "b", batch("b", 1, stored(1, 2, medium=SSD)))
    await eventually(lambda: caught_up(client, ["a", "b"]), what="the ingester caught up")
    await add(client, "a", batch("a", 3, stored(5)))  # a trim leaves the last position
    await eventually(lambda: caught_up(client, ["a", "b"]), what="the ingester caught up")
    # What the ingester's approximate trim (XTRIM MINID ~) removes once streams are long:
    # everything before its positions. History is gone; a replay is impossible.
    for h in ("a", "b"):
        pos = await client.hget(KS.index("pos"), h)
        await client.xtrim(KS.events(h), minid=pos, approximate=False)
    assert await client.xlen(KS.events("a")) == 1
    registry = CollectorRegistry()
    mirror = await new_mirror(client, registry)
    try:
        await eventually(lambda: mirror.serving, what="the mirror serves")
        chain = [1, 2, 3, 4, 5, 6]
        assert await mirror.match(chain) == await ingester.match(chain)
        assert (await mirror.match(chain))["a"].per_medium == (4, 1, 0)
        # Later batches, a restart (new epoch: the ingester waits for a snapshot) and
        # the snapshot that answers it.
        await add(client, "b", batch("b", 2, removed(2, medium=SSD)))
        await add(client, "a", batch("a", 1, stored(9), epoch=99))
        await add(client, "a", Snapshot("a", 99, 1, 0.0, {HBM: [1, 2], DRAM: [3]}))
        await add(client, "a", batch("a", 2, stored(6, medium=SSD), epoch=99))
        await eventually(lambda: caught_up(client, ["a", "b"]), what="the ingester caught up")
        await eventually(
            lambda: same_as_index(mirror, ingester, ["a", "b"], [chain, [9]]), what="converged"
        )
        assert (await mirror.match(chain))["a"].per_medium == (2, 1, 0)
        lookups = registry.get_sample_value("kvindex_mirror_lookups_total", {"source": "mirror"})
        assert lookups is not None
        assert lookups >= 2
    finally:
        await mirror.close()


async def test_dead_hosts_are_dropped_and_a_reset_index_is_read_again(
    client: aioredis.Redis, ingester: RedisIndex
) -> None:
    await register(client, "a", "b")
    await add(client, "a", batch("a", 1, stored(1, 2)))
    await add(client, "b", batch("b", 1, stored(1)))
    await eventually(lambda: caught_up(client, ["a", "b"]), what="the ingester caught up")
    mirror = await new_mirror(client)
    try:
        await eventually(lambda: mirror.serving, what="the mirror serves")
        assert set(await mirror.match([1, 2])) == {"a", "b"}
        await client.delete(KS.heartbeat("b"))
        await eventually(
            lambda: mirror.table.cursor_sync("b") is None, what="the dead host dropped"
        )
        assert set(await mirror.match([1, 2])) == {"a"}
        # Redis loses the index (as a restart without persistence would).
        index_keys = [k async for k in client.scan_iter(match=f"{KS.index('')}*")]
        await client.delete(*index_keys)
        # The ingester reads the streams again from their start and purges "b" again;
        # the mirror reads the rebuilt index and agrees.
        await eventually(
            lambda: same_as_index(mirror, ingester, ["a", "b"], [[1, 2]]), what="converged"
        )
        assert set(await mirror.match([1, 2])) == {"a"}
    finally:
        await mirror.close()


async def test_a_mirror_ahead_of_an_ingester_that_has_not_read_the_host_reads_nothing_again(
    client: aioredis.Redis,
) -> None:
    # No ingester yet (a fresh cluster: it takes a new host's lease seconds after the host
    # registers): the index has no cursor for "a" while the mirror follows its stream.
    await register(client, "a")
    await add(client, "a", batch("a", 1, stored(1, 2)), batch("a", 2, stored(3)))
    registry = CollectorRegistry()
    mirror = await new_mirror(client, registry)
    try:
        await eventually(lambda: mirror.table.cursor_sync("a") == (EPOCH, 2), what="mirror read")
        await asyncio.sleep(20 * FAST.refresh_interval_s)  # many drift checks
        assert await mirror.index.cursor("a") is None
        for reason in ("drift", "gap", "reset"):
            value = registry.get_sample_value("kvindex_mirror_resyncs_total", {"reason": reason})
            assert value == 0, reason
        assert (await mirror.match([1, 2, 3]))["a"].blocks == 3
    finally:
        await mirror.close()


async def test_lookups_go_to_redis_until_the_mirror_has_read_every_host(
    client: aioredis.Redis, ingester: RedisIndex
) -> None:
    await register(client, "a")
    await add(client, "a", batch("a", 1, stored(1, 2)))
    await eventually(lambda: caught_up(client, ["a"]), what="the ingester caught up")
    registry = CollectorRegistry()
    mirror = IndexMirror(RedisIndex(client, KS), client, keyspace=KS, config=FAST,
                         metrics=MirrorMetrics(registry))  # fmt: skip
    assert not mirror.serving
    assert (await mirror.match([1, 2]))["a"].blocks == 2  # answered by Redis
    assert registry.get_sample_value("kvindex_mirror_lookups_total", {"source": "redis"}) == 1
    await mirror.close()


# -- (2) a fresh replica against real workers: the audit passes on the mirror --------------

TOKEN = "s3cret"


@pytest.fixture
def workers(redis_url: str) -> Iterator[dict[str, str]]:
    with ExitStack() as stack:
        urls = {}
        for name in ("w1", "w2", "w3"):
            port = free_port()
            settings = WorkerSettings(
                model="tiny", runner="sim", name=name, port=port, redis_url=redis_url,
                hbm_blocks=24, dram_blocks=24, internal_token=TOKEN,
                heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0,
            )  # fmt: skip
            urls[name] = stack.enter_context(serve_app(create_worker_app(settings), port=port))
        yield urls


async def _load(workers: dict[str, str], start: int, n: int) -> None:
    names = sorted(workers)
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {TOKEN}"}) as http:
        for i in range(start, start + n):
            prompt = "Shared instructions for every request. " * 4 + f"case {i} " * (i % 5 + 1)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            r = await http.post(f"{workers[names[i % 3]]}/v1/completions", json=body)
            assert r.status_code == 200, r.text


async def test_a_replica_started_after_the_workers_cached_passes_the_audit(
    client: aioredis.Redis, ingester: RedisIndex, workers: dict[str, str]
) -> None:
    await _load(workers, 0, 18)  # enough to evict hbm -> dram -> ssd on 24-block pools

    async def audited(index: RedisIndex | IndexMirror) -> bool:
        return (await audit(client, index, keyspace=KS, internal_token=TOKEN)).ok

    await eventually(lambda: audited(ingester), what="the Redis index caught up")
    mirror = await new_mirror(client)
    try:
        await eventually(lambda: mirror.serving, what="the mirror serves")
        await eventually(lambda: audited(mirror), what="the fresh mirror matches the workers")
        hosts = sorted(workers)
        chains = [sorted((await ingester.entries(h))[HBM]) for h in hosts]
        assert await same_as_index(mirror, ingester, hosts, chains)
        # It keeps matching while traffic goes on.
        await _load(workers, 18, 12)
        await eventually(lambda: audited(ingester), what="the Redis index caught up")
        await eventually(lambda: audited(mirror), what="the mirror kept up")
        assert sum((await mirror.stats()).entries.values()) > 0
    finally:
        await mirror.close()


async def test_the_gateway_answers_lookups_from_its_mirror(
    redis_url: str, ingester: RedisIndex, workers: dict[str, str]
) -> None:
    from kvrouter.gateway.app import create_app as create_gateway_app
    from kvrouter.gateway.settings import RouterSettings

    await _load(workers, 0, 3)
    settings = RouterSettings(port=free_port(), models=["tiny"], redis_url=redis_url,
                              discovery_interval_s=0.1, internal_token=TOKEN)  # fmt: skip
    with serve_app(create_gateway_app(settings), port=settings.port) as gw:
        async with httpx.AsyncClient(timeout=60) as http:

            async def mirror_serves() -> bool:
                text = (await http.get(f"{gw}/metrics")).text
                return "kvindex_mirror_ready 1.0" in text

            await eventually(mirror_serves, what="the gateway's mirror serves")
            prompt = "Shared instructions for every request. " * 4 + "case 0 "
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            r = await http.post(f"{gw}/v1/completions", json=body,
                                headers={"x-kvrouter-debug": "1"})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] == "w1"  # the worker that holds the prompt
            text = (await http.get(f"{gw}/metrics")).text
            assert 'kvindex_mirror_lookups_total{source="mirror"} 1.0' in text
    await asyncio.sleep(0)
