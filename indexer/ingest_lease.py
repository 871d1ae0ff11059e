"""Host leases: several ingester replicas split the hosts, one consumer per host at a time.

Keys (under the index's ``{p}:idx:`` prefix, one key each, so they work on a
Redis Cluster too):

* ``own:{host}`` -- ``SET NX PX ttl`` holds the replica id of the host's
  consumer; the owner renews it (compare-and-PEXPIRE) and deletes it
  (compare-and-DEL) when it lets go. A replica that dies stops renewing, so
  another one takes the host after at most one TTL.
* ``replicas`` -- a sorted set of live replicas scored by when their
  membership expires; each replica re-adds itself at every balance.

Balance, every ``ttl / 3``: with H hosts and N live replicas a replica keeps
at most ``ceil(H / N)`` hosts, releasing the surplus and taking free hosts
up to that share. Which hosts a replica prefers is decided by rendezvous
hashing (``xxh3(host, replica)``, highest wins), so shares are stable and a
joining replica draws hosts from every other one. A handover may let two
replicas read a host's stream for a moment; the index's per-host cursor
makes the second apply of a batch a duplicate, so nothing is applied twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from indexer.ingest_reader import Client
from indexer.wire import Keyspace

__all__ = ["HostLeases", "LeaseChanges"]


_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def preference(host: str, replica: str) -> int:
    """Rendezvous score of ``replica`` for ``host`` (the highest live score wins)."""
    return xxhash.xxh3_64_intdigest(f"{host}\0{replica}".encode())


@dataclass(slots=True)
class LeaseChanges:
    """What one balance changed."""

    acquired: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    replicas: int = 1


class HostLeases:
    """This replica's leases.

    Args:
        client: Redis client (single node or cluster).
        keyspace: Key prefix shared with workers and routers.
        replica_id: This replica's name (unique among replicas).
        ttl_s: Lease and membership lifetime; renewed every ``ttl_s / 3``.
    """

    def __init__(self, client: Client, keyspace: Keyspace, replica_id: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s}")
        self.client = client
        self.keyspace = keyspace
        self.replica_id = replica_id
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.owned: set[str] = set()
        self._replicas_key = keyspace.index("replicas")

    def lease_key(self, host: str) -> str:
        """The lease key of ``host``."""
        return self.keyspace.index(f"own:{host}")

    async def _live_replicas(self, now_ms: int) -> list[str]:
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self._replicas_key, {self.replica_id: now_ms + self.ttl_ms})
        pipe.zremrangebyscore(self._replicas_key, "-inf", now_ms)
        pipe.zrange(self._replicas_key, 0, -1)
        *_, members = await pipe.execute()
        live = {_text(m) for m in members} | {self.replica_id}
        return sorted(live)

    async def _each(self, script: str, hosts: Sequence[str]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for host in hosts:
            pipe.execute_command("EVAL", script, 1, self.lease_key(host), self.replica_id,
                                 self.ttl_ms)  # fmt: skip
        return list(await pipe.execute()) if hosts else []

    async def balance(self, hosts: Sequence[str], now_ms: int) -> LeaseChanges:
        """Renew, release the surplus, take free hosts up to this replica's fair share.

        Args:
            hosts: Every registered host.
            now_ms: Wall clock in milliseconds (membership expiry is absolute).
        """
        live = await self._live_replicas(now_ms)
        changes = LeaseChanges(replicas=len(live))
        owned = sorted(self.owned)
        for host, ok in zip(owned, await self._each(_RENEW, owned), strict=True):
            if not int(ok):
                self.owned.discard(host)
                changes.lost.append(host)
        registered = set(hosts)
        quota = math.ceil(len(registered) / len(live))

        def mine_first(host: str) -> tuple[bool, int]:
            best = max(live, key=lambda r: preference(host, r))
            return best != self.replica_id, -preference(host, self.replica_id)

        gone = [h for h in self.owned if h not in registered]
        surplus = sorted(self.owned - set(gone), key=mine_first)[quota:]
        if gone or surplus:
            await self.release([*gone, *surplus])
            changes.released += [*gone, *surplus]
        candidates = sorted((h for h in registered if h not in self.owned), key=mine_first)
        while candidates and len(self.owned) < quota:
            take, candidates = (
                candidates[: quota - len(self.owned)],
                candidates[quota - len(self.owned) :],
            )
            pipe = self.client.pipeline(transaction=False)
            for host in take:
                pipe.set(self.lease_key(host), self.replica_id, nx=True, px=self.ttl_ms)
            for host, got in zip(take, await pipe.execute(), strict=True):
                if got:
                    self.owned.add(host)
                    changes.acquired.append(host)
        return changes

    async def release(self, hosts: Sequence[str]) -> None:
        """Let ``hosts`` go (only leases this replica still holds are deleted)."""
        await self._each(_RELEASE, list(hosts))
        self.owned.difference_update(hosts)

    async def leave(self) -> None:
        """Release every lease and leave the replica set (a clean stop)."""
        await self.release(sorted(self.owned))
        await self.client.zrem(self._replicas_key, self.replica_id)
