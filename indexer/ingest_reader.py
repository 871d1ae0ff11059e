"""Reads many hosts' event streams at once: one XREAD on a single Redis, per node on a cluster.

Single Redis: one ``XREAD COUNT n BLOCK ms STREAMS k1 .. kH id1 .. idH``
covers every owned host; it returns as soon as any stream has entries.

Redis Cluster: a multi-key command must stay within one hash slot, and the
streams ``{p}:ev:{host}`` carry no common tag, so a single XREAD cannot
span them. The reader pipelines one non-blocking XREAD per stream; the
cluster client groups the pipeline by node and sends each node its share
in one round trip, in parallel. When nothing was new it waits ``block_ms``
before the next poll (interruptibly), as BLOCK would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError
from redis.typing import KeyT, StreamIdT

__all__ = ["Entries", "StreamReader", "client_for", "open_client"]

log = logging.getLogger(__name__)

Client = aioredis.Redis | RedisCluster
#: Per stream key, its new entries in order: (entry id, fields).
Entries = dict[bytes, list[tuple[bytes, dict[bytes, bytes]]]]


async def open_client(url: str, *, socket_timeout: float = 10.0) -> Client:
    """A bytes-responses client for ``url``, a cluster client if the server is in cluster mode."""
    probe = aioredis.Redis.from_url(
        url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
    )
    try:
        info = await probe.info("cluster")
    except BaseException:
        await probe.aclose()
        raise
    if int(info.get("cluster_enabled", 0)) != 1:
        return probe
    await probe.aclose()
    cluster = RedisCluster.from_url(url, socket_timeout=socket_timeout)
    await cluster.initialize()
    return cluster


async def client_for(url: str, *, socket_timeout: float = 2.0) -> Client:
    """:func:`open_client`, or, while Redis does not answer, a single-node client.

    For services that must start without Redis (they degrade and reconnect):
    a single-node client reconnects by itself; whether the server is a
    cluster is only known once it answers, so a service started while a
    Redis Cluster is down keeps failing over to its degraded mode until it
    restarts (logged).
    """
    try:
        return await open_client(url, socket_timeout=socket_timeout)
    except (RedisError, OSError) as exc:
        log.warning("Redis at %s does not answer (%s): assuming a single node", url, exc)
        return aioredis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )


def _key(raw: bytes | str) -> bytes:
    return raw.encode() if isinstance(raw, str) else raw


class StreamReader:
    """Fetches the entries after given positions from many streams.

    Args:
        client: The ingester's client (bytes responses).
        count: Entries per stream per read.
        block_ms: How long a read waits for anything new.
    """

    def __init__(self, client: Client, *, count: int, block_ms: int) -> None:
        self.client = client
        self.count = count
        self.block_ms = block_ms

    async def read(self, positions: Mapping[str, bytes], stop: asyncio.Event) -> Entries:
        """New entries of the streams ``positions`` names, after each position.

        Waits up to ``block_ms`` when there are none (returns early once ``stop`` is set).
        """
        if not positions:
            await _wait(stop, self.block_ms)
            return {}
        if isinstance(self.client, RedisCluster):
            return await self._read_cluster(positions, stop)
        streams: dict[KeyT, StreamIdT] = {name: pos for name, pos in positions.items()}
        reply: Any = await self.client.xread(streams, count=self.count, block=self.block_ms)
        return {_key(name): list(entries) for name, entries in reply or []}

    async def _read_cluster(self, positions: Mapping[str, bytes], stop: asyncio.Event) -> Entries:
        names = list(positions)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.xread({name: positions[name]}, count=self.count)
        replies: list[Any] = await pipe.execute()
        out: Entries = {}
        for reply in replies:
            for name, entries in reply or []:
                if entries:
                    out[_key(name)] = list(entries)
        if not out:
            await _wait(stop, self.block_ms)
        return out


async def _wait(stop: asyncio.Event, ms: int) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), ms / 1000)
