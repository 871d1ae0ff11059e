"""The host registry: one small id per host name, shared through Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from indexer.registry import (
    MAX_HOST_ID,
    InMemoryHostRegistry,
    RedisHostRegistry,
    RegistryFullError,
)
from indexer.wire import Keyspace


async def test_ids_are_stable_and_shared_between_clients(redis_url: str) -> None:
    c1, c2 = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
    try:
        r1, r2 = RedisHostRegistry(c1, Keyspace()), RedisHostRegistry(c2, Keyspace())
        a = await r1.get_or_create("worker-a")
        b = await r1.get_or_create("worker-b")
        assert a != b
        assert await r2.get_or_create("worker-a") == a
        assert await r2.lookup("worker-b") == b
        assert await r2.lookup("nobody") is None
        assert await r2.names([b, a, 999]) == {a: "worker-a", b: "worker-b"}
        # Ids live under the Keyspace names that discovery reads.
        assert await c1.hget("kvr:hosts", "worker-a") == str(a).encode()
        assert await c1.hget("kvr:hostnames", str(b)) == b"worker-b"
    finally:
        await c1.aclose()
        await c2.aclose()


async def test_concurrent_registration_of_one_name_gives_one_id(redis_url: str) -> None:
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(4)]
    try:
        registries = [RedisHostRegistry(c, Keyspace("race")) for c in clients]
        ids = await asyncio.gather(
            *(r.get_or_create(f"host-{i % 3}") for i in range(24) for r in registries)
        )
        by_name: dict[str, set[int]] = {}
        for i, hid in enumerate(ids):
            by_name.setdefault(f"host-{(i // len(registries)) % 3}", set()).add(hid)
        assert all(len(s) == 1 for s in by_name.values())
        assert len({next(iter(s)) for s in by_name.values()}) == 3
        names = await registries[0].names(next(iter(s)) for s in by_name.values())
        assert sorted(names.values()) == ["host-0", "host-1", "host-2"]
    finally:
        for c in clients:
            await c.aclose()


async def test_running_out_of_ids_is_an_error(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set(Keyspace().host_id_counter, MAX_HOST_ID - 1)
        registry = RedisHostRegistry(client, Keyspace())
        assert await registry.get_or_create("last") == MAX_HOST_ID
        with pytest.raises(RegistryFullError):
            await registry.get_or_create("one-too-many")
        assert await registry.lookup("one-too-many") is None
        assert await registry.get_or_create("last") == MAX_HOST_ID
    finally:
        await client.aclose()


async def test_bad_names_are_refused(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        registry = RedisHostRegistry(client, Keyspace())
        with pytest.raises(ValueError, match="host name"):
            await registry.get_or_create("")
        with pytest.raises(ValueError, match="host name"):
            await registry.get_or_create("x" * 257)
        assert await client.exists("kvr:hosts", "kvr:hostid") == 0
    finally:
        await client.aclose()


async def test_forget_drops_ids_redis_no_longer_has(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        registry = RedisHostRegistry(client, Keyspace())
        await registry.get_or_create("a")
        b = await registry.get_or_create("b")
        await client.flushall()
        registry.forget()
        assert await registry.lookup("b") is None
        assert await registry.get_or_create("b") == 1
        assert await registry.names([1, b]) == {1: "b"}
    finally:
        await client.aclose()


async def test_in_memory_registry() -> None:
    registry = InMemoryHostRegistry()
    a = await registry.get_or_create("a")
    assert await registry.get_or_create("b") != a
    assert await registry.get_or_create("a") == a
    assert await registry.lookup("c") is None
    assert registry.id_of("c", create=False) is None
    assert await registry.names([a, 42]) == {a: "a"}
    with pytest.raises(ValueError, match="host name"):
        await registry.get_or_create("")
