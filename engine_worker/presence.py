"""A worker's presence in Redis: heartbeat, registry entry and control stream.

* Heartbeat: every ``interval_s`` the worker writes its :class:`WorkerView`
  (role, load, KV usage per medium, measured load bandwidth, timing
  profile) to ``{prefix}:hb:{host}`` with a TTL; a dead worker's key
  expires and the indexer purges its entries.
* Registry: every beat checks the worker's registration (``register``
  callback over the index's host registry) so that discovery finds it
  without scanning, also after Redis lost its data.
* Control: the worker blocks on ``{prefix}:ctl:{host}``; an ``op=snapshot``
  entry makes it publish a full snapshot in its event stream.

Redis being away never stops the worker: each loop logs once, retries,
and carries on when Redis answers again; coming back after a failed beat
asks the engine for a snapshot, so the index resynchronizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from indexer.ingest_reader import Client as RedisClient
from indexer.tasks import cancel_and_wait
from indexer.views import WorkerView
from indexer.wire import CONTROL_FIELD, OP_SNAPSHOT, Keyspace, encode_view

__all__ = ["Presence"]

log = logging.getLogger(__name__)


class Presence:
    """Heartbeat + control listener for one worker."""

    def __init__(
        self,
        client: RedisClient,
        host: str,
        view: Callable[[], WorkerView],
        on_snapshot_request: Callable[[], None],
        *,
        keyspace: Keyspace | None = None,
        register: Callable[[], Awaitable[object]] | None = None,
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
        control_block_ms: int = 1000,
    ) -> None:
        if ttl_s <= interval_s:
            raise ValueError("heartbeat TTL must exceed its interval")
        self.client = client
        self.host = host
        self.view = view
        self.on_snapshot_request = on_snapshot_request
        self.keyspace = keyspace or Keyspace()
        self.register = register
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.control_block_ms = control_block_ms
        self.beats = 0
        self.snapshot_requests = 0
        self.redis_ok = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the heartbeat and control tasks."""
        self._tasks = [
            asyncio.create_task(self._heartbeat(), name=f"heartbeat-{self.host}"),
            asyncio.create_task(self._control(), name=f"control-{self.host}"),
        ]

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop; with ``deregister`` delete the heartbeat so routers drop the worker at once."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
        if deregister:
            with contextlib.suppress(RedisError, OSError):
                await self.client.delete(self.keyspace.heartbeat(self.host))

    async def beat(self) -> None:
        """Write one heartbeat now (checking the registration first)."""
        if self.register is not None:
            await self.register()
        await self.client.set(
            self.keyspace.heartbeat(self.host),
            encode_view(self.view()),
            px=int(self.ttl_s * 1000),
        )
        self.beats += 1

    async def _heartbeat(self) -> None:
        ever_ok = False
        while True:
            try:
                await self.beat()
                if not self.redis_ok:
                    log.info("worker %s: heartbeat reaches Redis", self.host)
                    if ever_ok:
                        # Back after an outage: whatever was lost, a snapshot resynchronizes.
                        self.on_snapshot_request()
                self.redis_ok = ever_ok = True
            except (RedisError, OSError) as exc:
                if self.redis_ok:
                    log.warning("worker %s: heartbeat failed: %s", self.host, exc)
                self.redis_ok = False
            await asyncio.sleep(self.interval_s)

    async def _control(self) -> None:
        stream = self.keyspace.control(self.host)
        # Start after the newest entry present now (requests before our start are stale, and
        # the start-up snapshot answers them); "$" would race between two XREAD calls.
        last_id: bytes | str | None = None
        while True:
            try:
                if last_id is None:
                    newest: Any = await self.client.xrevrange(stream, count=1)
                    last_id = newest[0][0] if newest else "0-0"
                # RESP2 reply: [(stream, [(entry_id, {field: value}), ...])]
                reply: Any = await self.client.xread({stream: last_id}, block=self.control_block_ms)
            except (RedisError, OSError):
                await asyncio.sleep(self.interval_s)
                continue
            for _name, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    if fields.get(CONTROL_FIELD) == OP_SNAPSHOT:
                        self.snapshot_requests += 1
                        self.on_snapshot_request()
