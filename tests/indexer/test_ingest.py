"""The ingester against a real Redis and handcrafted event streams (what workers publish)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from indexer.events import Snapshot
from indexer.index import IndexLayout, KVIndex, MemoryIndex, RedisIndex
from indexer.ingest import IngestConfig, Ingester
from indexer.ingest_metrics import IngestMetrics
from indexer.media import Medium
from indexer.metrics import IndexMetrics
from indexer.views import WorkerView
from indexer.wire import OP_SNAPSHOT, encode_view
from tests.indexer.ingest_support import (
    EPOCH,
    KS,
    add,
    batch,
    control_requests,
    eventually,
    fast_config,
    register,
    removed,
    stored,
)
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_proc import RedisProcess

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
SMALL = IndexLayout(key_bits=6, host_bits=5, group_bits=4)


def held(hbm: set[int] | None = None, dram: set[int] | None = None) -> dict[Medium, set[int]]:
    return {HBM: hbm or set(), DRAM: dram or set(), SSD: set()}


def snapshots(ing: Ingester, result: str = "applied") -> int:
    value = ing.metrics.registry.get_sample_value(
        "kvindex_ingest_snapshots_total", {"result": result}
    )
    return int(value or 0)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@asynccontextmanager
async def running(
    url: str, index: KVIndex, config: IngestConfig, registry: CollectorRegistry | None = None
) -> AsyncIterator[Ingester]:
    metrics = IngestMetrics(registry or CollectorRegistry())
    ing = Ingester(url, index, keyspace=KS, config=config, metrics=metrics)
    await ing.start()
    try:
        yield ing
    finally:
        await ing.stop()


def new_index(kind: str, url: str, registry: CollectorRegistry | None = None) -> KVIndex:
    metrics = IndexMetrics(registry) if registry is not None else None
    if kind == "memory":
        return MemoryIndex(metrics=metrics)
    return RedisIndex(url, KS, layout=SMALL, metrics=metrics)


@pytest.mark.parametrize("kind", ["redis", "memory"])
async def test_batches_apply_in_order_and_repeats_change_nothing(
    redis_url: str, client: aioredis.Redis, kind: str
) -> None:
    await register(client, "a")
    await add(
        client, "a",
        Snapshot("a", EPOCH, 0, time.time(), {HBM: [1]}),
        batch("a", 1, stored(2, 3)),
        batch("a", 2, removed(1), stored(4, medium=DRAM)),
        batch("a", 1, stored(99)),
        batch("a", 3, stored(5)),
        batch("a", 3, stored(98)),
        batch("a", 2, removed(5)),
    )  # fmt: skip
    index = new_index(kind, redis_url)
    async with running(redis_url, index, fast_config()) as ing:
        await eventually(
            lambda: (
                ing.metrics.batch_count("applied") == 3
                and ing.metrics.batch_count("duplicate") == 3
            ),
            what="3 batches applied, 3 duplicates",
        )
        assert await index.entries("a") == held({2, 3, 5}, {4})
        assert await index.cursor("a") == (EPOCH, 3)
        await add(client, "a", batch("a", 4, removed(2)), batch("a", 4, stored(2)))
        await eventually(lambda: ing.metrics.batch_count("duplicate") == 4)
        assert await index.entries("a") == held({3, 5}, {4})
        assert snapshots(ing) == 1
        assert ing.metrics.batch_count("gap") == 0
        assert await control_requests(client, "a") == []
    await index.close()


async def test_gap_asks_for_a_snapshot_and_applies_the_held_batches_after_it(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a")
    # Batch 3 was lost on the way.
    await add(
        client, "a",
        batch("a", 1, stored(1)), batch("a", 2, stored(2)),
        batch("a", 4, stored(4)), batch("a", 5, stored(5)), batch("a", 6, stored(6)),
    )  # fmt: skip
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as ing:
        await eventually(lambda: ing.metrics.batch_count("held") == 2, what="5 and 6 held")
        assert await control_requests(client, "a") == [OP_SNAPSHOT]
        assert ing.metrics.batch_count("gap") == 1
        assert ing.status()["pending"] == ["a"]
        assert await index.entries("a") == held({1, 2})
        # The worker answers with everything up to batch 4; 5 and 6 apply on top.
        await add(client, "a", Snapshot("a", EPOCH, 4, time.time(), {HBM: [1, 2, 3, 4], DRAM: [7]}))

        async def caught_up() -> bool:
            return await index.cursor("a") == (EPOCH, 6)

        await eventually(caught_up, what="cursor at 6")
        assert await index.entries("a") == held({1, 2, 3, 4, 5, 6}, {7})
        assert ing.status()["pending"] == []
        await add(client, "a", batch("a", 7, removed(1)))
        await eventually(lambda: ing.metrics.batch_count("applied") == 5)
        assert await index.entries("a") == held({2, 3, 4, 5, 6}, {7})
        # Asked once: the request is not repeated while it is pending.
        assert await control_requests(client, "a") == [OP_SNAPSHOT]
    await index.close()


async def test_an_unanswered_snapshot_request_is_repeated(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a")
    await add(client, "a", batch("a", 2, stored(1)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config(snapshot_timeout_s=0.2)) as ing:

        async def asked_thrice() -> bool:
            return len(await control_requests(client, "a")) >= 3

        await eventually(asked_thrice, what="three snapshot requests")
        await add(client, "a", Snapshot("a", EPOCH, 2, time.time(), {SSD: [1]}))
        await eventually(lambda: ing.status()["pending"] == [], what="the wait ended")
        assert (await index.entries("a"))[SSD] == {1}
    await index.close()


async def test_a_quiet_host_is_asked_for_a_snapshot_that_repairs_a_lost_last_batch(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a")
    # Batch 3 was lost on the way and nothing followed it: there is no gap to see.
    await add(client, "a", batch("a", 1, stored(1)), batch("a", 2, stored(2)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config(quiet_snapshot_s=0.2)) as ing:

        async def asked(times: int) -> bool:
            return await control_requests(client, "a") == [OP_SNAPSHOT] * times

        await eventually(lambda: asked(1), what="a snapshot request once quiet")
        # Nothing waits for it: the host is not pending, later batches would apply.
        assert ing.status()["pending"] == []
        await add(client, "a", Snapshot("a", EPOCH, 3, time.time(), {HBM: [1, 2, 3]}))

        async def repaired() -> bool:
            return await index.cursor("a") == (EPOCH, 3)

        await eventually(repaired, what="the snapshot applied")
        assert await index.entries("a") == held({1, 2, 3})
        # Only batches re-arm the check: one more batch, one more request.
        await add(client, "a", batch("a", 4, stored(4)))
        await eventually(lambda: asked(2), what="a second request after batch 4")
        assert ing.metrics.batch_count("gap") == 0
        assert (
            ing.metrics.registry.get_sample_value(
                "kvindex_ingest_snapshot_requests_total", {"reason": "quiet"}
            )
            == 2
        )
    await index.close()


async def beat(client: aioredis.Redis, host: str, events_seq: int, epoch: int = EPOCH) -> None:
    """A worker heartbeat naming ``events_seq`` as the last batch it formed."""
    view = WorkerView(host=host, model="m", block_size=16, epoch=epoch, events_seq=events_seq)
    await client.set(KS.heartbeat(host), encode_view(view), px=600_000)


async def test_a_heartbeat_ahead_of_the_stream_asks_for_a_snapshot_until_one_comes(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a", "b")
    # Batch 3 of "a" was lost and nothing followed it; "b" delivered all it formed.
    await add(client, "a", batch("a", 1, stored(1)), batch("a", 2, stored(2)))
    await add(client, "b", batch("b", 1, stored(7)))
    await beat(client, "a", 3)
    await beat(client, "b", 1)
    index = new_index("redis", redis_url)
    cfg = fast_config(tail_grace_s=0.3, snapshot_timeout_s=0.5)
    async with running(redis_url, index, cfg) as ing:

        async def applied() -> bool:
            return await index.cursor("a") == (EPOCH, 2)

        await eventually(applied, what="batches applied")

        async def asked(host: str, times: int) -> bool:
            return len(await control_requests(client, host)) >= times

        await eventually(lambda: asked("a", 1), what="a snapshot request for the lost tail")
        # Pending: unanswered, it is asked again; the host that lost nothing is never asked.
        assert ing.status()["pending"] == ["a"]
        await eventually(lambda: asked("a", 2), what="the request repeated")
        assert await control_requests(client, "b") == []
        await add(client, "a", Snapshot("a", EPOCH, 3, time.time(), {HBM: [1, 2, 3]}))

        async def repaired() -> bool:
            return await index.cursor("a") == (EPOCH, 3) and not ing.status()["pending"]

        await eventually(repaired, what="the snapshot applied")
        assert await index.entries("a") == held({1, 2, 3})
        requests = len(await control_requests(client, "a"))
        # Caught up: the heartbeat names nothing missing, no more requests.
        await asyncio.sleep(1.0)
        assert len(await control_requests(client, "a")) == requests
        assert await control_requests(client, "b") == []
        assert ing.metrics.batch_count("gap") == 0
        tail = ing.metrics.registry.get_sample_value(
            "kvindex_ingest_snapshot_requests_total", {"reason": "tail"}
        )
        assert tail == 1
    await index.close()


async def test_a_heartbeat_of_another_epoch_or_without_seq_asks_nothing(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a", "b")
    await add(client, "a", batch("a", 1, stored(1)))
    await add(client, "b", batch("b", 1, stored(2)))
    # "a" restarted (its new epoch's first message, a snapshot, is on its way); "b" runs a
    # worker that does not publish its seq. Neither is a lost tail.
    await beat(client, "a", 5, epoch=EPOCH + 1)
    await beat(client, "b", 0)
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config(tail_grace_s=0.2)) as ing:

        async def applied() -> bool:
            return await index.cursor("b") == (EPOCH, 1)

        await eventually(applied, what="batches applied")
        await asyncio.sleep(1.0)
        assert await control_requests(client, "a") == []
        assert await control_requests(client, "b") == []
        assert ing.status()["pending"] == []
    await index.close()


async def test_a_restarted_ingester_resumes_where_it_stopped(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a", "b")
    await add(client, "a", Snapshot("a", EPOCH, 0, 0.0, {}),
              *(batch("a", s, stored(s)) for s in range(1, 6)))  # fmt: skip
    await add(client, "b", *(batch("b", s, stored(100 + s)) for s in range(1, 4)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as first:
        await eventually(lambda: first.metrics.batch_count("applied") == 8)
    positions = await client.hgetall(KS.index("pos"))
    for host in ("a", "b"):
        newest: Any = await client.xrevrange(KS.events(host), count=1)
        assert positions[host.encode()] == newest[0][0]
    await add(client, "a", *(batch("a", s, stored(s)) for s in range(6, 10)))
    await add(client, "b", batch("b", 4, removed(101)))
    async with running(redis_url, index, fast_config("r2")) as second:

        async def caught_up() -> bool:
            return await index.cursor("a") == (EPOCH, 9) and await index.cursor("b") == (EPOCH, 4)

        await eventually(caught_up, what="both hosts caught up")
        # Nothing re-read, nothing lost: exactly the 5 new batches.
        assert second.metrics.batch_count("applied") == 5
        assert second.metrics.batch_count("duplicate") == 0
        assert snapshots(second) == 0
    assert await index.entries("a") == held(set(range(1, 10)))
    assert await index.entries("b") == held({102, 103})
    await index.close()


async def test_applied_entries_are_trimmed_from_the_stream(
    redis_url: str, client: aioredis.Redis
) -> None:
    """Streams stay as long as the ingester's lag, not their length cap: what is applied
    and persisted is trimmed, and a restarted ingester resumes without a gap."""
    await register(client, "a")
    n = 600
    await add(
        client, "a", Snapshot("a", EPOCH, 0, time.time(), {HBM: [1]}),
        *(batch("a", i, stored(1000 + i)) for i in range(1, n + 1)),
    )  # fmt: skip
    assert await client.xlen(KS.events("a")) == n + 1
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as ing:
        await eventually(lambda: ing.metrics.batch_count("applied") == n, what="all applied")

        async def trimmed() -> bool:
            # Approximate trimming drops whole stream nodes (100 entries by default).
            return int(await client.xlen(KS.events("a"))) <= 100

        await eventually(trimmed, what="the applied entries trimmed")
        assert len((await index.entries("a"))[HBM]) == n + 1
    async with running(redis_url, index, fast_config()) as ing:
        await add(client, "a", batch("a", n + 1, stored(7)))
        await eventually(lambda: ing.metrics.batch_count("applied") == 1)
        assert ing.metrics.batch_count("gap") == 0
        assert 7 in (await index.entries("a"))[HBM]
    await index.close()


async def test_a_stream_trimmed_past_the_position_asks_for_a_snapshot(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a")
    await add(client, "a", *(batch("a", s, stored(s)) for s in range(1, 4)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as first:
        await eventually(lambda: first.metrics.batch_count("applied") == 3)
    await add(client, "a", *(batch("a", s, stored(s)) for s in range(4, 9)))
    await client.xtrim(KS.events("a"), maxlen=2, approximate=False)
    async with running(redis_url, index, fast_config()) as second:

        async def asked() -> bool:
            return await control_requests(client, "a") == [OP_SNAPSHOT]

        await eventually(asked, what="a snapshot request")
        assert second.metrics.batch_count("gap") == 1
        assert await index.cursor("a") == (EPOCH, 3)
    await index.close()


async def test_two_replicas_split_the_hosts_without_applying_anything_twice(
    redis_url: str, client: aioredis.Redis
) -> None:
    hosts = [f"w{i}" for i in range(8)]
    await register(client, *hosts)
    seq = dict.fromkeys(hosts, 0)

    async def feed(rounds: int) -> None:
        for _ in range(rounds):
            for h in hosts:
                seq[h] += 1
                await add(client, h, batch(h, seq[h], stored(seq[h]), removed(seq[h] - 1)))

    await feed(10)
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    index_a, index_b = new_index("redis", redis_url, reg_a), new_index("redis", redis_url, reg_b)
    async with (
        running(redis_url, index_a, fast_config("A"), reg_a) as a,
        running(redis_url, index_b, fast_config("B"), reg_b) as b,
    ):
        deadline = time.monotonic() + 20
        while not (a.owned and b.owned and sorted(a.owned + b.owned) == hosts):
            assert time.monotonic() < deadline, "the replicas did not split the hosts"
            await feed(1)
        assert not set(a.owned) & set(b.owned)
        await feed(5)

        async def all_applied() -> bool:
            cursors = [await index_a.cursor(h) for h in hosts]
            return cursors == [(EPOCH, seq[h]) for h in hosts]

        await eventually(all_applied, what="every batch applied")

        def applied(reg: CollectorRegistry) -> float:
            return reg.get_sample_value("kvindex_batches_total", {"result": "applied"}) or 0.0

        assert applied(reg_a) + applied(reg_b) == sum(seq.values())
        assert a.metrics.batch_count("applied") + b.metrics.batch_count("applied") == sum(
            seq.values()
        )
        assert a.metrics.batch_count("applied") > 0
        assert b.metrics.batch_count("applied") > 0
        # A stops: B takes its hosts over and carries on from A's positions.
        await a.stop()
        await eventually(lambda: b.owned == hosts, what="B owns every host")
        await feed(2)
        await eventually(all_applied, what="every batch applied after the handover")
        assert applied(reg_a) + applied(reg_b) == sum(seq.values())
    for h in hosts:
        assert await index_b.entries(h) == held({seq[h]})
    await index_a.close()
    await index_b.close()


async def test_undecodable_entries_are_counted_and_skipped(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "a")
    await add(client, "a", b"\xc1 not msgpack", batch("a", 1, stored(1)))
    await client.xadd(KS.events("a"), {b"other": b"field"})
    await add(client, "a", batch("b", 1, stored(66)), b"\x93\x01\x02", batch("a", 2, stored(2)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as ing:
        await eventually(lambda: ing.metrics.batch_count("applied") == 2)
        assert ing.metrics.registry.get_sample_value("kvindex_ingest_decode_errors_total") == 4
        assert await index.entries("a") == held({1, 2})
        assert await index.hosts() == ["a"]
    await index.close()


async def test_a_host_whose_heartbeat_expired_is_purged(
    redis_url: str, client: aioredis.Redis
) -> None:
    await register(client, "b")
    await register(client, "a", ttl_ms=300)
    await add(client, "a", batch("a", 1, stored(1, 2)))
    await add(client, "b", batch("b", 1, stored(1)))
    index = new_index("redis", redis_url)
    async with running(redis_url, index, fast_config()) as ing:
        await eventually(
            lambda: ing.metrics.registry.get_sample_value("kvindex_ingest_dead_hosts_total") == 1,
            what="a purged",
        )
        assert ing.metrics.registry.get_sample_value("kvindex_ingest_purged_entries_total") == 2
        assert await index.cursor("a") is None
        assert await index.entries("a") == held()
        assert await index.entries("b") == held({1})
        # The host comes back (a new epoch starts with a snapshot): indexed again.
        await register(client, "a")
        await add(client, "a", Snapshot("a", 77, 0, time.time(), {DRAM: [5]}))

        async def back() -> bool:
            return await index.entries("a") == held(dram={5})

        await eventually(back, what="a indexed again")
    await index.close()


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    server = RedisProcess()
    server.start()
    yield server
    server.close()


async def test_after_redis_lost_its_data_snapshots_rebuild_the_index(
    own_redis: RedisProcess,
) -> None:
    url = own_redis.url
    client = aioredis.Redis.from_url(url)
    await register(client, "a")
    await add(client, "a", Snapshot("a", EPOCH, 0, 0.0, {HBM: [1]}), batch("a", 1, stored(2)))
    index = new_index("redis", url)
    async with running(url, index, fast_config()) as ing:

        async def at(seq: int) -> bool:
            return await index.cursor("a") == (EPOCH, seq)

        await eventually(lambda: at(1), what="batch 1 applied")
        own_redis.restart()
        await client.aclose()
        client = aioredis.Redis.from_url(url)
        # The worker comes back into the empty Redis and publishes its next batch.
        await register(client, "a")
        await add(client, "a", batch("a", 2, stored(3)))

        async def asked() -> bool:
            return OP_SNAPSHOT in await control_requests(client, "a")

        await eventually(asked, what="a snapshot request after the data loss")
        await add(client, "a", Snapshot("a", EPOCH, 2, time.time(), {HBM: [1, 2, 3]}))
        await add(client, "a", batch("a", 3, stored(4)))
        await eventually(lambda: at(3), what="index rebuilt")
        assert await index.entries("a") == held({1, 2, 3, 4})
        assert ing.healthy
    await index.close()
    await client.aclose()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    c = RedisCluster(3)
    c.start()
    yield c
    c.close()


async def test_on_a_redis_cluster_streams_are_read_per_node(cluster: RedisCluster) -> None:
    client = aioredis.RedisCluster.from_url(cluster.url)
    hosts = [f"node-host-{i}" for i in range(6)]
    await register(client, *hosts)
    for h in hosts:
        await add(client, h, Snapshot(h, EPOCH, 0, 0.0, {}), batch(h, 1, stored(1)),
                  batch(h, 2, stored(2)))  # fmt: skip
    await add(client, hosts[0], batch(hosts[0], 4, stored(4)))
    index = RedisIndex(cluster.url, KS, layout=SMALL)
    async with running(cluster.url, index, fast_config()) as ing:
        await eventually(lambda: ing.metrics.batch_count("applied") == 12, what="12 applied")

        async def asked() -> bool:
            entries: Any = await client.xrange(KS.control(hosts[0]))
            return [f[b"op"] for _, f in entries] == [OP_SNAPSHOT]

        await eventually(asked, what="a snapshot request")
        for h in hosts:
            assert await index.entries(h) == held({1, 2})
    await index.close()
    await client.aclose()


async def test_bad_settings_are_refused(redis_url: str) -> None:
    with pytest.raises(ValueError, match="block_ms"):
        IngestConfig(block_ms=0)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        IngestConfig(lease_ttl_s=0)
    text_client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        Ingester(text_client, MemoryIndex())
    await text_client.aclose()
