"""The vLLM adapter fed by real ZMQ messages in vLLM's schema (array and map layouts).

The test side plays vLLM's ``ZmqEventPublisher`` (vllm/distributed/kv_events.py):
a PUB socket (XPUB here, to know when the adapter has subscribed) sending
``[topic, seq (8 bytes big-endian), msgpack batch]`` and a ROUTER replay
socket answering ``[b"", start_seq]`` with every buffered ``[b"", seq,
payload]`` from ``start_seq`` on, then ``[b"", -1, b""]``. The structs below
are declared as vLLM declares them, so msgspec writes the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio

from indexer.events import AllCleared, BlockRemoved, BlockStored
from indexer.index import KVIndex, MemoryIndex, RedisIndex
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.views import WorkerView
from indexer.vllm_adapter import VllmAdapter, VllmDecodeError, VllmTranslator
from indexer.wire import Keyspace, decode_view
from tests.indexer.ingest_support import eventually

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
MODEL, B, HOST = "m", 4, "vllm-0"


# -- vLLM's structs, three vintages -----------------------------------------------------


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The first release's batch: no data-parallel rank."""

    ts: float
    events: list[Any]


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class OldStored(_ArrayEvent, tag="BlockStored"):
    """The first release's fields (no medium, no lora_name)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class Layout:
    """Builds one vintage's payloads."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def stored(self, hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int],
               medium: str | None = "GPU", **kw: Any) -> Any:  # fmt: skip
        if self.kind == "old":
            return OldStored(hashes, parent, tokens, B, None)
        cls = ArrayStored if self.kind == "array" else MapStored
        return cls(hashes, parent, tokens, B, None, medium, kw.pop("lora_name", None), **kw)

    def removed(self, hashes: list[int | bytes], medium: str | None = "GPU") -> Any:
        if self.kind == "old":
            return OldRemoved(hashes)
        return (ArrayRemoved if self.kind == "array" else MapRemoved)(hashes, medium)

    def cleared(self) -> Any:
        return MapCleared() if self.kind == "map" else ArrayCleared()

    def batch(self, *events: Any) -> bytes:
        if self.kind == "old":
            return msgspec.msgpack.encode(OldBatch(time.time(), list(events)))
        cls = MapBatch if self.kind == "map" else VllmBatch
        return msgspec.msgpack.encode(cls(time.time(), list(events), 0))


# -- vLLM's publisher, on loopback -----------------------------------------------------------


class FakeVllm:
    """PUB + ROUTER replay with an in-memory buffer, as ZmqEventPublisher does."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"kv-events") -> None:
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    async def subscribed(self) -> None:
        """Wait for the adapter's subscription (XPUB delivers it as a message)."""
        msg = await asyncio.wait_for(self.pub.recv(), 30)
        assert msg[:1] == b"\x01"

    async def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Buffer one batch and (unless ``send`` is False: lost on the way) send it."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart(
                [ident, b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


@asynccontextmanager
async def engine_and_adapter(
    index: KVIndex, **adapter_kw: Any
) -> AsyncIterator[tuple[FakeVllm, VllmAdapter]]:
    ctx = zmq.asyncio.Context()
    vllm = FakeVllm(ctx)
    adapter = VllmAdapter(index, HOST, VllmTranslator(MODEL, B), endpoint=vllm.endpoint,
                          replay_endpoint=vllm.replay_endpoint, topic="kv-events",
                          **adapter_kw)  # fmt: skip
    try:
        yield vllm, adapter
    finally:
        await adapter.stop()
        await vllm.close()
        ctx.term()


def chain(tokens: list[int], parent: int | None = None, lora: str = "") -> list[int]:
    return block_keys(tokens, B, root_parent(MODEL, lora, "") if parent is None else parent)


def held(hbm: Any = (), dram: Any = (), ssd: Any = ()) -> dict[Medium, set[int]]:
    return {HBM: set(hbm), DRAM: set(dram), SSD: set(ssd)}


T = list(range(100, 112))  # three blocks
U = list(range(200, 208))  # two more, chained after T's second block


@pytest.mark.parametrize("kind", ["array", "map", "old"])
async def test_each_layout_reaches_the_index_with_our_keys(kind: str) -> None:
    v = Layout(kind)
    index = MemoryIndex()
    k = chain(T)
    u = chain(U, parent=k[1])
    async with engine_and_adapter(index) as (vllm, adapter):
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([11, 12, 13], None, T)))
        await vllm.publish(v.batch(v.stored([21, 22], 12, U), v.removed([13])))
        await eventually(lambda: adapter.stats.batches == 2)
        assert await index.entries(HOST) == held(hbm=[k[0], k[1], *u])
        # A prompt that shares T's first two blocks and U matches all four.
        got = await index.match([k[0], k[1], *u])
        assert got[HOST].blocks == 4
        if kind != "old":
            # Offloaded to CPU while still on GPU: shown on the fastest; then GPU drops it.
            await vllm.publish(v.batch(v.stored([21], 12, U[:B], medium="CPU")))
            await vllm.publish(v.batch(v.removed([21, 22], medium="GPU")))
            await eventually(lambda: adapter.stats.batches == 4)
            assert await index.entries(HOST) == held(hbm=k[:2], dram=[u[0]])
        await vllm.publish(v.batch(v.cleared()))
        await vllm.publish(v.batch(v.stored([31], None, T[:B])))
        await eventually(lambda: adapter.stats.last_seq == vllm.seq - 1)
        assert await index.entries(HOST) == held(hbm=[k[0]])
        assert adapter.stats.decode_errors == 0
        assert adapter.stats.replays == 0


async def test_a_missed_batch_is_replayed_from_the_router_socket() -> None:
    v = Layout("array")
    index = MemoryIndex()
    k = chain(T)
    async with engine_and_adapter(index) as (vllm, adapter):
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([11], None, T[:B])))
        await vllm.publish(v.batch(v.stored([12], 11, T[B : 2 * B])), send=False)
        await vllm.publish(v.batch(v.stored([13], 12, T[2 * B :])))
        await eventually(lambda: adapter.stats.last_seq == 2)
        assert vllm.replay_requests == [1]
        assert adapter.stats.replays == 1
        assert adapter.stats.lost == 0
        assert await index.entries(HOST) == held(hbm=k)


async def test_history_from_before_the_subscription_is_replayed() -> None:
    v = Layout("map")
    index = MemoryIndex()
    k = chain(T)
    async with engine_and_adapter(index) as (vllm, adapter):
        await vllm.publish(v.batch(v.stored([11, 12], None, T[: 2 * B])), send=False)
        await vllm.publish(v.batch(v.removed([12])), send=False)
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([12, 13], 11, T[B:])))
        await eventually(lambda: adapter.stats.last_seq == 2)
        assert vllm.replay_requests == [0]
        assert await index.entries(HOST) == held(hbm=k)


async def test_an_engine_restart_clears_the_host() -> None:
    v = Layout("array")
    index = MemoryIndex()
    k = chain(T)
    async with engine_and_adapter(index) as (vllm, adapter):
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([11, 12, 13], None, T)))
        await eventually(lambda: adapter.stats.batches == 1)
        vllm.seq, vllm.buffer = 0, []  # the engine restarted: seq counts from 0 again
        await vllm.publish(v.batch(v.stored([51], None, T[:B])))
        await eventually(lambda: adapter.stats.engine_restarts == 1)
        await eventually(lambda: adapter.stats.batches == 2)
        assert await index.entries(HOST) == held(hbm=[k[0]])


async def test_malformed_messages_are_counted_and_skipped() -> None:
    v = Layout("map")
    index = MemoryIndex()
    async with engine_and_adapter(index) as (vllm, adapter):
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(b"\xc1garbage")
        await vllm.publish(v.batch(MapStored([1], None, T[:B], B + 1, None, "GPU", None)))
        await vllm.publish(v.batch(v.stored([1], None, T[:B], medium="TAPE")))
        await vllm.publish(v.batch(v.stored([1, 2], None, T[:B])))
        await vllm.pub.send_multipart([b"kv-events", b"\x00\x04"])
        await vllm.publish(v.batch(v.stored([11], None, T[:B]), v.removed([11]),
                                   v.stored([11], None, T[:B], medium="DISK")))  # fmt: skip
        await eventually(lambda: adapter.stats.last_seq == 4)
        assert adapter.stats.decode_errors == 5
        assert await index.entries(HOST) == held(ssd=[chain(T)[0]])


async def test_a_purged_host_is_restored_from_the_adapters_map_and_heartbeats(
    redis_url: str,
) -> None:
    v = Layout("array")
    ks = Keyspace()
    index = RedisIndex(redis_url, ks)
    client = aioredis.Redis.from_url(redis_url)
    view = WorkerView(host="", url="http://vllm:8000", model=MODEL, block_size=B)
    k = chain(T)
    async with engine_and_adapter(index, heartbeat=(client, view), heartbeat_ttl_s=2.0) as (
        vllm,
        adapter,
    ):
        await adapter.start()
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([11, 12], None, T[: 2 * B])))
        await eventually(lambda: adapter.stats.batches == 1)
        beat: Any = await client.get(ks.heartbeat(HOST))
        assert beat is not None
        assert decode_view(beat).host == HOST
        await index.purge(HOST)  # the index lost the host (a purge, a Redis restart)
        await vllm.publish(v.batch(v.stored([13], 12, T[2 * B :])))
        await eventually(lambda: adapter.stats.resyncs == 1)
        assert await index.entries(HOST) == held(hbm=k)
    await index.close()
    await client.aclose()


async def test_the_cli_command_indexes_the_engine_heartbeats_it_and_withdraws_on_sigint(
    redis_url: str, tmp_path: Any
) -> None:
    """``kvrouter vllm-adapter`` as an operator runs it: its own process, real ZMQ, real Redis."""
    v = Layout("map")
    ks = Keyspace()
    ctx = zmq.asyncio.Context()
    vllm = FakeVllm(ctx)
    index = RedisIndex(redis_url, ks)
    client = aioredis.Redis.from_url(redis_url)
    host = "vllm-cli"
    log = (tmp_path / "adapter.log").open("wb")
    args = ["--endpoint", vllm.endpoint, "--replay-endpoint", vllm.replay_endpoint,
            "--topic", "kv-events", "--host", host, "--model", MODEL, "--url", "http://vllm:8000/",
            "--redis", redis_url, "--block-size", str(B), "--hbm-blocks", "1000",
            "--dram-blocks", "4000", "--async-loads",
            "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "vllm-adapter", *args, stdout=log, stderr=log
    )
    try:
        await vllm.subscribed()
        await vllm.publish(v.batch(v.stored([11, 12], None, T[: 2 * B])))
        await vllm.publish(v.batch(v.stored([13], 12, T[2 * B :], medium="CPU")))
        k = chain(T)

        async def indexed() -> bool:
            return await index.entries(host) == held(hbm=k[:2], dram=k[2:])

        await eventually(indexed, what="the engine's blocks in the index")
        beat: Any = await client.get(ks.heartbeat(host))
        view = decode_view(beat)
        assert (view.url, view.model, view.block_size) == ("http://vllm:8000", MODEL, B)
        assert view.kv_capacity_blocks == {HBM: 1000, DRAM: 4000}
        assert view.async_loads
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        # Withdrawn at once, so routers stop sending requests to an engine nobody tracks.
        assert await client.get(ks.heartbeat(host)) is None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
        await vllm.close()
        ctx.term()
        await index.close()
        await client.aclose()
    assert b"Traceback" not in (tmp_path / "adapter.log").read_bytes()


def test_the_cli_command_refuses_a_heartbeat_ttl_under_its_interval() -> None:
    from typer.testing import CliRunner

    from kvrouter.cli import app

    result = CliRunner().invoke(app, [
        "vllm-adapter", "--endpoint", "tcp://127.0.0.1:1", "--host", "h", "--model", "m",
        "--url", "http://h", "--heartbeat-interval", "2", "--heartbeat-ttl", "1",
    ])  # fmt: skip
    assert result.exit_code == 2
    assert "heartbeat-ttl" in result.output


# -- the translator alone -------------------------------------------------------------------


def test_unknown_parents_and_extra_keys_are_tracked_but_not_indexed() -> None:
    v = Layout("array")
    tr = VllmTranslator(MODEL, B)
    assert tr.translate(v.batch(v.stored([11, 12], 999, T[: 2 * B]))) == []
    assert tr.translate(v.batch(v.stored([13], 12, T[2 * B :]))) == []
    assert tr.orphans == 3
    salted = v.stored([21, 22], None, U, extra_keys=[["salt"], None])
    assert tr.translate(v.batch(salted)) == []
    assert tr.translate(v.batch(v.removed([11, 12, 13, 21, 22]))) == []
    assert tr.blocks == {}
    # A root chain with a LoRA adapter is keyed under that adapter's root.
    events = tr.translate(v.batch(v.stored([31], None, T[:B], lora_name="sql")))
    assert events == [BlockStored(chain(T[:B], lora="sql"), root_parent(MODEL, "sql", ""), HBM)]


def test_a_child_stored_after_its_parent_left_still_chains() -> None:
    v = Layout("map")
    tr = VllmTranslator(MODEL, B)
    k = chain(T)
    tr.translate(v.batch(v.stored([b"\x01" * 32], None, T[:B])))
    assert tr.translate(v.batch(v.removed([b"\x01" * 32]))) == [BlockRemoved([k[0]], HBM)]
    events = tr.translate(v.batch(v.stored([b"\x02" * 32], b"\x01" * 32, T[B : 2 * B])))
    assert events == [BlockStored([k[1]], k[0], HBM)]


def test_other_kv_groups_are_ignored_and_the_map_is_bounded() -> None:
    v = Layout("array")
    tr = VllmTranslator(MODEL, B, max_blocks=2)
    k = chain(T)
    other = v.stored([91], None, T[:B], group_idx=1)
    assert tr.translate(v.batch(other)) == []
    events = tr.translate(v.batch(v.stored([11, 12, 13], None, T)))
    # The oldest block leaves the bounded map, and the index with it.
    assert events == [BlockStored(k, root_parent(MODEL, "", ""), HBM), BlockRemoved([k[0]], HBM)]
    assert tr.dropped == 1
    assert tr.snapshot_blocks() == {HBM: k[1:], DRAM: [], SSD: []}
    assert tr.translate(v.batch(v.cleared())) == [AllCleared()]
    with pytest.raises(VllmDecodeError):
        tr.translate(b"\x92\x01")
