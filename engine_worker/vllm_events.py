"""Publishes the pool's events in vLLM's KV-event format, so vLLM-ecosystem routers can use us.

The layout is the one vLLM's ``ZmqEventPublisher`` sends and
:mod:`indexer.vllm_adapter` parses (facts of the wire, our own code):

* PUB socket, multipart ``[topic, seq, payload]``: ``seq`` is 8 bytes
  big-endian, from 0, +1 per batch; ``payload`` is msgpack of the batch
  ``[ts, events, data_parallel_rank]`` (vLLM's array layout; rank 0).
* Events are maps tagged by ``"type"`` (what current vLLM and
  ``vllm-router`` read): ``BlockStored{block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name[, extra_keys]}``,
  ``BlockRemoved{block_hashes, medium}``, ``AllBlocksCleared{}``.
* ROUTER replay socket: ``[identity, b"", start_seq]`` is answered with
  ``[identity, b"", seq, payload]`` for each kept batch with
  ``seq >= start_seq``, then ``[identity, b"", -1 (8 bytes signed), b""]``.
  The last ``buffer_steps`` batches are kept.

Mapping (:class:`VllmEventEncoder`, a pure core): block hashes are our
block keys (u64 ints); media map ``hbm`` -> ``"GPU"``, ``dram`` ->
``"CPU"``, ``ssd`` -> ``"DISK"``. vLLM's first block of a sequence has no
parent, so our root parent (the model's root) becomes ``None``; a chain
under another root (a cache salt) also gets ``None`` plus an opaque
``extra_keys`` entry naming that root, as vLLM puts the salt in the first
block's extra keys -- consumers then cannot confuse it with an unsalted
prefix. vLLM's events always carry token ids: the worker turns on the
pool's token ids, and a block stored again on another medium (demotion,
promotion) reuses the tokens and parent it was first announced with. A
block whose tokens this encoder never saw (restored from SSD at start,
imported from a peer) is not announced, nor are its removals; its
children name it as parent, which a consumer cannot chain and so ignores.

Snapshots (what the Redis path uses to resynchronize) are reconciled: a
block the encoder holds but the snapshot lacks is announced removed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from indexer.events import AllCleared, BlockRemoved, BlockStored, Event
from indexer.media import MEDIA, Medium

__all__ = ["VLLM_MEDIUM", "VllmEncoderStats", "VllmEventEncoder", "VllmEventPublisher"]

log = logging.getLogger(__name__)

#: vLLM's names of our media.
VLLM_MEDIUM: dict[Medium, str] = {Medium.HBM: "GPU", Medium.DRAM: "CPU", Medium.SSD: "DISK"}
_END_SEQ = (-1).to_bytes(8, "big", signed=True)

VllmEvent = dict[str, Any]


@dataclass(slots=True)
class _Held:
    """A block some medium holds: how it was announced (None: never, tokens unknown)."""

    media: int
    parent: int | None
    tokens: list[int] | None
    extra: str | None


@dataclass(slots=True)
class VllmEncoderStats:
    """What the encoder could not announce (exported in logs and read by tests)."""

    untokenized: int = 0
    reconciled: int = 0


class VllmEventEncoder:
    """Pure core: our pool events in, vLLM event maps out (one call per engine step).

    Args:
        block_size: Tokens per block.
        root: The model's root parent key (``indexer.keys.root_parent(model, "", "")``).
    """

    def __init__(self, block_size: int, root: int) -> None:
        self.block_size = block_size
        self.root = root
        self.blocks: dict[int, _Held] = {}
        # Blocks that left their last medium during this call: a demotion is ``removed``
        # then ``stored`` on the slower medium, and the store must find how it was announced.
        self._gone: dict[int, _Held] = {}
        self.stats = VllmEncoderStats()

    def encode(self, events: list[Event]) -> list[VllmEvent]:
        """vLLM events for ``events`` (consecutive stores of one chain are merged)."""
        out: list[VllmEvent] = []
        self._gone.clear()
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev, out)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev.keys, ev.medium, out)
            elif isinstance(ev, AllCleared):
                self.blocks.clear()
                self._gone.clear()
                out.append({"type": "AllBlocksCleared"})
        self._gone.clear()
        return out

    def reconcile(self, blocks: dict[Medium, list[int]]) -> list[VllmEvent]:
        """Removals for what the encoder holds that a pool snapshot does not."""
        out: list[VllmEvent] = []
        for m in MEDIA:
            present = set(blocks.get(m, ()))
            gone = [k for k, b in self.blocks.items() if b.media >> m.rank & 1 and k not in present]
            self.stats.reconciled += len(gone)
            self._removed(gone, m, out)
        return out

    def _stored(self, ev: BlockStored, out: list[VllmEvent]) -> None:
        bs = self.block_size
        parent = ev.parent
        for i, key in enumerate(ev.keys):
            held = self.blocks.get(key)
            if held is None and key in self._gone:
                held = self.blocks[key] = self._gone.pop(key)
            if held is None:
                tokens = ev.token_ids[i * bs : (i + 1) * bs] if ev.token_ids else None
                held = self.blocks[key] = self._announce(parent, tokens)
            fresh = not held.media >> ev.medium.rank & 1
            held.media |= 1 << ev.medium.rank
            parent = key
            if fresh and held.tokens is not None:
                self._emit_stored(key, held, ev.medium, out)
            elif held.tokens is None:
                self.stats.untokenized += 1

    def _announce(self, parent: int | None, tokens: list[int] | None) -> _Held:
        """How a newly seen block is described to vLLM consumers (parent, salt marker)."""
        if tokens is not None and len(tokens) != self.block_size:
            tokens = None
        if parent is None or parent == self.root:
            return _Held(0, None, tokens, None)
        if parent in self.blocks or parent in self._gone:
            return _Held(0, parent, tokens, None)
        return _Held(0, None, tokens, f"root:{parent:016x}")

    def _emit_stored(self, key: int, held: _Held, medium: Medium, out: list[VllmEvent]) -> None:
        assert held.tokens is not None
        last = out[-1] if out else None
        if (
            last is not None
            and last["type"] == "BlockStored"
            and last["medium"] == VLLM_MEDIUM[medium]
            and last["block_hashes"][-1] == held.parent
            and held.extra is None
        ):
            last["block_hashes"].append(key)
            last["token_ids"].extend(held.tokens)
            if "extra_keys" in last:
                last["extra_keys"].append(None)
            return
        ev: VllmEvent = {
            "type": "BlockStored",
            "block_hashes": [key],
            "parent_block_hash": held.parent,
            "token_ids": list(held.tokens),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": VLLM_MEDIUM[medium],
            "lora_name": None,
        }
        if held.extra is not None:
            ev["extra_keys"] = [[held.extra]]
        out.append(ev)

    def _removed(self, keys: list[int], medium: Medium, out: list[VllmEvent]) -> None:
        name = VLLM_MEDIUM[medium]
        for key in keys:
            held = self.blocks.get(key)
            if held is None or not held.media >> medium.rank & 1:
                continue
            held.media &= ~(1 << medium.rank)
            if held.media == 0:
                self._gone[key] = self.blocks.pop(key)
            if held.tokens is None:
                continue
            last = out[-1] if out else None
            if last is not None and last["type"] == "BlockRemoved" and last["medium"] == name:
                last["block_hashes"].append(key)
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [key], "medium": name})


class VllmEventPublisher:
    """Event sink: a PUB socket of vLLM batches plus a ROUTER replay socket, on its own thread.

    The engine thread only queues; the publisher thread encodes, publishes,
    keeps the last ``buffer_steps`` batches and answers replay requests (ZMQ
    sockets never leave that thread). Both endpoints are bound here
    (``tcp://*:5557``, ``tcp://127.0.0.1:5558``); subscribers connect.

    Args:
        endpoint: The PUB endpoint to bind.
        block_size: Tokens per block.
        root: The model's root parent key.
        replay_endpoint: The ROUTER endpoint to bind, or None (no replay).
        topic: The topic frame of every message.
        buffer_steps: How many recent batches replay can return.
        hwm: The PUB socket's send high-water mark.
    """

    def __init__(self, endpoint: str, *, block_size: int, root: int,
                 replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:  # fmt: skip
        self.encoder = VllmEventEncoder(block_size, root)
        self.topic = topic.encode()
        self.seq = 0
        self.batches_sent = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._buffer_steps = buffer_steps
        self._queue: queue.SimpleQueue[list[Event] | dict[Medium, list[int]] | None] = (
            queue.SimpleQueue()
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self._thread: threading.Thread | None = None

    # -- EventSink (engine thread) ------------------------------------------------------------

    def put_events(self, events: list[Event]) -> None:
        """Queue one step's events (one vLLM batch)."""
        self._queue.put(events)

    def put_snapshot(self, blocks: dict[Medium, list[int]], ts: float) -> None:
        """Queue a snapshot: removals for anything announced that the pool no longer holds."""
        self._queue.put(blocks)

    # -- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the publisher thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vllm-events", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what is queued, stop the thread and close the sockets."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay(self._replay)
                try:
                    item = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if item is None:
                    return
                if isinstance(item, dict):
                    events = self.encoder.reconcile(item)
                else:
                    events = self.encoder.encode(item)
                if events:
                    self._publish(events)
        except Exception:
            log.exception("vLLM event publisher failed; no more vLLM events from this worker")

    def _publish(self, events: list[VllmEvent]) -> None:
        payload = self._encoder.encode([time.time(), events, 0])
        seq = self.seq.to_bytes(8, "big")
        self._pub.send_multipart([self.topic, seq, payload])
        self._buffer.append((self.seq, payload))
        if len(self._buffer) > self._buffer_steps * 2:
            del self._buffer[: -self._buffer_steps]
        self.seq += 1
        self.batches_sent += 1

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("vLLM events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer[-self._buffer_steps :]:
            if seq >= start:
                sock.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        sock.send_multipart([client, b"", _END_SEQ, b""])
