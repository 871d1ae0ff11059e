"""A TCP forwarder on loopback with fault knobs: added latency, cut connections, refusals.

Chaos tests put one in front of Redis (every process gets the proxy's URL)
and one in front of a worker (the worker advertises the proxy's URL), then
turn the knobs while load runs::

    client --> 127.0.0.1:port (TcpProxy) --> target host:port
                 | latency_ms: each chunk is held that long, in each direction
                 | cut():       every open connection is aborted at once (RST)
                 | refusing:    new connections are accepted and closed at once

The proxy runs its own asyncio loop in a daemon thread so that a test's
synchronous code (process kills, restarts) and its load generator (another
loop) can both go through it. Latency delays chunks without throttling:
each direction queues ``(due time, bytes)`` and a writer sends each chunk
when it is due, so a stream keeps its throughput and gains a fixed delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvrouter.embedded_redis import free_port

__all__ = ["ProxyStats", "TcpProxy"]

_CHUNK = 65536
_T = TypeVar("_T")


@dataclass(slots=True)
class ProxyStats:
    """What the proxy did so far.

    Attributes:
        accepted: Connections accepted and forwarded.
        refused: Connections closed at once (refusing, or the target did not answer).
        cut: Connections aborted by :meth:`TcpProxy.cut`.
    """

    accepted: int = 0
    refused: int = 0
    cut: int = 0


@dataclass(slots=True, eq=False)
class _Link:
    """One forwarded connection: both transports and the two pump tasks."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        """Drop both sides at once, unsent bytes included (the peers see a reset)."""
        for writer in (self.client, self.upstream):
            writer.transport.abort()


class TcpProxy:
    """Forward ``127.0.0.1:port`` to ``target_host:target_port`` (see the module docstring).

    Args:
        target_host: Where connections go.
        target_port: The target's port.
        port: Port to listen on (a free one by default).
    """

    def __init__(self, target_host: str, target_port: int, *, port: int | None = None) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port or free_port()
        self.latency_ms = 0.0
        self.refusing = False
        self.stats = ProxyStats()
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:port``, what clients connect to."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        """Start listening (returns once the socket is bound)."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._accept, "127.0.0.1", self.port)
                )
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"tcp-proxy-{self.port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            self._thread = None
            raise RuntimeError(f"proxy could not listen on {self.port}: {failure[0]}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and end the thread."""
        if self._thread is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None
        self._loop = None

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- knobs ------------------------------------------------------------------------------------

    def set_latency(self, ms: float) -> None:
        """Hold every chunk ``ms`` milliseconds, in each direction (0 = none)."""
        if ms < 0:
            raise ValueError("latency must be >= 0")
        self.latency_ms = ms

    def set_refusing(self, refusing: bool) -> None:
        """Close new connections as soon as they are accepted (open ones are kept)."""
        self.refusing = refusing

    def cut(self) -> int:
        """Abort every open connection now; returns how many were cut."""
        if self._loop is None:
            return 0

        async def cut_all() -> int:
            links = list(self._links)
            for link in links:
                link.abort()
            self._links.clear()
            self.stats.cut += len(links)
            return len(links)

        return self._call(cut_all())

    def heal(self) -> None:
        """Back to a plain forwarder: no latency, no refusals."""
        self.latency_ms = 0.0
        self.refusing = False

    @property
    def open_connections(self) -> int:
        """Connections being forwarded right now."""
        return len(self._links)

    # -- forwarding -------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the proxy's loop and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.abort()
        self._links.clear()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            self.stats.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            self.stats.refused += 1
            writer.transport.abort()
            return
        self.stats.accepted += 1
        link = _Link(writer, up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.gather(*link.tasks)
        except OSError:
            pass
        finally:
            self._links.discard(link)
            link.abort()
            for task in link.tasks:
                task.cancel()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk sent ``latency_ms`` after it arrived; EOF passes on."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(_CHUNK):
                await queue.put((loop.time() + self.latency_ms / 1000.0, data))
                if sender.done():
                    break
        except OSError:
            pass
        finally:
            await queue.put(None)
        with contextlib.suppress(OSError):
            await sender
