"""The Redis index on a Redis Cluster: routing by group, one call per node.

Every key of the index carries the hash tag of its group (the top
``group_bits`` bits of the block key), so a group lives on one slot and
one node. A call to a node covers the groups that node serves; the Lua
scripts, flagged ``allow-cross-slot-keys``, may touch any of them in one
atomic call. A batch is split per node with its events kept in order
(``cleared`` goes to every node); a chain lookup sends each node its keys
and combines the per-key answers client-side.

The host cursor (one key) is read before and written after the per-node
calls; group cursors let a replay of a batch cut short between nodes
finish it without applying any part twice (docs/index.md, "Redis Cluster").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, MovedError, RedisError, ResponseError, SlotNotCoveredError

from indexer.events import AllCleared, BlockStored, EventBatch, Snapshot
from indexer.index.base import (
    ApplyResult,
    ApplyStatus,
    Cursor,
    batch_blocks,
    batch_order,
    snapshot_is_stale,
)
from indexer.index.layout import IndexLayout, cursor_text, pack_keys, parse_cursor, unpack_holders
from indexer.index.prefix import PrefixCounts, longest_prefixes
from indexer.index.scripts import SCRIPTS, Args, LuaScript, run_script
from indexer.media import Medium
from indexer.wire import Keyspace

__all__ = ["ClusterOps", "ClusterRouter", "NodeShare"]

_T = TypeVar("_T")


@dataclass(slots=True)
class NodeShare:
    """What one node gets of a call.

    Attributes:
        node: The node.
        groups: Groups the call covers there (those of its keys, or all it
            serves for a cleared/replace/purge).
        args: The call's event or snapshot arguments for that node.
        positions: The index in the chain of each key sent.
        keys: The 8-byte keys sent, in order.
    """

    node: ClusterNode
    groups: set[int] = field(default_factory=set)
    args: Args = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


class ClusterRouter:
    """Maps groups to the primaries serving them, from the client's slot table."""

    def __init__(self, client: RedisCluster, layout: IndexLayout) -> None:
        self._client = client
        self._shift = 64 - layout.group_bits
        self._slots = layout.group_slots()
        self._nodes: list[ClusterNode] = []

    def refresh(self) -> None:
        """Re-read the group -> node map from the client's (current) slot table."""
        manager = self._client.nodes_manager
        self._nodes = [manager.get_node_from_slot(s) for s in self._slots]

    async def reload(self) -> None:
        """Ask the cluster for its slot table again (after a slot moved), then refresh."""
        await self._client.nodes_manager.initialize()
        self.refresh()

    def node_of_group(self, group: int) -> ClusterNode:
        """The primary serving ``group``."""
        if not self._nodes:
            self.refresh()
        return self._nodes[group]

    def all_groups(self) -> dict[str, NodeShare]:
        """Every node with every group it serves (for cleared, replace, purge)."""
        if not self._nodes:
            self.refresh()
        shares: dict[str, NodeShare] = {}
        for g, node in enumerate(self._nodes):
            if node.name not in shares:
                shares[node.name] = NodeShare(node)
            shares[node.name].groups.add(g)
        return shares

    def split_keys(self, packed: bytes) -> dict[str, NodeShare]:
        """Send each key of ``packed`` (see layout.pack_keys) to its node, with its position."""
        shares: dict[str, NodeShare] = {}
        for i in range(len(packed) // 8):
            k = packed[8 * i : 8 * i + 8]
            g = self.group_of_packed(k)
            node = self.node_of_group(g)
            if node.name not in shares:
                shares[node.name] = NodeShare(node)
            share = shares[node.name]
            share.groups.add(g)
            share.positions.append(i)
            share.keys.append(k)
        return shares

    def group_of_packed(self, packed_key: bytes) -> int:
        """Group of an 8-byte big-endian key."""
        return int.from_bytes(packed_key, "big") >> self._shift


def _is_relocation(exc: RedisError) -> bool:
    if isinstance(exc, MovedError | AskError | SlotNotCoveredError):
        return True
    return isinstance(exc, ResponseError) and "non local key" in str(exc)


class ClusterOps:
    """The index operations of :class:`~indexer.index.redis_index.RedisIndex` on a cluster.

    Args:
        client: The cluster client.
        layout: The index layout.
        keyspace: The index's key prefix.
        config: The scripts' leading ARGV, with (True) or without the incarnation check.
        check: Raises StaleIncarnationError unless a read layout value is the expected one.
    """

    def __init__(
        self,
        client: RedisCluster,
        layout: IndexLayout,
        keyspace: Keyspace,
        config: Callable[[bool], Args],
        check: Callable[[Any], None],
    ) -> None:
        self._client = client
        self._layout = layout
        self._keyspace = keyspace
        self._config = config
        self._check = check
        self.router = ClusterRouter(client, layout)
        self.router.refresh()
        self._cursor_key = keyspace.index("cur")
        self._layout_key = keyspace.index("layout")

    async def _retried(self, op: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``op``; once more with a fresh slot table if a slot moved meanwhile."""
        try:
            return await op()
        except RedisError as exc:
            if not _is_relocation(exc):
                raise
            await self.router.reload()
            return await op()

    async def cursor(self, hid: int) -> Cursor | None:
        """The host's cursor, read with the incarnation check (one pipelined round trip)."""
        pipe = self._client.pipeline()
        pipe.get(self._layout_key)
        pipe.hget(self._cursor_key, str(hid))
        found, cursor = await pipe.execute()
        self._check(found)
        return parse_cursor(cursor)

    async def _run(self, script: LuaScript, shares: Sequence[NodeShare], head: Args) -> list[Any]:
        calls = []
        for share in shares:
            groups = sorted(share.groups)
            counter = self._layout.group_key(self._keyspace, groups[0], "n")
            args = [*head, counter, str(len(groups)), *(str(g) for g in groups), *share.args]
            calls.append(run_script(self._client, script, args, share.node))
        return list(await asyncio.gather(*calls))

    async def apply(self, hid: int, batch: EventBatch) -> ApplyResult:
        """Apply ``batch`` if next: cursor read, one atomic call per node, cursor write."""
        return await self._retried(lambda: self._apply(hid, batch))

    async def _apply(self, hid: int, batch: EventBatch) -> ApplyResult:
        cursor = await self.cursor(hid)
        status = batch_order(cursor, batch.epoch, batch.seq)
        if status is not ApplyStatus.APPLIED:
            return ApplyResult(status, 0, cursor)
        router = self.router
        has_clear = any(isinstance(ev, AllCleared) for ev in batch.events)
        shares = router.all_groups() if has_clear else {}
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                for share in shares.values():
                    share.args.append("c")
                continue
            kind = "s" if isinstance(ev, BlockStored) else "r"
            rank = str(Medium(ev.medium).rank)
            for name, part in router.split_keys(pack_keys(ev.keys)).items():
                if name not in shares:
                    shares[name] = NodeShare(part.node)
                shares[name].groups |= part.groups
                shares[name].args += [kind, rank, b"".join(part.keys)]
        text = cursor_text(batch.epoch, batch.seq)
        head = [*self._config(False), str(hid), "g", text, "", str(batch.epoch), str(batch.seq)]
        await self._run(SCRIPTS.apply, list(shares.values()), [*head, "0"])
        await self._client.hset(self._cursor_key, str(hid), text)
        return ApplyResult(status, batch_blocks(batch), (batch.epoch, batch.seq))

    async def replace(self, hid: int, snapshot: Snapshot) -> bool:
        """Replace the host's entries on every node unless the snapshot is stale."""
        return await self._retried(lambda: self._replace(hid, snapshot))

    async def _replace(self, hid: int, snapshot: Snapshot) -> bool:
        cursor = await self.cursor(hid)
        if snapshot_is_stale(cursor, snapshot.epoch, snapshot.seq):
            return False
        shares = self.router.all_groups()
        for medium, keys in snapshot.blocks.items():
            rank = str(Medium(medium).rank)
            for name, part in self.router.split_keys(pack_keys(keys)).items():
                shares[name].args += [rank, b"".join(part.keys)]
        text = cursor_text(snapshot.epoch, snapshot.seq)
        head = [*self._config(False), str(hid), "g", text, str(snapshot.epoch), str(snapshot.seq)]
        await self._run(SCRIPTS.replace, list(shares.values()), head)
        await self._client.hset(self._cursor_key, str(hid), text)
        return True

    async def purge(self, hid: int) -> int:
        """Remove the host's entries and group cursors on every node, then its cursor."""
        return await self._retried(lambda: self._purge(hid))

    async def _purge(self, hid: int) -> int:
        await self.cursor(hid)
        head = [*self._config(False), str(hid), "g"]
        removed = await self._run(SCRIPTS.purge, list(self.router.all_groups().values()), head)
        await self._client.hdel(self._cursor_key, str(hid))
        return sum(int(n) for n in removed)

    async def match(self, packed: bytes) -> PrefixCounts:
        """Per-node forward values of the chain's keys, combined into prefixes here."""
        return await self._retried(lambda: self._match(packed))

    async def _match(self, packed: bytes) -> PrefixCounts:
        shares = self.router.split_keys(packed)
        checker = self._client.get_node_from_key(self._layout_key)
        assert checker is not None
        if checker.name not in shares:
            shares[checker.name] = NodeShare(checker)
        calls = [
            run_script(
                self._client,
                SCRIPTS.values,
                [*self._config(s.node is checker), b"".join(s.keys)],
                s.node,
            )
            for s in shares.values()
        ]
        values: list[bytes | None] = [None] * (len(packed) // 8)
        for share, vals in zip(shares.values(), await asyncio.gather(*calls), strict=True):
            for pos, val in zip(share.positions, vals, strict=True):
                values[pos] = val
        return longest_prefixes(unpack_holders(v) if v else None for v in values)
