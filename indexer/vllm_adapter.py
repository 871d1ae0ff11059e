"""Feeds a vLLM engine's KV cache events (over ZMQ) into our index, as one host.

vLLM's wire format (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``
and the structs above it; ``examples/online_serving/kv_events_subscriber.py``):

* PUB socket, multipart ``[topic, seq, payload]``: ``seq`` is 8 bytes
  big-endian, counting from 0 per publisher (one per data-parallel rank,
  on port + rank); ``payload`` is msgpack of ``EventBatch(ts, events,
  data_parallel_rank=None)`` -- an array ``[ts, events, dp_rank]`` (the
  rank may be absent) in the releases we know, a map in a struct without
  ``array_like``; both are read.
* Events are msgspec structs tagged by class name. Older releases encode
  them as arrays (``array_like=True``): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, ...]``, ``["BlockRemoved", block_hashes, medium,
  group_idx]``, ``["AllBlocksCleared"]`` (trailing fields absent in older
  releases); newer ones as maps with a ``"type"`` key and the same field
  names. Block hashes are ints or bytes (``ExternalBlockHash``); ``medium``
  is "GPU" / "CPU" / "DISK" or None (GPU).
* ROUTER replay socket: a request ``[b"", start_seq (8 bytes)]`` from a
  DEALER is answered with ``[b"", seq, payload]`` for every buffered batch
  with ``seq >= start_seq``, then ``[b"", -1 (8 bytes, signed), b""]``.

vLLM's hashes are opaque to us (DESIGN.md, "Block keys"): keys are
re-derived from ``token_ids`` with :func:`indexer.keys.block_keys`, chained
from ``root_parent(model, lora_name, "")`` for a chain's first block
(``parent_block_hash`` None) or from the parent's key. A map engine hash ->
(our key, media held) lets ``BlockRemoved`` (hashes only) find the key; an
entry is dropped when no medium holds the block any more, into a bounded
"recently removed" map so that a child stored after its parent left still
chains. The index shows each block on the fastest medium vLLM holds it on.

What cannot be keyed is tracked, not indexed: a block whose parent hash is
unknown (stored before the adapter subscribed and outside the replay
buffer), or that carries ``extra_keys`` (multimodal hashes, a cache salt:
not part of our key), gets no key and neither do its descendants -- no
prompt could match them, and guessing a parent would make false matches.
Its subtree's removals are then no-ops; nothing else is dropped.

Output: the adapter applies our own :class:`~indexer.events.EventBatch`
(host = the configured name, a random epoch, seq from 1 after an empty
start-up snapshot) straight to the index, one per vLLM batch with effects.
A gap reported by the index (Redis lost its data, the host was purged) is
answered by replacing the host with a snapshot built from the map. With a
Redis client and a :class:`~indexer.views.WorkerView` it also writes the
host's heartbeat, so that discovery sees the engine and the ingester does
not purge it while the adapter runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from redis.exceptions import RedisError

from indexer.events import AllCleared, BlockRemoved, BlockStored, Event, EventBatch, Snapshot
from indexer.index.base import ApplyStatus, IndexUnavailableError, KVIndex
from indexer.ingest_reader import Client
from indexer.keys import block_keys, root_parent
from indexer.media import MEDIA, Medium
from indexer.tasks import cancel_and_wait
from indexer.views import WorkerView
from indexer.wire import Keyspace, encode_view

__all__ = [
    "AdapterStats",
    "VllmAdapter",
    "VllmDecodeError",
    "VllmTranslator",
    "decode_vllm_batch",
]

log = logging.getLogger(__name__)

EngineHash = int | bytes
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
           "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
           "kv_cache_spec_sliding_window")  # fmt: skip
_REMOVED = ("block_hashes", "medium", "group_idx")
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": _STORED,
    "BlockRemoved": _REMOVED,
    "AllBlocksCleared": (),
}
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class VllmDecodeError(ValueError):
    """A vLLM payload or event does not follow the schema (the batch is skipped)."""


def _event_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """An event as (tag, fields), from the array or the map layout."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _FIELDS:
        return raw[0], dict(zip(_FIELDS[raw[0]], raw[1:], strict=False))
    if isinstance(raw, dict) and raw.get("type") in _FIELDS:
        return raw["type"], raw
    raise VllmDecodeError(f"not a vLLM KV event: {raw!r:.80}")


def decode_vllm_batch(payload: bytes) -> tuple[float, list[tuple[str, dict[str, Any]]]]:
    """``(ts, [(tag, fields), ...])`` of a vLLM payload; raises VllmDecodeError."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.MsgspecError as exc:
        raise VllmDecodeError(f"invalid msgpack: {exc}") from exc
    if isinstance(obj, list) and len(obj) in (2, 3):
        ts, events = obj[0], obj[1]
    elif isinstance(obj, dict) and "events" in obj:
        ts, events = obj.get("ts", 0.0), obj["events"]
    else:
        raise VllmDecodeError(f"not a vLLM event batch: {obj!r:.80}")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise VllmDecodeError("a vLLM batch needs a timestamp and a list of events")
    return float(ts), [_event_fields(e) for e in events]


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise VllmDecodeError("block_hashes must be a list of ints or bytes")
    return value


@dataclass(slots=True)
class _Block:
    """One engine block: our key (None when it cannot be keyed) and the media holding it."""

    key: int | None
    media: int = 0

    @property
    def medium(self) -> Medium | None:
        """The fastest medium holding it (what the index shows)."""
        for m in MEDIA:
            if self.media >> m.rank & 1:
                return m
        return None


class VllmTranslator:
    """Pure core: vLLM events in, our events out; keeps the engine hash -> key map.

    Args:
        model: The served model name (root of our keys; must equal the router's).
        block_size: vLLM's block size, which must be the cluster's (one per model).
        max_blocks: Bound of the map; past it the oldest blocks are dropped and
            removed from the index (they could not be removed later otherwise).
        recent_removed: How many removed blocks keep their key for late children.
        group_idx: The KV cache group whose events count (hybrid models emit one per group).
    """

    def __init__(self, model: str, block_size: int, *, max_blocks: int = 1_000_000,
                 recent_removed: int = 65_536, group_idx: int = 0) -> None:  # fmt: skip
        if block_size < 1 or max_blocks < 1 or recent_removed < 0:
            raise ValueError("block_size and max_blocks must be positive")
        self.model = model
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.recent_removed = recent_removed
        self.group_idx = group_idx
        self.blocks: OrderedDict[EngineHash, _Block] = OrderedDict()
        self._removed: OrderedDict[EngineHash, int | None] = OrderedDict()
        self.orphans = 0
        self.dropped = 0

    def translate(self, payload: bytes) -> list[Event]:
        """Our events for one vLLM batch payload; raises VllmDecodeError (nothing changed)."""
        _, events = decode_vllm_batch(payload)
        mine = [
            (tag, f) for tag, f in events
            if tag == "AllBlocksCleared" or f.get("group_idx") in (None, self.group_idx)
        ]  # fmt: skip
        for tag, f in mine:
            self._check(tag, f)
        out: list[Event] = []
        for tag, f in mine:
            if tag == "BlockStored":
                out += self._stored(f)
            elif tag == "BlockRemoved":
                out += self._removed_event(f)
            else:
                self.clear()
                out.append(AllCleared())
        out += self._bound()
        return _merge(out)

    def clear(self) -> None:
        """Forget every block (the engine dropped its cache or restarted)."""
        self.blocks.clear()

    def snapshot_blocks(self) -> dict[Medium, list[int]]:
        """Every keyed block per medium: what the index should hold for this host."""
        out: dict[Medium, list[int]] = {m: [] for m in MEDIA}
        for b in self.blocks.values():
            medium = b.medium
            if b.key is not None and medium is not None:
                out[medium].append(b.key)
        return out

    def _check(self, tag: str, f: dict[str, Any]) -> None:
        """Validate an event before anything changes (a bad batch is skipped whole)."""
        if tag == "AllBlocksCleared":
            return
        hashes = _hashes(f.get("block_hashes"))
        try:
            Medium.from_vllm(f.get("medium"))
        except (ValueError, AttributeError) as exc:
            raise VllmDecodeError(f"bad medium {f.get('medium')!r}") from exc
        if tag == "BlockRemoved":
            return
        if f.get("block_size") != self.block_size:
            raise VllmDecodeError(f"block_size {f.get('block_size')!r} != {self.block_size}")
        tokens = f.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * self.block_size:
            raise VllmDecodeError("token_ids must hold block_size tokens per stored block")
        if not all(type(t) is int and 0 <= t <= 0xFFFFFFFF for t in tokens):
            raise VllmDecodeError("token ids must be integers in [0, 2**32)")
        if not isinstance(f.get("parent_block_hash"), int | bytes | None):
            raise VllmDecodeError("parent_block_hash must be an int, bytes or None")
        if not isinstance(f.get("lora_name"), str | None):
            raise VllmDecodeError("lora_name must be a string or None")
        if not isinstance(f.get("extra_keys"), list | None):
            raise VllmDecodeError("extra_keys must be a list or None")

    def _parent_key(self, f: dict[str, Any]) -> int | None:
        parent = f.get("parent_block_hash")
        if parent is None:
            return root_parent(self.model, f.get("lora_name") or "", "")
        held = self.blocks.get(parent)
        if held is not None:
            return held.key
        return self._removed.get(parent)

    def _keys(self, f: dict[str, Any], n: int, parent: int | None) -> list[int | None]:
        """Our keys of a stored run chained from ``parent``; None where it cannot be keyed."""
        extra = f.get("extra_keys") or [None] * n
        keyable = (
            0 if parent is None else next((i for i in range(n) if i >= len(extra) or extra[i]), n)
        )
        keys: list[int | None] = []
        if parent is not None and keyable:
            keys += block_keys(f["token_ids"][: keyable * self.block_size], self.block_size, parent)
        self.orphans += n - keyable
        return keys + [None] * (n - keyable)

    def _stored(self, f: dict[str, Any]) -> Iterator[Event]:
        hashes = f["block_hashes"]
        medium = Medium.from_vllm(f.get("medium"))
        parent = self._parent_key(f)
        for h, key in zip(hashes, self._keys(f, len(hashes), parent), strict=True):
            block = self.blocks.get(h)
            if block is None:
                block = self.blocks[h] = _Block(key)
                self._removed.pop(h, None)
            elif block.key != key:
                if block.key is not None and block.medium is not None:
                    yield BlockRemoved([block.key], block.medium)
                block.key, block.media = key, 0
            before = block.medium
            block.media |= 1 << medium.rank
            after = block.medium
            if key is not None and after is not None and after != before:
                yield BlockStored([key], parent, after)
            parent = key

    def _removed_event(self, f: dict[str, Any]) -> Iterator[Event]:
        medium = Medium.from_vllm(f.get("medium"))
        for h in _hashes(f.get("block_hashes")):
            block = self.blocks.get(h)
            if block is None:
                continue
            before = block.medium
            block.media &= ~(1 << medium.rank)
            after = block.medium
            if block.key is not None and before is not None and after != before:
                yield (
                    BlockRemoved([block.key], before)
                    if after is None
                    else BlockStored([block.key], None, after)
                )
            if after is None:
                del self.blocks[h]
                self._remember_removed(h, block.key)

    def _remember_removed(self, h: EngineHash, key: int | None) -> None:
        if self.recent_removed == 0:
            return
        self._removed[h] = key
        self._removed.move_to_end(h)
        while len(self._removed) > self.recent_removed:
            self._removed.popitem(last=False)

    def _bound(self) -> list[Event]:
        out: list[Event] = []
        while len(self.blocks) > self.max_blocks:
            h, block = self.blocks.popitem(last=False)
            self.dropped += 1
            if block.key is not None and block.medium is not None:
                out.append(BlockRemoved([block.key], block.medium))
            self._remember_removed(h, block.key)
        return out


def _merge(events: Sequence[Event]) -> list[Event]:
    """Join consecutive events of one kind and medium into one (a stored run must chain)."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockStored) and isinstance(last, BlockStored):
            chained = ev.parent == last.keys[-1] or ev.parent is last.parent is None
            if last.medium == ev.medium and chained:
                out[-1] = BlockStored([*last.keys, *ev.keys], last.parent, last.medium)
                continue
        if (
            isinstance(ev, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and (last.medium == ev.medium)
        ):
            out[-1] = BlockRemoved([*last.keys, *ev.keys], last.medium)
            continue
        out.append(ev)
    return out


@dataclass(slots=True)
class AdapterStats:
    """What an adapter did (tests and operators read it).

    Attributes:
        batches: vLLM batches translated.
        applied: Our batches applied to the index.
        decode_errors: vLLM messages skipped as malformed.
        replays: Replay requests made after a seq gap.
        lost: vLLM batches missed that the replay could not return.
        resyncs: Snapshots written because the index reported a gap.
        engine_restarts: Times the engine's seq went back (its cache restarted empty).
        last_seq: The engine's seq of the last batch dealt with, or None.
    """

    batches: int = 0
    applied: int = 0
    decode_errors: int = 0
    replays: int = 0
    lost: int = 0
    resyncs: int = 0
    engine_restarts: int = 0
    last_seq: int | None = None


@dataclass(slots=True)
class _Heartbeat:
    client: Client
    view: WorkerView
    keyspace: Keyspace
    interval_s: float
    ttl_s: float


class VllmAdapter:
    """Subscribes to one vLLM publisher (one DP rank) and keeps host ``host`` in ``index``.

    Args:
        index: The index our workers feed too.
        host: This engine's host name in the index.
        translator: The event translator (model name, block size).
        endpoint: vLLM's PUB endpoint to connect to (e.g. ``tcp://10.0.0.5:5557``).
        replay_endpoint: vLLM's ROUTER replay endpoint, or None (gaps then stay lost).
        topic: The topic to subscribe to ("" for all).
        replay_timeout_s: How long to wait for each replayed message.
        heartbeat: ``(redis client, view)`` to publish the host's heartbeat, or None.
        keyspace: Where the heartbeat goes.
        clock: Wall clock (batch timestamps).
    """

    def __init__(
        self,
        index: KVIndex,
        host: str,
        translator: VllmTranslator,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 1.0,
        heartbeat: tuple[Client, WorkerView] | None = None,
        keyspace: Keyspace | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.host = host
        self.translator = translator
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.clock = clock
        self.epoch = secrets.randbits(62) + 1
        self.seq = 0
        self.stats = AdapterStats()
        self._beat = (
            None if heartbeat is None else _Heartbeat(heartbeat[0], heartbeat[1],
                keyspace or Keyspace(), heartbeat_interval_s, heartbeat_ttl_s)
        )  # fmt: skip
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connect, clear the host in the index (an empty snapshot at seq 0), start consuming."""
        await self._retry(lambda: self.index.replace(self._snapshot()))
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.replay_endpoint)
        self._tasks = [asyncio.create_task(self._run(), name=f"vllm-adapter-{self.host}")]
        if self._beat is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat(self._beat)))

    async def stop(self) -> None:
        """Stop consuming, withdraw the heartbeat (routers drop the engine at once; the
        index keeps its entries until the ingester purges the host) and close the sockets."""
        started = bool(self._tasks)
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if self._beat is not None and started:
            with contextlib.suppress(RedisError, OSError):
                await self._beat.client.delete(self._beat.keyspace.heartbeat(self.host))
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            await self.handle(await self._sub.recv_multipart())

    async def handle(self, frames: list[bytes]) -> None:
        """Deal with one message of the PUB socket (replaying what came before it if missed)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.stats.last_seq
        if last is None:
            if seq > 0:
                await self._catch_up(0, seq)
        elif seq <= last:
            log.warning("vLLM host %s: seq went back from %d to %d: the engine restarted",
                        self.host, last, seq)  # fmt: skip
            self.stats.engine_restarts += 1
            self.translator.clear()
            await self._apply([AllCleared()])
        elif seq > last + 1:
            await self._catch_up(last + 1, seq)
        await self._process(seq, frames[2])

    async def _catch_up(self, start: int, until: int) -> None:
        """Ask the replay socket for batches ``start .. until - 1`` and process them."""
        if self._replay is None:
            self.stats.lost += until - start
            return
        self.stats.replays += 1
        await self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        expected = start
        timeout_ms = int(self.replay_timeout_s * 1000)
        while await self._replay.poll(timeout_ms):
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] == _END_SEQ or not frames[2]:
                break
            seq = int.from_bytes(frames[1], "big")
            if expected <= seq < until:
                self.stats.lost += seq - expected
                await self._process(seq, frames[2])
                expected = seq + 1
        self.stats.lost += max(0, until - expected)

    async def _process(self, seq: int, payload: bytes) -> None:
        self.stats.last_seq = seq
        try:
            events = self.translator.translate(payload)
        except VllmDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("vLLM host %s: skipped batch %d: %s", self.host, seq, exc)
            return
        self.stats.batches += 1
        if events:
            await self._apply(events)

    async def _apply(self, events: list[Event]) -> None:
        self.seq += 1
        batch = EventBatch(self.host, self.epoch, self.seq, self.clock(), events)
        result = await self._retry(lambda: self.index.apply(batch))
        if result.status is ApplyStatus.APPLIED:
            self.stats.applied += 1
        elif result.status is ApplyStatus.GAP:
            log.info("vLLM host %s: the index lost its entries; writing a snapshot", self.host)
            await self._retry(lambda: self.index.replace(self._snapshot()))
            self.stats.resyncs += 1

    def _snapshot(self) -> Snapshot:
        blocks = self.translator.snapshot_blocks() if self.seq else {}
        return Snapshot(self.host, self.epoch, self.seq, self.clock(), blocks)

    async def _retry(self, call: Callable[[], Any]) -> Any:
        """Run an index call until the index answers (every call here is idempotent)."""
        delay = 0.05
        while True:
            try:
                return await call()
            except IndexUnavailableError as exc:
                log.warning("vLLM host %s: index unavailable (%s); retrying", self.host, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _heartbeat(self, beat: _Heartbeat) -> None:
        key = beat.keyspace.heartbeat(self.host)
        while True:
            view = msgspec.structs.replace(beat.view, host=self.host, epoch=self.epoch,
                                           ts=self.clock())  # fmt: skip
            with contextlib.suppress(RedisError, OSError):
                await beat.client.set(key, encode_view(view), px=int(beat.ttl_s * 1000))
            await asyncio.sleep(beat.interval_s)
