"""Which workers exist and how they are doing: Redis registry + heartbeats, and/or a static list.

Every ``interval_s`` the directory rebuilds its view of the workers:

* Redis: ``HGETALL {p}:hosts`` (the registry workers write themselves
  into), then the heartbeat of each in one pipelined round trip; a worker
  whose heartbeat expired is gone. Nothing scans the keyspace.
* Static: ``GET {url}/worker/view`` on each configured URL.

A worker whose block size differs from the gateway's, or whose model the
gateway has no tokenizer for, is refused with one log line and a metric:
routing to it would compute keys the worker never produces. With
``allowed`` set, so is a worker whose URL's host is not one of the allowed
hosts or inside one of the allowed networks: a heartbeat is just a value in
Redis, and whoever can write it must not be able to point the gateway (and
its internal token) at an address of their choosing. A worker that
failed a dispatch (connection refused, timeout) is benched until a heartbeat
newer than the failure shows it alive again.

A worker whose registry entry exists but whose heartbeat expired is gone
at once, unless Redis itself was unreachable within the last ``grace_s``:
heartbeats cannot be renewed through an outage, so they all expire during
one, and the workers beat again right after it. A worker missing from the
registry itself (Redis restarted and lost its data; workers re-register on
their next beat) is kept for ``grace_s`` too, so neither a Redis outage nor
a restart ever empties the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import msgspec
from redis.exceptions import RedisError

from indexer.ingest_reader import Client as RedisClient
from indexer.tasks import cancel_and_wait
from indexer.views import WorkerView
from indexer.wire import Keyspace, decode_view
from kvrouter.gateway.metrics import RouterMetrics

__all__ = ["AllowedWorkers", "WorkerDirectory"]

log = logging.getLogger(__name__)


_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class AllowedWorkers:
    """Where workers may live: host names and IP networks (CIDR); empty allows all."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[_Network, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> AllowedWorkers:
        """From ``["10.0.0.0/8", "worker-0.svc", "127.0.0.1"]``; raises ValueError."""
        hosts, networks = set(), []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not entry or "/" in entry:
                    raise ValueError(f"not a host name or a network: {entry!r}") from None
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.hosts or self.networks)

    def allows(self, url: str) -> bool:
        """Whether ``url``'s host is allowed (always, when nothing is configured)."""
        if not self:
            return True
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if host in self.hosts:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in net for net in self.networks)


@dataclass(slots=True)
class WorkerDirectory:
    """The live, routable workers."""

    metrics: RouterMetrics
    block_size: int
    models: Collection[str]
    client: RedisClient | None = None
    keyspace: Keyspace = field(default_factory=Keyspace)
    static_urls: list[str] = field(default_factory=list)
    http: httpx.AsyncClient | None = None
    interval_s: float = 0.5
    grace_s: float = 5.0
    internal_token: str | None = None
    allowed: AllowedWorkers = field(default_factory=AllowedWorkers)
    clock: Callable[[], float] = time.time
    #: Called with (host, heartbeat ts) when a worker's heartbeat changes, (host, None)
    #: when it leaves (the router dates the heartbeat with its own counts).
    on_view: Callable[[str, float | None], None] | None = None
    views: dict[str, WorkerView] = field(default_factory=dict)
    benched: dict[str, float] = field(default_factory=dict)
    refused: set[tuple[str, str]] = field(default_factory=set)
    last_seen: dict[str, float] = field(default_factory=dict)
    redis_ok: bool = True
    #: When the last Redis outage ended (monotonic), None if there was none.
    recovered_at: float | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Refresh in the background."""
        self._task = asyncio.create_task(self._run(), name="discovery")

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def refresh(self) -> None:
        """Rebuild the worker set now."""
        found: dict[str, WorkerView] = {}
        now = time.monotonic()
        if self.client is not None:
            try:
                registered, beating = await self._from_redis()
            except (RedisError, OSError) as exc:
                if self.redis_ok:
                    log.warning("discovery: Redis unreachable (%s); keeping known workers", exc)
                self.metrics.redis_errors.labels("discovery").inc()
                self.redis_ok = False
                found.update(self.views)
            else:
                if not self.redis_ok:
                    self.recovered_at = now
                self.redis_ok = True
                found.update(beating)
                outage = self.recovered_at is not None and now - self.recovered_at < self.grace_s
                for host, view in self.views.items():
                    if host in found:
                        continue
                    recently = now - self.last_seen.get(host, now) < self.grace_s
                    if outage or (host not in registered and recently):
                        found[host] = view
                for host in beating:
                    self.last_seen[host] = now
        if self.static_urls:
            found.update(await self._from_static())
        accepted = {h: v for h, v in found.items() if self._accept(v)}
        for host in set(self.views) - set(accepted):
            self.metrics.worker_up.labels(host).set(0)
            self.last_seen.pop(host, None)
            if self.on_view is not None:
                self.on_view(host, None)
        if self.on_view is not None:
            for host, view in accepted.items():
                known = self.views.get(host)
                if known is None or known.ts != view.ts:
                    self.on_view(host, view.ts)
        self.views = accepted
        for host, view in accepted.items():
            benched_at = self.benched.get(host)
            if benched_at is not None and view.ts > benched_at:
                del self.benched[host]
            self.metrics.worker_up.labels(host).set(0 if host in self.benched else 1)

    async def _from_redis(self) -> tuple[set[str], dict[str, WorkerView]]:
        """(registered host names, views of those whose heartbeat is alive)."""
        assert self.client is not None
        raw_hosts: list[bytes] = await self.client.hkeys(self.keyspace.hosts)  # type: ignore[assignment]
        hosts = [h.decode() for h in raw_hosts]
        if not hosts:
            return set(), {}
        async with self.client.pipeline(transaction=False) as pipe:
            for h in hosts:
                pipe.get(self.keyspace.heartbeat(h))
            beats = await pipe.execute()
        out: dict[str, WorkerView] = {}
        for raw in beats:
            if raw is None:
                continue
            try:
                view = decode_view(raw)
            except ValueError:
                log.warning("discovery: ignoring an unreadable heartbeat")
                continue
            out[view.host] = view
        return set(hosts), out

    async def _from_static(self) -> dict[str, WorkerView]:
        assert self.http is not None
        http = self.http
        token = self.internal_token
        headers = {"authorization": f"Bearer {token}"} if token else {}

        async def one(url: str) -> WorkerView | None:
            try:
                r = await http.get(f"{url.rstrip('/')}/worker/view", timeout=2.0, headers=headers)
                r.raise_for_status()
                view = msgspec.json.decode(r.content, type=WorkerView)
            except (httpx.HTTPError, msgspec.MsgspecError):
                return None
            if not view.url:
                view.url = url.rstrip("/")
            return view

        views = await asyncio.gather(*(one(u) for u in self.static_urls))
        return {v.host: v for v in views if v is not None}

    def _accept(self, view: WorkerView) -> bool:
        reason = None
        if view.block_size != self.block_size:
            reason = f"block size {view.block_size} != the gateway's {self.block_size}"
        elif view.model not in self.models:
            reason = f"model {view.model!r} has no tokenizer here (serving {sorted(self.models)})"
        elif not self.allowed.allows(view.url):
            reason = "its address is outside the allowed worker hosts and networks"
        if reason is None:
            return True
        key = (view.host, reason)
        if key not in self.refused:
            self.refused.add(key)
            log.error("refusing worker %s at %s: %s", view.host, view.url, reason)
            label = {"block": "block_size", "model": "model"}.get(reason.split()[0], "address")
            self.metrics.worker_refused.labels(view.host, label).inc()
        return False

    def bench(self, host: str) -> None:
        """Stop routing to ``host`` until it heartbeats again after now."""
        self.benched[host] = self.clock()
        self.metrics.worker_up.labels(host).set(0)

    def routable(self, model: str) -> list[WorkerView]:
        """Healthy workers serving ``model``, by name."""
        return sorted(
            (v for h, v in self.views.items() if v.model == model and h not in self.benched),
            key=lambda v: v.host,
        )

    def served_models(self) -> list[str]:
        """Models at least one healthy worker serves."""
        return sorted({v.model for h, v in self.views.items() if h not in self.benched})
