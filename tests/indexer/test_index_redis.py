"""Behaviour of the Redis index a user would notice beyond the shared suite.

Restarts (data lost), scripts flushed from Redis' cache, a mismatched
layout, Redis down, the default layout, and host ids near their 22-bit limit.
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from indexer.events import BlockStored, EventBatch, Snapshot
from indexer.index import (
    ApplyStatus,
    IndexLayout,
    IndexUnavailableError,
    LayoutMismatchError,
    RedisIndex,
)
from indexer.media import Medium
from indexer.metrics import IndexMetrics
from indexer.registry import MAX_HOST_ID
from indexer.views import PrefixMatch
from indexer.wire import Keyspace
from tests.support.redis_proc import RedisProcess

SMALL = IndexLayout(key_bits=6, host_bits=5, group_bits=4)


def stored_batch(host: str, seq: int, *keys: int, epoch: int = 7) -> EventBatch:
    return EventBatch(host, epoch, seq, 0.0, [BlockStored(list(keys), None, Medium.HBM)])


async def test_restart_empties_the_index_and_names_stay_right(
    redis_server: RedisProcess, redis_url: str
) -> None:
    indexer = RedisIndex(redis_url, layout=SMALL)
    router = RedisIndex(redis_url, layout=SMALL)
    try:
        await indexer.apply(stored_batch("alpha", 1, 1, 2, 3))
        await indexer.apply(stored_batch("beta", 1, 1))
        assert set(await router.match([1, 2])) == {"alpha", "beta"}

        redis_server.restart()

        assert await indexer.cursor("alpha") is None
        assert await indexer.match([1, 2, 3]) == {}
        assert await indexer.hosts() == []
        assert (await indexer.stats()).total == 0
        # The ingester re-snapshots; ids are handed out again from 1, in another order.
        await indexer.replace(Snapshot("beta", 9, 0, 0.0, {Medium.DRAM: [1, 2]}))
        assert (await indexer.apply(stored_batch("alpha", 1, 5, epoch=3))).status is (
            ApplyStatus.APPLIED
        )
        # A client that cached the old ids still names the hosts right.
        assert await router.match([1, 2]) == {"beta": PrefixMatch("beta", 2, (0, 2, 0))}
        assert await router.match([5]) == {"alpha": PrefixMatch("alpha", 1, (1, 0, 0))}
        assert await router.hosts() == ["alpha", "beta"]
    finally:
        await indexer.close()
        await router.close()


async def test_scripts_are_reloaded_after_script_flush(redis_url: str) -> None:
    idx = RedisIndex(redis_url, layout=SMALL)
    try:
        await idx.apply(stored_batch("a", 1, 1, 2))
        client = redis.Redis.from_url(redis_url)
        client.script_flush()
        client.close()
        assert await idx.match([1, 2]) == {"a": PrefixMatch("a", 2, (2, 0, 0))}
        assert (await idx.apply(stored_batch("a", 2, 3))).status is ApplyStatus.APPLIED
    finally:
        await idx.close()


async def test_a_client_with_another_layout_is_refused(redis_url: str) -> None:
    first = RedisIndex(redis_url, Keyspace("shared"), layout=SMALL)
    other = RedisIndex(redis_url, Keyspace("shared"), layout=IndexLayout())
    try:
        await first.apply(stored_batch("a", 1, 1))
        with pytest.raises(LayoutMismatchError):
            await other.match([1])
    finally:
        await first.close()
        await other.close()


async def test_redis_down_raises_unavailable_and_counts(
    redis_server: RedisProcess, redis_url: str
) -> None:
    registry = CollectorRegistry()
    idx = RedisIndex(redis_url, layout=SMALL, metrics=IndexMetrics(registry))
    try:
        await idx.apply(stored_batch("a", 1, 1))
        redis_server.stop()
        with pytest.raises(IndexUnavailableError):
            await idx.match([1])
        assert registry.get_sample_value("kvindex_redis_errors_total", {"op": "match"}) == 1
    finally:
        redis_server.start()
        await idx.close()


async def test_default_layout_round_trip(redis_url: str) -> None:
    idx = RedisIndex(redis_url)
    try:
        keys = list(range(1 << 40, (1 << 40) + 300))
        await idx.apply(stored_batch("a", 1, *keys))
        await idx.replace(Snapshot("b", 1, 0, 0.0, {Medium.SSD: keys[:100]}))
        got = await idx.match(keys)
        assert got == {
            "a": PrefixMatch("a", 300, (300, 0, 0)),
            "b": PrefixMatch("b", 100, (0, 0, 100)),
        }
        assert await idx.purge("a") == 300
        assert await idx.match(keys) == {"b": PrefixMatch("b", 100, (0, 0, 100))}
        stats = await idx.stats()
        assert stats.total == 100
        assert stats.memory_bytes is not None
        assert stats.memory_bytes > 0
    finally:
        await idx.close()


async def test_host_ids_up_to_22_bits_round_trip(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.set(Keyspace().host_id_counter, MAX_HOST_ID - 3)
    idx = RedisIndex(client, layout=SMALL)
    try:
        for i, host in enumerate(["w1", "w2", "w3"]):
            await idx.apply(stored_batch(host, 1, *range(10, 12 + i)))
        got = await idx.match([10, 11, 12, 13])
        assert {h: m.blocks for h, m in got.items()} == {"w1": 2, "w2": 3, "w3": 4}
        assert await idx.purge("w2") == 3
        got = await idx.match([10, 11, 12, 13])
        assert {h: m.blocks for h, m in got.items()} == {"w1": 2, "w3": 4}
    finally:
        await idx.close()
        await client.aclose()


async def test_a_passed_client_is_left_open(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    idx = RedisIndex(client, layout=SMALL)
    await idx.apply(stored_batch("a", 1, 1))
    await idx.close()
    assert await client.ping()
    await client.aclose()


async def test_a_decoding_client_is_refused(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    idx = RedisIndex(client, layout=SMALL)
    with pytest.raises(ValueError, match="decode_responses"):
        await idx.match([1])
    await client.aclose()
