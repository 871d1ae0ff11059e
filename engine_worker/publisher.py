"""Publishes the pool's events to the worker's Redis stream.

The engine thread hands events and snapshots over in order
(:class:`engine_worker.engine.EventSink`); an asyncio task stamps each batch
with ``host``, ``epoch`` and the next ``seq``, batches by size and time, and
appends it to ``{prefix}:ev:{host}`` (XADD, approximate MAXLEN trim).

Faults: if Redis is unreachable the worker keeps serving; formed batches
wait in a bounded buffer (oldest dropped and counted when it is full), and
once Redis answers again the publisher sends what it kept and asks the
engine for a snapshot, which resynchronizes the index whatever was lost.
A dropped batch leaves a hole in ``seq`` that the indexer detects too.

``drop_rate`` is a fault hook for tests and chaos runs: that fraction of
formed batches is discarded instead of sent (their seq numbers are used).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from indexer.events import AllCleared, BlockStored, Event, EventBatch, Snapshot, encode_message
from indexer.ingest_reader import Client as RedisClient
from indexer.media import Medium
from indexer.tasks import cancel_and_wait
from indexer.wire import EVENT_FIELD, Keyspace

__all__ = ["EventPublisher", "PublisherStats", "new_epoch"]

log = logging.getLogger(__name__)


def new_epoch() -> int:
    """A random epoch for a worker start (63 bits, so it fits everywhere as a signed int)."""
    return secrets.randbits(62) + 1


@dataclass(slots=True)
class PublisherStats:
    """Counters a publisher keeps (exported as ``kvworker_`` metrics)."""

    batches_sent: int = 0
    events_sent: int = 0
    snapshots_sent: int = 0
    batches_dropped: int = 0
    batches_faulted: int = 0
    send_errors: int = 0
    buffered: int = 0


def _num_keys(ev: Event) -> int:
    return 1 if isinstance(ev, AllCleared) else len(ev.keys)


class EventPublisher:
    """Event sink + Redis stream writer for one worker."""

    def __init__(
        self,
        client: RedisClient,
        host: str,
        *,
        keyspace: Keyspace | None = None,
        epoch: int | None = None,
        max_batch_blocks: int = 512,
        max_delay_s: float = 0.01,
        buffer_limit: int = 10_000,
        stream_maxlen: int = 100_000,
        drop_rate: float = 0.0,
        request_snapshot: Callable[[], None] | None = None,
        include_token_ids: bool = False,
        seed: int | None = None,
    ) -> None:
        self.client = client
        self.host = host
        self.keyspace = keyspace or Keyspace()
        self.stream = self.keyspace.events(host)
        self.epoch = epoch if epoch is not None else new_epoch()
        self.max_batch_blocks = max_batch_blocks
        self.max_delay_s = max_delay_s
        self.buffer_limit = buffer_limit
        self.stream_maxlen = stream_maxlen
        self.drop_rate = drop_rate
        self.request_snapshot = request_snapshot
        self.include_token_ids = include_token_ids
        self.stats = PublisherStats()
        self.seq = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._incoming: deque[list[Event] | Snapshot] = deque()
        self._outbox: deque[tuple[bytes, bool]] = deque()  # (payload, is_snapshot)
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._healthy = True
        self._task: asyncio.Task[None] | None = None
        # Held while a chunk is in flight: the task and a final flush never send the
        # same chunk twice, nor pop what the other already popped.
        self._sending = asyncio.Lock()

    # -- EventSink (engine thread) ------------------------------------------------------------

    def put_events(self, events: list[Event]) -> None:
        """Queue events drained from the pool."""
        if not self.include_token_ids:
            events = [
                BlockStored(e.keys, e.parent, e.medium) if isinstance(e, BlockStored) else e
                for e in events
            ]
        self._push(events)

    def put_snapshot(self, blocks: dict[Medium, list[int]], ts: float) -> None:
        """Queue a snapshot; it is stamped with the seq of the batch flushed just before it."""
        self._push(Snapshot(host=self.host, epoch=self.epoch, seq=0, ts=ts, blocks=blocks))

    def _push(self, item: list[Event] | Snapshot) -> None:
        with self._lock:
            self._incoming.append(item)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    # -- the task -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the publishing task on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"publisher-{self.host}")
        self._wake.set()

    async def stop(self, flush_timeout: float = 2.0) -> None:
        """Stop the task (after the chunk it may be sending), then send what is pending
        (best effort, bounded)."""
        if self._task is None:
            return
        task, self._task = self._task, None
        try:
            async with asyncio.timeout(flush_timeout):
                async with self._sending:
                    await cancel_and_wait([task])
                await self.flush()
        except (TimeoutError, RedisError, OSError):
            log.warning("publisher %s stopped with %d batches unsent", self.host, len(self._outbox))
        finally:
            await cancel_and_wait([task])

    async def flush(self) -> None:
        """Form batches from everything queued and send them now."""
        self._form_batches()
        await self._send_outbox()

    @property
    def healthy(self) -> bool:
        """Whether the last send reached Redis."""
        return self._healthy

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.max_delay_s > 0 and self._pending_keys() < self.max_batch_blocks:
                await asyncio.sleep(self.max_delay_s)
            self._form_batches()
            await self._send_outbox()
            if self._outbox:
                await asyncio.sleep(0.2)  # Redis is down: retry later
                self._wake.set()

    def _pending_keys(self) -> int:
        with self._lock:
            return sum(
                sum(_num_keys(e) for e in item) if isinstance(item, list) else 1
                for item in self._incoming
            )

    def _form_batches(self) -> None:
        with self._lock:
            items = list(self._incoming)
            self._incoming.clear()
        pending: list[Event] = []
        size = 0
        for item in items:
            if isinstance(item, Snapshot):
                self._emit_batch(pending)
                pending, size = [], 0
                snap = Snapshot(item.host, item.epoch, self.seq, item.ts, item.blocks)
                self._enqueue(encode_message(snap), snapshot=True)
                continue
            for ev in item:
                pending.append(ev)
                size += _num_keys(ev)
                if size >= self.max_batch_blocks:
                    self._emit_batch(pending)
                    pending, size = [], 0
        self._emit_batch(pending)

    def _emit_batch(self, events: list[Event]) -> None:
        if not events:
            return
        self.seq += 1
        batch = EventBatch(self.host, self.epoch, self.seq, time.time(), events)
        if self.drop_rate > 0 and self._rng.random() < self.drop_rate:
            self.stats.batches_faulted += 1
            return
        self._enqueue(encode_message(batch), snapshot=False)

    def _enqueue(self, payload: bytes, *, snapshot: bool) -> None:
        self._outbox.append((payload, snapshot))
        while len(self._outbox) > self.buffer_limit:
            self._outbox.popleft()
            self.stats.batches_dropped += 1
        self.stats.buffered = len(self._outbox)

    async def _send_outbox(self) -> None:
        async with self._sending:
            await self._send_locked()

    async def _send_locked(self) -> None:
        if not self._outbox:
            return
        try:
            while self._outbox:
                chunk = list(self._outbox)[:256]
                async with self.client.pipeline(transaction=False) as pipe:
                    for payload, _ in chunk:
                        pipe.xadd(
                            self.stream,
                            {EVENT_FIELD: payload},
                            maxlen=self.stream_maxlen,
                            approximate=True,
                        )
                    await pipe.execute()
                for _, is_snapshot in chunk:
                    self._outbox.popleft()
                    if is_snapshot:
                        self.stats.snapshots_sent += 1
                    else:
                        self.stats.batches_sent += 1
        except (RedisError, OSError) as exc:
            self.stats.send_errors += 1
            if self._healthy:
                log.warning("publisher %s: Redis unreachable (%s); buffering", self.host, exc)
            self._healthy = False
            return
        finally:
            self.stats.buffered = len(self._outbox)
        if not self._healthy:
            self._healthy = True
            log.info("publisher %s: Redis is back; resynchronizing with a snapshot", self.host)
            if self.request_snapshot is not None:
                self.request_snapshot()
