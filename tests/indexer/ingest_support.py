"""Helpers of the ingestion tests: fast timings, stream writers, polling with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from indexer.events import BlockRemoved, BlockStored, Event, EventBatch, Snapshot, encode_message
from indexer.ingest import IngestConfig
from indexer.media import Medium
from indexer.registry import RedisHostRegistry
from indexer.wire import CONTROL_FIELD, EVENT_FIELD, Keyspace

__all__ = [
    "EPOCH",
    "KS",
    "add",
    "batch",
    "control_requests",
    "eventually",
    "fast_config",
    "register",
    "removed",
    "stored",
]

KS = Keyspace()
Client = aioredis.Redis | aioredis.RedisCluster
EPOCH = 41


def fast_config(replica: str = "r1", **kw: Any) -> IngestConfig:
    """Short timings so that tests finish in seconds."""
    base: dict[str, Any] = {
        "replica_id": replica, "block_ms": 50, "refresh_interval_s": 0.1, "lease_ttl_s": 1.5,
        "dead_check_interval_s": 0.3, "snapshot_timeout_s": 30.0, "quiet_snapshot_s": 0.0,
    }  # fmt: skip
    base.update(kw)
    return IngestConfig(**base)


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    within: float = 15.0,
    what: str = "condition",
) -> None:
    """Poll ``check`` until it is true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {within}s")
        await asyncio.sleep(0.02)


def stored(*keys: int, medium: Medium = Medium.HBM) -> BlockStored:
    return BlockStored(list(keys), None, medium)


def removed(*keys: int, medium: Medium = Medium.HBM) -> BlockRemoved:
    return BlockRemoved(list(keys), medium)


def batch(host: str, seq: int, *events: Event, epoch: int = EPOCH) -> EventBatch:
    return EventBatch(host, epoch, seq, time.time(), list(events))


async def register(client: Client, *hosts: str, ttl_ms: int = 600_000) -> None:
    """Put hosts in the registry with a live heartbeat, as workers do."""
    registry = RedisHostRegistry(client, KS)
    for host in hosts:
        await registry.get_or_create(host)
        await client.set(KS.heartbeat(host), b"alive", px=ttl_ms)


async def add(client: Client, host: str, *messages: EventBatch | Snapshot | bytes) -> None:
    """XADD messages (or raw payloads) to ``host``'s stream, as its worker publishes them."""
    for m in messages:
        payload = m if isinstance(m, bytes) else encode_message(m)
        await client.xadd(KS.events(host), {EVENT_FIELD: payload})


async def control_requests(client: Client, host: str) -> list[bytes]:
    """The ops written to a host's control stream, oldest first."""
    entries: Any = await client.xrange(KS.control(host))
    return [fields[CONTROL_FIELD] for _, fields in entries]
