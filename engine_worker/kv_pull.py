"""Pulling KV blocks from another worker: only what this worker lacks, validated, timed.

:class:`KvPuller` asks its own pool how much of a run of keys it holds
already and, in the same call on the engine thread, reserves fresh HBM blocks
for the first window of the rest (at most
:data:`~engine_worker.kv_transfer.MAX_TRANSFER_BLOCKS` keys); it then requests
the window over the source's KV data socket (:mod:`engine_worker.kv_socket`),
where each block is received straight into its reserved block and checked; the
window is cached only when all of it is valid, else its blocks go back
uncached. So a pull costs two pool calls here (lack and reserve; commit) and
one on the source (pin), each run under the scheduler lock while a step
executes (:meth:`~engine_worker.engine.EngineLoop.pool_call`), so a busy
worker's step does not hold them up. A source without a data port is pulled
over HTTP (``POST /kv/blocks``), validated in full, then imported. A failure
leaves the windows imported so far (each a valid prefix) and raises
:class:`~engine_worker.kv_transfer.TransferError`: the caller computes what is
missing. Every pull is timed end to end (from asking the pool what it lacks to
the blocks cached, :attr:`PullResult.seconds`); the worker's transfer bandwidth,
which its heartbeat publishes, folds in only the time its blocks were streaming
(from the transfer's first byte to its last), and only for streams of blocks the
source held in memory: a source reads its SSD blocks as it streams them, the
header says how many (``streamed``), and the router prices those reads itself,
per source and medium (:func:`policies.cost_model.peer_read_seconds`), so a pull
of a peer's SSD copy must not make every later pull look that slow.
A ``sim`` worker's pulls take and publish modeled time instead
(:class:`ModeledTransfer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import httpx

from engine_worker.block_pool import BlockPool
from engine_worker.engine import EngineLoop
from engine_worker.kv_socket import TRANSFER_THREADS, fetch_blocks
from engine_worker.kv_transfer import (
    MAX_TRANSFER_BLOCKS,
    Expected,
    Reservation,
    TransferError,
    TransferHeader,
    expected_for,
    import_blocks,
    read_transfer,
    reserve_import,
)
from engine_worker.metrics import WorkerMetrics
from engine_worker.scheduler import Scheduler
from engine_worker.transfer_stat import TransferStat

if TYPE_CHECKING:
    from engine_worker.tiers import TierStorage

__all__ = ["KvPuller", "ModeledTransfer", "PullResult"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PullResult:
    """What one pull did.

    Attributes:
        requested: Keys asked for (the whole run).
        present: Leading keys this worker held already (not transferred).
        pulled: Blocks received and imported.
        bytes: Bytes received (headers included).
        seconds: Wall time of the transfers.
    """

    requested: int
    present: int
    pulled: int
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ModeledTransfer:
    """How a ``sim`` worker's pulls take time: its blocks are placeholders of a few
    bytes, so timing them would publish a bandwidth that prices the profile's real KV
    bytes (~128 KiB per token for Llama-3-8B) thousands of times too slow. Instead a
    pull lasts what the profile's bytes take at ``bandwidth``, times ``time_scale`` (as
    its steps do), and the worker publishes ``bandwidth`` over ``time_scale`` (a
    bandwidth in wall time, as its published profile is), as the offline simulator
    moves KV.

    Attributes:
        kv_bytes_per_token: The profile's KV bytes per token.
        bandwidth: Modeled bytes/s of a pull.
        time_scale: Wall seconds per modeled second (the worker's ``time_scale``).
    """

    kv_bytes_per_token: int
    bandwidth: float
    time_scale: float


class KvPuller:
    """Pulls blocks into one worker's pool (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: EngineLoop,
        storage: TierStorage | None,
        model: str,
        block_size: int,
        metrics: WorkerMetrics,
        token: str | None,
        timeout_s: float = 30.0,
        modeled: ModeledTransfer | None = None,
    ) -> None:
        self.engine = engine
        self.modeled = modeled
        self.storage = storage
        self.model = model
        self.block_size = block_size
        self.metrics = metrics
        self.stat = TransferStat()
        self._token = token
        self._timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(timeout=timeout_s)
        self._ports: dict[str, int | None] = {}
        self._receivers = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="kv-receive")

    async def aclose(self) -> None:
        """Close the HTTP client and the receiver threads."""
        await self._client.aclose()
        self._receivers.shutdown(wait=False)

    @property
    def bandwidth(self) -> float | None:
        """Recent bytes/s of pulls (None before the first)."""
        return self.stat.bandwidth

    async def _on_pool(self, fn: Callable[[BlockPool], _T]) -> _T:
        def call(s: Scheduler) -> _T:
            return fn(s.pool)

        return await self.engine.apool_call(call)

    async def pull(
        self, source_url: str, keys: Sequence[int], release: str | None = None
    ) -> PullResult:
        """Make this worker hold the run ``keys`` (a prefix chain), pulling from ``source_url``.

        ``release`` names the source's lease on these blocks (a PD hand-off): the last
        request releases it, or a request for nothing when this worker holds them all.

        Raises:
            TransferError: The source refused, the connection failed, or a window was
                invalid (``reason`` says which); windows before it stay imported.
        """
        keys = list(keys)
        pulled = received = timed = 0
        streaming = 0.0
        started = time.perf_counter()
        try:
            port = await self._data_port(source_url)
            present, reservation = await self._lacking(keys, reserve=port is not None)
            starts = list(range(present, len(keys), MAX_TRANSFER_BLOCKS)) or [len(keys)]
            for start in starts:
                window = keys[start : start + MAX_TRANSFER_BLOCKS]
                if not window and release is None:
                    break
                last = start == starts[-1]
                rel = release if last else None
                if port is None:
                    got, size, streamed = await self._http_window(source_url, window, rel)
                else:
                    got, size, streamed = await self._socket_window(
                        source_url, port, window, rel, reservation
                    )
                reservation = None
                pulled += got
                received += size
                if streamed is not None:
                    timed += size
                    streaming += streamed
                if got < len(window):
                    break
        except TransferError as exc:
            self.metrics.transfer_failures.labels(exc.reason).inc()
            log.warning("pull of %d blocks from %s refused: %s", len(keys), source_url, exc)
            raise
        seconds = time.perf_counter() - started
        if received and self.modeled is not None:
            # Placeholder blocks: take, and publish, the time the modeled bytes would (a
            # pull that only released a lease moved no block and says nothing of either).
            if pulled:
                size = pulled * self.block_size * self.modeled.kv_bytes_per_token
                modeled = size / self.modeled.bandwidth
                wait = modeled * self.modeled.time_scale - seconds
                if wait > 0:
                    await asyncio.sleep(wait)
                    seconds += wait
                self.stat.add(size, modeled * (self.modeled.time_scale or 1.0))
        elif pulled and timed:
            # The blocks' streaming time, not the source's reads before its first byte
            # nor a stream its reads paced.
            self.stat.add(timed, streaming)
        if received:
            self.metrics.transfer_bytes.labels("received").inc(received)
            self.metrics.transfer_blocks.labels("received").inc(pulled)
        return PullResult(len(keys), present, pulled, received, seconds)

    async def _lacking(self, keys: list[int], reserve: bool) -> tuple[int, Reservation | None]:
        """How many leading ``keys`` the pool holds and, with ``reserve``, a reservation for
        the first window of the rest (one pool call)."""
        storage = self.storage

        def lacking(s: Scheduler) -> tuple[int, Reservation | None]:
            present = len(s.pool.match_prefix(keys))
            window = keys[present : present + MAX_TRANSFER_BLOCKS]
            if not (reserve and window):
                return present, None
            return present, reserve_import(s.pool, storage, None, window)

        return await self._reserving(lacking)

    async def _reserving(
        self, fn: Callable[[Scheduler], tuple[int, Reservation | None]]
    ) -> tuple[int, Reservation | None]:
        """``fn`` as a pool call; what it reserves is given back if the caller is
        cancelled meanwhile."""
        future = self.engine.pool_call(fn)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._give_back_late)
            raise

    async def _data_port(self, source_url: str) -> int | None:
        """The source's KV data port (cached); None when it has none (HTTP only)."""
        if source_url in self._ports:
            return self._ports[source_url]
        port: int | None = None
        try:
            r = await self._client.get(
                f"{source_url.rstrip('/')}/kv/endpoint", headers=self._headers, timeout=5.0
            )
            if r.status_code == 200:
                value = r.json().get("port")
                port = value if isinstance(value, int) and 0 < value < 65536 else None
            elif r.status_code in (401, 403):
                raise TransferError("auth", f"{source_url} refused the internal token")
        except (httpx.HTTPError, ValueError) as exc:
            raise TransferError("http", f"{source_url}/kv/endpoint: {exc!r}") from exc
        if len(self._ports) < 1024:
            self._ports[source_url] = port
        return port

    def _expected(self, keys: list[int]) -> Expected:
        layout = self.storage.layout if self.storage is not None else None
        return expected_for(self.model, self.block_size, layout, keys)

    async def _http_window(
        self, source_url: str, keys: list[int], release: str | None
    ) -> tuple[int, int, float | None]:
        """Pull one window over HTTP, then import it; returns (blocks imported, bytes,
        seconds from the body's first byte to its last, or None when the source read
        blocks off its storage as it streamed them)."""
        header, blocks, received, seconds = await self._http_fetch(
            source_url, keys, release, self._expected(keys)
        )
        streamed = None if header.streamed else seconds
        if not header.keys:
            return 0, received, streamed
        storage = self.storage

        def put(pool: BlockPool) -> int:
            return import_blocks(
                pool, storage, header.parent, header.keys, blocks, header.checksums
            )

        return await self._on_pool(put), received, streamed

    async def _socket_window(
        self,
        source_url: str,
        port: int,
        keys: list[int],
        release: str | None,
        reservation: Reservation | None,
    ) -> tuple[int, int, float | None]:
        """Pull one window over the data socket into ``reservation`` (reserved now when
        None); returns (blocks imported, bytes received, seconds from the header's arrival
        to the last block's, or None when the source read blocks off its storage as it
        streamed them: that time is its storage's as much as the network's)."""
        if reservation is None and keys:
            storage = self.storage
            _, reservation = await self._reserving(
                lambda s: (0, reserve_import(s.pool, storage, None, keys))
            )
        held = reservation
        arrived = 0.0

        async def land(header: TransferHeader) -> Sequence[memoryview]:
            nonlocal arrived
            arrived = time.perf_counter()
            return held.land(header) if held is not None else []

        try:
            header, _, received = await fetch_blocks(
                httpx.URL(source_url).host, port, self._token, keys, release,
                self._expected(keys), self._timeout_s, land, self._receivers,
            )  # fmt: skip
        except BaseException:
            if held is not None:
                self._give_back(held)
            raise
        streamed = None if header.streamed else time.perf_counter() - arrived
        if held is None:
            return 0, received, streamed
        # Shielded: once the blocks are in, a cancelled caller still has them cached.
        commit = self.engine.pool_call(lambda _: held.commit())
        return await asyncio.shield(asyncio.wrap_future(commit)), received, streamed

    def _give_back_late(self, future: Future[tuple[int, Reservation | None]]) -> None:
        if not future.cancelled() and future.exception() is None:
            reservation = future.result()[1]
            if reservation is not None:
                self._give_back(reservation)

    def _give_back(self, reservation: Reservation) -> None:
        """Abort a reservation in a pool call (also from a cancelled task)."""
        if self.engine.alive:
            self.engine.pool_call(lambda _: reservation.abort())

    async def _http_fetch(
        self, source_url: str, keys: list[int], release: str | None, expected: Expected
    ) -> tuple[TransferHeader, Sequence[memoryview], int, float]:
        """One window over ``POST /kv/blocks`` (a source without a data port); also the
        seconds from the body's first byte to its last."""
        received = 0
        first = 0.0
        url = f"{source_url.rstrip('/')}/kv/blocks"
        try:
            async with self._client.stream(
                "POST", url, json={"keys": keys, "release": release}, headers=self._headers
            ) as response:
                if response.status_code != 200:
                    body = (await response.aread())[:300].decode(errors="replace")
                    reason = "auth" if response.status_code in (401, 403) else "http"
                    raise TransferError(reason, f"{url} answered {response.status_code}: {body}")

                async def counted() -> AsyncIterator[bytes]:
                    nonlocal received, first
                    async for chunk in response.aiter_bytes():
                        if not received:
                            first = time.perf_counter()
                        received += len(chunk)
                        yield chunk

                header, blocks = await read_transfer(counted(), expected)
        except httpx.HTTPError as exc:
            raise TransferError("http", f"{url}: {exc!r}") from exc
        return header, blocks, received, time.perf_counter() - first if received else 0.0
