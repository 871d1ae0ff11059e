"""One behaviour suite for every KV index backend.

Each test runs against the in-memory index, the bitmap index (a gateway
mirror's table), the Redis index on a throwaway redis-server and the Redis
index on a throwaway 3-node Redis Cluster.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from indexer.events import AllCleared, BlockRemoved, BlockStored, Event, EventBatch, Snapshot
from indexer.index import (
    ApplyStatus,
    IndexLayout,
    IndexUnavailableError,
    InvalidKeyError,
    KVIndex,
    MemoryIndex,
    RedisIndex,
)
from indexer.index.bitmap import BitmapIndex
from indexer.index.scripts import run_script
from indexer.media import Medium
from indexer.metrics import IndexMetrics
from indexer.views import PrefixMatch
from indexer.wire import Keyspace
from tests.support.redis_cluster import RedisCluster

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
U64_MAX = 2**64 - 1
#: Small buckets, so that tests put many keys in one bucket and cross groups.
SMALL = IndexLayout(key_bits=6, host_bits=5, group_bits=4)
BACKENDS = ["memory", "bitmap", "redis", "cluster"]


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One throwaway 3-node Redis Cluster for the session."""
    cluster = RedisCluster(3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def new_index(
    kind: str, request: pytest.FixtureRequest, metrics: IndexMetrics | None = None
) -> KVIndex:
    """A fresh, empty index of ``kind`` (Redis ones under a keyspace of their own)."""
    if kind == "memory":
        return MemoryIndex(metrics=metrics)
    if kind == "bitmap":
        return BitmapIndex(metrics=metrics)
    keyspace = Keyspace(f"t{uuid.uuid4().hex[:12]}")
    if kind == "redis":
        return RedisIndex(
            request.getfixturevalue("redis_url"), keyspace, layout=SMALL, metrics=metrics
        )
    cluster: RedisCluster = request.getfixturevalue("redis_cluster")
    return RedisIndex(cluster.url, keyspace, layout=SMALL, metrics=metrics)


@pytest.fixture(params=BACKENDS)
async def index(request: pytest.FixtureRequest) -> AsyncIterator[KVIndex]:
    """An empty index of each backend."""
    idx = new_index(request.param, request)
    yield idx
    await idx.close()


def batch(host: str, seq: int, *events: Event, epoch: int = 7) -> EventBatch:
    return EventBatch(host, epoch, seq, 0.0, list(events))


def stored(*keys: int, medium: Medium = HBM, parent: int | None = None) -> BlockStored:
    return BlockStored(list(keys), parent, medium)


def removed(*keys: int, medium: Medium = HBM) -> BlockRemoved:
    return BlockRemoved(list(keys), medium)


def pm(host: str, hbm: int = 0, dram: int = 0, ssd: int = 0) -> PrefixMatch:
    return PrefixMatch(host, hbm + dram + ssd, (hbm, dram, ssd))


async def test_prefix_ends_at_first_key_a_host_lacks(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2, 3, 4)))
    await index.apply(batch("b", 1, stored(1, 3, 4)))
    await index.apply(batch("c", 1, stored(2, 3)))
    assert await index.match([1, 2, 3, 4, 5]) == {"a": pm("a", 4), "b": pm("b", 1)}
    assert await index.match([2, 3, 4]) == {"a": pm("a", 3), "c": pm("c", 2)}
    assert await index.match([9, 1, 2]) == {}


async def test_match_counts_blocks_per_medium(index: KVIndex) -> None:
    await index.apply(
        batch("a", 1, stored(1, 2), stored(3, medium=DRAM), stored(4, 5, 6, medium=SSD))
    )
    got = await index.match([1, 2, 3, 4, 5, 6])
    assert got == {"a": pm("a", hbm=2, dram=1, ssd=3)}
    assert got["a"].on(SSD) == 3


async def test_stored_on_another_medium_moves_the_block(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2)))
    await index.apply(batch("a", 2, stored(2, medium=DRAM)))
    assert await index.match([1, 2]) == {"a": pm("a", hbm=1, dram=1)}
    stats = await index.stats()
    assert stats.entries == {HBM: 1, DRAM: 1, SSD: 0}
    # Removing it from the old medium no longer touches it.
    await index.apply(batch("a", 3, removed(2, medium=HBM)))
    assert await index.match([1, 2]) == {"a": pm("a", hbm=1, dram=1)}


async def test_removed_on_the_wrong_medium_is_a_noop(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2, medium=DRAM)))
    await index.apply(batch("a", 2, removed(1, 2, medium=SSD)))
    assert await index.match([1, 2]) == {"a": pm("a", dram=2)}
    await index.apply(batch("a", 3, removed(2, medium=DRAM), removed(77)))
    assert await index.match([1, 2]) == {"a": pm("a", dram=1)}
    assert (await index.stats()).entries[DRAM] == 1


async def test_cleared_drops_only_that_host_and_later_events_apply(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2, 3), stored(4, medium=SSD)))
    await index.apply(batch("b", 1, stored(1, 2)))
    result = await index.apply(batch("a", 2, stored(9), AllCleared(), stored(5, medium=DRAM)))
    assert result.status is ApplyStatus.APPLIED
    assert await index.match([1, 2, 3]) == {"b": pm("b", 2)}
    assert await index.match([9]) == {}
    assert await index.match([5]) == {"a": pm("a", dram=1)}
    assert (await index.stats()).entries == {HBM: 2, DRAM: 1, SSD: 0}


async def test_cursor_rules_for_a_new_host(index: KVIndex) -> None:
    assert await index.cursor("a") is None
    assert (await index.apply(batch("a", 2, stored(1)))).status is ApplyStatus.GAP
    assert (await index.apply(batch("a", 0, stored(1)))).status is ApplyStatus.GAP
    assert await index.match([1]) == {}
    assert await index.cursor("a") is None
    first = await index.apply(batch("a", 1, stored(1, 2)))
    assert first.status is ApplyStatus.APPLIED
    assert first.blocks == 2
    assert first.cursor == (7, 1)
    assert await index.cursor("a") == (7, 1)


async def test_duplicates_change_nothing_and_gaps_apply_nothing(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1)))
    await index.apply(batch("a", 2, stored(2)))
    dup = await index.apply(batch("a", 1, removed(1), stored(50)))
    assert (dup.status, dup.blocks, dup.cursor) == (ApplyStatus.DUPLICATE, 0, (7, 2))
    again = await index.apply(batch("a", 2, stored(60)))
    assert again.status is ApplyStatus.DUPLICATE
    gap = await index.apply(batch("a", 4, stored(3)))
    assert (gap.status, gap.cursor) == (ApplyStatus.GAP, (7, 2))
    new_epoch = await index.apply(batch("a", 3, stored(3), epoch=8))
    assert new_epoch.status is ApplyStatus.GAP
    new_epoch_first = await index.apply(batch("a", 1, stored(3), epoch=8))
    assert new_epoch_first.status is ApplyStatus.GAP
    assert await index.match([1, 2, 3]) == {"a": pm("a", 2)}
    assert await index.match([50]) == {}
    assert await index.match([60]) == {}
    assert await index.cursor("a") == (7, 2)
    assert (await index.apply(batch("a", 3, stored(3)))).status is ApplyStatus.APPLIED
    assert await index.match([1, 2, 3]) == {"a": pm("a", 3)}


async def test_huge_seq_and_epoch_compare_exactly(index: KVIndex) -> None:
    big_epoch, big_seq = 2**63 - 1, 2**62 + 1
    await index.replace(Snapshot("a", big_epoch, big_seq, 0.0, {HBM: [1]}))
    # 2**62 + 1 and 2**62 + 2 are the same double: the index must not use doubles.
    dup = await index.apply(batch("a", big_seq, stored(2), epoch=big_epoch))
    assert dup.status is ApplyStatus.DUPLICATE
    nxt = await index.apply(batch("a", big_seq + 1, stored(2), epoch=big_epoch))
    assert nxt.status is ApplyStatus.APPLIED
    assert await index.cursor("a") == (big_epoch, big_seq + 1)
    assert not await index.replace(Snapshot("a", big_epoch, big_seq, 0.0, {HBM: []}))


async def test_replace_sets_entries_and_cursor(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2, 3)))
    await index.apply(batch("b", 1, stored(1, 2)))
    snap = Snapshot("a", 9, 5, 0.0, {DRAM: [1, 2], SSD: [7]})
    assert await index.replace(snap)
    assert await index.cursor("a") == (9, 5)
    assert await index.match([1, 2, 3]) == {"a": pm("a", dram=2), "b": pm("b", 2)}
    assert await index.match([7]) == {"a": pm("a", ssd=1)}
    # Later batches of the snapshot's epoch apply on top of it.
    assert (await index.apply(batch("a", 6, stored(3), epoch=9))).status is ApplyStatus.APPLIED
    assert await index.match([1, 2, 3]) == {"a": pm("a", hbm=1, dram=2), "b": pm("b", 2)}
    assert (await index.stats()).entries == {HBM: 3, DRAM: 2, SSD: 1}


async def test_stale_snapshot_is_ignored_and_new_epoch_snapshot_wins(index: KVIndex) -> None:
    await index.replace(Snapshot("a", 9, 5, 0.0, {HBM: [1]}))
    assert not await index.replace(Snapshot("a", 9, 4, 0.0, {HBM: [2]}))
    assert await index.cursor("a") == (9, 5)
    assert await index.match([1]) == {"a": pm("a", 1)}
    assert await index.replace(Snapshot("a", 9, 5, 0.0, {SSD: [1]}))
    assert await index.match([1]) == {"a": pm("a", ssd=1)}
    assert await index.replace(Snapshot("a", 3, 0, 0.0, {}))
    assert await index.cursor("a") == (3, 0)
    assert await index.match([1]) == {}
    assert (await index.apply(batch("a", 1, stored(4), epoch=3))).status is ApplyStatus.APPLIED


async def test_purge_removes_one_host_only(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1, 2, 3), stored(4, medium=SSD)))
    await index.apply(batch("b", 1, stored(1, 2)))
    assert await index.purge("a") == 4
    assert await index.cursor("a") is None
    assert await index.hosts() == ["b"]
    assert await index.match([1, 2, 3, 4]) == {"b": pm("b", 2)}
    assert (await index.stats()).entries == {HBM: 2, DRAM: 0, SSD: 0}
    assert await index.purge("a") == 0
    assert await index.purge("never-seen") == 0
    # A purged host starts again like a new one.
    assert (await index.apply(batch("a", 1, stored(1)))).status is ApplyStatus.APPLIED
    assert await index.match([1, 2]) == {"a": pm("a", 1), "b": pm("b", 2)}


async def test_stored_with_unknown_parent_is_indexed(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(10, 11, parent=999)))
    await index.apply(batch("a", 2, stored(12, parent=None)))
    await index.apply(batch("a", 3, stored(1, 2), removed(1)))
    # The chain's first block is gone; its descendants stay indexed.
    assert await index.match([10, 11, 12]) == {"a": pm("a", 3)}
    assert await index.match([2]) == {"a": pm("a", 1)}
    assert await index.match([1, 2]) == {}


async def test_u64_extremes_and_double_precision_neighbours(index: KVIndex) -> None:
    keys = [0, U64_MAX, 2**63, 2**53, 2**63 - 1, U64_MAX - 1]
    await index.apply(batch("a", 1, stored(*keys)))
    await index.apply(batch("b", 1, stored(2**53 + 1, U64_MAX)))
    assert await index.match(keys) == {"a": pm("a", 6)}
    assert await index.match([2**53 + 1]) == {"b": pm("b", 1)}
    assert await index.match([U64_MAX, 2**53 + 1]) == {"a": pm("a", 1), "b": pm("b", 2)}
    assert await index.match([U64_MAX - 2]) == {}


async def test_many_hosts_share_blocks(index: KVIndex) -> None:
    hosts = [f"worker-{i:03d}" for i in range(70)]
    for i, host in enumerate(hosts):
        medium = (HBM, DRAM, SSD)[i % 3]
        await index.apply(batch(host, 1, stored(*range(100, 100 + 1 + i % 5), medium=medium)))
    got = await index.match(list(range(100, 110)))
    assert set(got) == set(hosts)
    for i, host in enumerate(hosts):
        n = 1 + i % 5
        assert got[host].blocks == n
        assert got[host].on((HBM, DRAM, SSD)[i % 3]) == n
    assert sorted(await index.hosts()) == hosts
    assert (await index.stats()).hosts == 70


async def test_empty_chain_matches_nothing(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1)))
    assert await index.match([]) == {}


async def test_bad_keys_raise_and_change_nothing(index: KVIndex) -> None:
    await index.apply(batch("a", 1, stored(1)))
    bad = batch("a", 2, stored(2), stored(2**64))
    with pytest.raises(InvalidKeyError):
        await index.apply(bad)
    with pytest.raises(InvalidKeyError):
        await index.apply(batch("a", 2, removed(1, -1)))
    with pytest.raises(InvalidKeyError):
        await index.replace(Snapshot("a", 7, 9, 0.0, {HBM: [3, -5]}))
    with pytest.raises(InvalidKeyError):
        await index.match([1, 2**64])
    assert await index.cursor("a") == (7, 1)
    assert await index.match([1]) == {"a": pm("a", 1)}
    assert await index.match([2]) == {}
    assert (await index.apply(batch("a", 2, stored(2)))).status is ApplyStatus.APPLIED


@pytest.mark.parametrize("kind", BACKENDS)
async def test_metrics_count_what_happened(kind: str, request: pytest.FixtureRequest) -> None:
    registry = CollectorRegistry()
    idx = new_index(kind, request, IndexMetrics(registry))
    try:
        await idx.apply(batch("a", 1, stored(1, 2), removed(2), AllCleared()))
        await idx.apply(batch("a", 1, stored(1)))
        await idx.apply(batch("a", 5, stored(1)))
        await idx.replace(Snapshot("a", 7, 9, 0.0, {DRAM: [1, 2, 3]}))
        await idx.replace(Snapshot("a", 7, 8, 0.0, {}))
        await idx.match([1, 2, 3])
        await idx.stats()
        await idx.purge("a")
    finally:
        await idx.close()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvindex_batches_total", result="applied") == 1
    assert value("kvindex_batches_total", result="duplicate") == 1
    assert value("kvindex_batches_total", result="gap") == 1
    assert value("kvindex_events_applied_total", kind="stored") == 1
    assert value("kvindex_events_applied_total", kind="cleared") == 1
    assert value("kvindex_blocks_applied_total") == 3
    assert value("kvindex_snapshots_total", result="replaced") == 1
    assert value("kvindex_snapshots_total", result="stale") == 1
    assert value("kvindex_lookup_seconds_count") == 1
    assert value("kvindex_entries", medium="dram") == 3
    assert value("kvindex_purges_total") == 1
    assert value("kvindex_purged_entries_total") == 3


# -- random event sequences against a plain-dict model ------------------------

#: Keys with shared top bits (same bucket/group), u64 extremes, double neighbours.
POOL = [0, 1, 2, 2**53, 2**53 + 1, 2**63, U64_MAX - 1, U64_MAX, 0xABCD << 48, (0xABCD << 48) + 5]
HOSTS = ["a", "b", "c"]


class DictModel:
    """The index's documented behaviour, written as plainly as possible."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, Medium]] = {}
        self.cursors: dict[str, tuple[int, int]] = {}

    def apply(self, b: EventBatch) -> ApplyStatus:
        cur = self.cursors.get(b.host)
        if cur is None:
            ok = b.seq == 1
        elif cur[0] != b.epoch or b.seq > cur[1] + 1:
            ok = False
        elif b.seq <= cur[1]:
            return ApplyStatus.DUPLICATE
        else:
            ok = True
        if not ok:
            return ApplyStatus.GAP
        held = self.held.setdefault(b.host, {})
        for ev in b.events:
            if isinstance(ev, AllCleared):
                held.clear()
            elif isinstance(ev, BlockStored):
                held.update(dict.fromkeys(ev.keys, ev.medium))
            else:
                for k in ev.keys:
                    if held.get(k) == ev.medium:
                        del held[k]
        self.cursors[b.host] = (b.epoch, b.seq)
        return ApplyStatus.APPLIED

    def replace(self, s: Snapshot) -> bool:
        cur = self.cursors.get(s.host)
        if cur is not None and cur[0] == s.epoch and s.seq < cur[1]:
            return False
        self.held[s.host] = {k: m for m, keys in s.blocks.items() for k in keys}
        self.cursors[s.host] = (s.epoch, s.seq)
        return True

    def purge(self, host: str) -> int:
        self.cursors.pop(host, None)
        return len(self.held.pop(host, {}))

    def match(self, keys: list[int]) -> dict[str, PrefixMatch]:
        out = {}
        for host, held in self.held.items():
            media = []
            for k in keys:
                if k not in held:
                    break
                media.append(held[k])
            if media:
                out[host] = PrefixMatch.from_media(host, media)
        return out


keys_st = st.lists(st.sampled_from(POOL), min_size=1, max_size=4)
medium_st = st.sampled_from(list(Medium))
event_st = st.one_of(
    st.builds(lambda k, m: BlockStored(k, None, m), keys_st, medium_st),
    st.builds(BlockRemoved, keys_st, medium_st),
    st.just(AllCleared()),
)
op_st = st.one_of(
    st.tuples(
        st.just("batch"),
        st.sampled_from(HOSTS),
        st.sampled_from([1, 1, 1, 0, -1, 2]),
        st.sampled_from([1, 2]),
        st.lists(event_st, max_size=4),
    ),
    st.tuples(
        st.just("snapshot"),
        st.sampled_from(HOSTS),
        st.sampled_from([0, 1, -1, 3]),
        st.sampled_from([1, 2]),
        st.dictionaries(medium_st, st.lists(st.sampled_from(POOL), max_size=4), max_size=3),
    ),
    st.tuples(st.just("purge"), st.sampled_from(HOSTS)),
)


async def run_against_model(idx: KVIndex, ops: list[tuple[Any, ...]]) -> None:
    model = DictModel()
    for op in ops:
        if op[0] == "purge":
            assert await idx.purge(op[1]) == model.purge(op[1])
            continue
        _, host, delta, epoch, payload = op
        seq = max(0, model.cursors.get(host, (0, 0))[1] + delta)
        if op[0] == "batch":
            b = EventBatch(host, epoch, seq, 0.0, payload)
            assert (await idx.apply(b)).status is model.apply(b)
        else:
            s = Snapshot(host, epoch, seq, 0.0, payload)
            assert await idx.replace(s) == model.replace(s)
    for host in HOSTS:
        assert await idx.cursor(host) == model.cursors.get(host)
    for chain in (POOL, POOL[::-1], POOL[4:], *([k] for k in POOL)):
        assert await idx.match(chain) == model.match(chain)
    held = [m for h in model.held.values() for m in h.values()]
    assert (await idx.stats()).entries == {m: held.count(m) for m in Medium}
    assert await idx.hosts() == sorted(model.cursors)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(op_st, max_size=12))
def test_random_sequences_equal_a_dict_model(
    kind: str, request: pytest.FixtureRequest, ops: list[tuple[Any, ...]]
) -> None:
    async def scenario() -> None:
        idx = new_index(kind, request)
        try:
            await run_against_model(idx, ops)
        finally:
            await idx.close()

    asyncio.run(scenario())


# -- Redis Cluster only -------------------------------------------------------


async def test_cluster_spreads_the_index_over_every_node(redis_cluster: RedisCluster) -> None:
    keyspace = Keyspace(f"t{uuid.uuid4().hex[:12]}")
    idx = RedisIndex(redis_cluster.url, keyspace, layout=SMALL)
    try:
        keys = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 400)]
        await idx.apply(batch("a", 1, stored(*keys)))
        assert await idx.match(keys) == {"a": pm("a", len(keys))}
    finally:
        await idx.close()
    for node in redis_cluster.nodes:
        client = redis.Redis(port=node.port)
        try:
            assert any(client.scan_iter(match=f"{keyspace.prefix}:idx:{{*}}:f:*", count=1000))
        finally:
            client.close()


async def test_cluster_batch_cut_between_nodes_is_finished_by_a_replay(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    idx = RedisIndex(redis_cluster.url, Keyspace(f"t{uuid.uuid4().hex[:12]}"), layout=SMALL)
    model = MemoryIndex()
    keys = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 200)]
    new = [(i * 0xD1B54A32D192ED03) % 2**64 for i in range(1, 50)]
    first = batch("a", 1, stored(*keys))
    second = batch("a", 2, removed(*keys[:60]), stored(*keys[:30], medium=DRAM), stored(*new))
    down = redis_cluster.addresses[1]
    target = "indexer.index.cluster.run_script"

    async def run_script_with_a_dead_node(
        client: Any, script: Any, args: Any, node: Any = None
    ) -> Any:
        if node is not None and node.name == down and script.name == "apply":
            raise redis.ConnectionError(f"injected: {down} is unreachable")
        return await run_script(client, script, args, node)

    try:
        await idx.apply(first)
        await model.apply(first)
        monkeypatch.setattr(target, run_script_with_a_dead_node)
        with pytest.raises(IndexUnavailableError):
            await idx.apply(second)
        assert await idx.cursor("a") == (7, 1)
        # The other nodes took their part: the batch is half applied until replayed.
        assert 0 < (await idx.stats()).entries[DRAM] < 30
        monkeypatch.setattr(target, run_script)
        assert (await idx.apply(second)).status is ApplyStatus.APPLIED
        await model.apply(second)
        for chain in (keys, new, keys[30:], keys[60:]):
            assert await idx.match(chain) == await model.match(chain)
        assert (await idx.stats()).entries == (await model.stats()).entries
    finally:
        await idx.close()


# -- entries (the audit's view of one host) -------------------------------------


async def test_entries_list_a_hosts_blocks_per_medium(index: KVIndex) -> None:
    empty: dict[Medium, set[int]] = {HBM: set(), DRAM: set(), SSD: set()}
    assert await index.entries("a") == empty
    await index.apply(batch("a", 1, stored(1, 2, 3, 0, U64_MAX, 2**63), stored(4, medium=SSD)))
    await index.apply(batch("b", 1, stored(1, 5, medium=DRAM)))
    await index.apply(batch("a", 2, stored(2, medium=DRAM), removed(3)))
    assert await index.entries("a") == {HBM: {0, 1, U64_MAX, 2**63}, DRAM: {2}, SSD: {4}}
    assert await index.entries("b") == {HBM: set(), DRAM: {1, 5}, SSD: set()}
    await index.replace(Snapshot("a", 7, 5, 0.0, {SSD: [9, 1]}))
    assert await index.entries("a") == {HBM: set(), DRAM: set(), SSD: {1, 9}}
    await index.purge("b")
    assert await index.entries("b") == empty
    assert await index.entries("never-seen") == empty


async def test_entries_cover_every_reverse_bucket(index: KVIndex) -> None:
    keys = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 300)]
    await index.apply(batch("a", 1, stored(*keys[:200]), stored(*keys[200:], medium=DRAM)))
    await index.apply(batch("b", 1, stored(*keys[::2], medium=SSD)))
    got = await index.entries("a")
    assert got == {HBM: set(keys[:200]), DRAM: set(keys[200:]), SSD: set()}
    assert (await index.entries("b"))[SSD] == set(keys[::2])
