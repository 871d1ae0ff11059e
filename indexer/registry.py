"""Host registry: host name <-> small integer id.

Index entries store a host's id (22 bits, packed with the medium in 3
bytes), never its name. Ids are handed out once per name and kept: a host
that is purged and comes back gets its old id. Clients cache both
directions; if Redis loses its data (a restart without persistence) the
ids start again from 1, so the index checks an incarnation token on every
call and makes the registry :meth:`RedisHostRegistry.forget` its cache. The Redis registry uses
the keys of :class:`indexer.wire.Keyspace` (``hosts``, ``hostnames``,
``hostid``) with no Lua, so it works unchanged on Redis Cluster where the
three keys live on different slots:

1. ``HGET hosts name`` -- known: done (and cached client-side for good).
2. ``INCR hostid`` -> a fresh id; ``HSET hostnames id name`` first, so that
   an id is never visible before its name can be resolved;
3. ``HSETNX hosts name id`` -- if another client won the race, its id is
   used and the fresh one is dropped from ``hostnames``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from indexer.wire import Keyspace

__all__ = [
    "MAX_HOST_ID",
    "HostRegistry",
    "InMemoryHostRegistry",
    "RedisHostRegistry",
    "RegistryFullError",
]

#: Largest host id an index entry can carry (22 bits).
MAX_HOST_ID = (1 << 22) - 1
_MAX_NAME = 256


class RegistryFullError(RuntimeError):
    """Every host id has been handed out."""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _check_name(host: str) -> None:
    if not isinstance(host, str) or not 0 < len(host) <= _MAX_NAME:
        raise ValueError(f"host name must be a string of 1..{_MAX_NAME} characters: {host!r}")


class HostRegistry(Protocol):
    """Maps host names to small ids and back; ids never change once given."""

    async def get_or_create(self, host: str) -> int:
        """The host's id, assigning the next free one if it has none."""
        ...

    async def lookup(self, host: str) -> int | None:
        """The host's id, or None if it was never registered."""
        ...

    async def names(self, ids: Iterable[int]) -> dict[int, str]:
        """Names of the given ids (unknown ids are absent)."""
        ...


class InMemoryHostRegistry:
    """The registry of :class:`indexer.index.memory.MemoryIndex` (one process)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def id_of(self, host: str, *, create: bool = True) -> int | None:
        """Synchronous core of :meth:`get_or_create` / :meth:`lookup`."""
        hid = self._ids.get(host)
        if hid is None and create:
            _check_name(host)
            hid = len(self._ids) + 1
            if hid > MAX_HOST_ID:
                raise RegistryFullError(f"no host id left for {host!r}")
            self._ids[host] = hid
            self._names[hid] = host
        return hid

    def name_of(self, hid: int) -> str:
        """Name of a registered id (KeyError otherwise)."""
        return self._names[hid]

    async def get_or_create(self, host: str) -> int:
        """The host's id, assigning the next free one if it has none."""
        hid = self.id_of(host)
        assert hid is not None
        return hid

    async def lookup(self, host: str) -> int | None:
        """The host's id, or None if it was never registered."""
        return self._ids.get(host)

    async def names(self, ids: Iterable[int]) -> dict[int, str]:
        """Names of the given ids (unknown ids are absent)."""
        return {i: self._names[i] for i in ids if i in self._names}


class RedisHostRegistry:
    """The registry shared by every indexer and router through Redis (single node or cluster).

    Args:
        client: A redis.asyncio client (or cluster client); responses as bytes.
        keyspace: Where the registry's keys live.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, keyspace: Keyspace) -> None:
        self._client = client
        self._ks = keyspace
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def forget(self) -> None:
        """Drop the client-side cache (the index calls it when Redis lost its data)."""
        self._ids.clear()
        self._names.clear()

    def _remember(self, host: str, hid: int) -> int:
        self._ids[host] = hid
        self._names[hid] = host
        return hid

    async def lookup(self, host: str) -> int | None:
        """The host's id, or None if it was never registered."""
        hid = self._ids.get(host)
        if hid is not None:
            return hid
        raw = await self._client.hget(self._ks.hosts, host)
        return None if raw is None else self._remember(host, int(_text(raw)))

    async def get_or_create(self, host: str) -> int:
        """The host's id, assigning the next free one if it has none.

        Raises:
            ValueError: the name is empty or longer than 256 characters.
            RegistryFullError: every id up to :data:`MAX_HOST_ID` is taken.
        """
        hid = await self.lookup(host)
        if hid is not None:
            return hid
        _check_name(host)
        fresh = int(await self._client.incr(self._ks.host_id_counter))
        if fresh > MAX_HOST_ID:
            raise RegistryFullError(f"no host id left for {host!r} (last given {fresh - 1})")
        await self._client.hset(self._ks.hostnames, str(fresh), host)
        if await self._client.hsetnx(self._ks.hosts, host, str(fresh)):
            return self._remember(host, fresh)
        await self._client.hdel(self._ks.hostnames, str(fresh))
        raw = await self._client.hget(self._ks.hosts, host)
        if raw is None:
            raise RuntimeError(f"host {host!r} vanished from the registry while being added")
        return self._remember(host, int(_text(raw)))

    async def names(self, ids: Iterable[int]) -> dict[int, str]:
        """Names of the given ids (unknown ids are absent)."""
        wanted = list(dict.fromkeys(ids))
        out = {i: self._names[i] for i in wanted if i in self._names}
        missing = [i for i in wanted if i not in out]
        if missing:
            raw = await self._client.hmget(self._ks.hostnames, [str(i) for i in missing])
            for hid, name in zip(missing, raw, strict=True):
                if name is not None:
                    out[hid] = self._names[hid] = _text(name)
                    self._ids.setdefault(out[hid], hid)
        return out
