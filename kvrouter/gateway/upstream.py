"""The gateway's HTTP/1.1 client to its workers: keep-alive connections, streamed bodies.

Every routed request is one POST to a worker whose answer (SSE or JSON) is
relayed as it arrives. A general client (httpx over httpcore over anyio)
spends most of the gateway's own time on a short request in its layers;
this one is an :class:`asyncio.Protocol` per connection with the C parser
``httptools`` (what uvicorn parses requests with), and nothing else:

* one pool of idle connections per worker (host, port); a connection goes
  back only after its response was read to the end and both sides keep it
  alive, and only for ``idle_s`` (below the workers' own keep-alive
  timeout, 5 s in uvicorn, so the worker never closes one the gateway is
  about to reuse);
* a response closed before its end closes its connection: that is how the
  gateway aborts a request on its worker (the worker sees the disconnect);
* a reused connection that ends without a byte of answer (closed by the
  worker as it was reused) sends the request once more on a new one;
* body chunks arrive de-chunked (``Transfer-Encoding: chunked`` is decoded
  by the parser); reading pauses while 1 MiB waits unread;
* timeouts: connecting, writing the request, and every read (the first
  byte of a streamed answer may take a long prefill);
* errors say where they happened (:class:`UpstreamError` ``stage``:
  ``connect``, ``send`` or ``read``) because the dispatcher's retry rule
  depends on it: only what provably did not reach the worker is retried.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpPool", "Timeouts", "UpstreamError", "UpstreamResponse"]

#: Unread body bytes at which a connection stops reading from its socket.
_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """A request to a worker failed.

    Attributes:
        stage: ``connect`` (nothing sent), ``send`` (writing the request failed or
            timed out) or ``read`` (the request was sent; the answer broke or timed out).
        timeout: Whether it was a timeout.
    """

    def __init__(self, stage: str, reason: str, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.stage = stage
        self.timeout = timeout


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds allowed for connecting, writing the request, and each read."""

    connect: float = 2.0
    write: float = 30.0
    read: float = 300.0


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._headers_done = False
        self.complete = False
        self.answered = False  # any byte of the current answer arrived
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._can_write: asyncio.Event = asyncio.Event()
        self._can_write.set()

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not derive from asyncio's classes; they implement them.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        if self._parser is None:
            self._fail(UpstreamError("read", "bytes from the worker with no request pending"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("read", f"invalid HTTP from the worker: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._can_write.set()
        if self.complete or self._parser is None:
            return
        if self._headers_done and self._until_close():
            self.complete = True  # a body without a length ends with the connection
            self._wake()
            return
        self._fail(UpstreamError("read", f"the worker closed the connection ({exc or 'EOF'})"))

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- httptools callbacks ------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered >= _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: the parser forgets the message's headers once it is complete.
        assert self._parser is not None
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- the request ------------------------------------------------------------------

    def _until_close(self) -> bool:
        framing = (b"content-length", b"transfer-encoding")
        return not any(n.lower() in framing for n, _ in self._headers)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        self._wake()
        if self.transport is not None:
            self.transport.close()

    async def _wait(self, limit_s: float, what: str) -> None:
        if self._error is not None:
            raise self._error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        # A timer on the future, not asyncio.timeout(): this runs for every chunk relayed.
        timer = loop.call_later(limit_s, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            self.close()
            reason = f"no {what} from the worker in {limit_s:g} s"
            raise UpstreamError("read", reason, timeout=True) from None
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def send(self, head: bytes, body: bytes, timeouts: Timeouts) -> None:
        if self.closed or self.transport is None:
            raise UpstreamError("send", "the connection is closed")
        self._parser = httptools.HttpResponseParser(self)
        self._headers, self._chunks, self._buffered = [], deque(), 0
        self._headers_done = self.complete = self._keep_alive = self.answered = False
        self._error = None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        if not self._can_write.is_set():
            try:
                async with asyncio.timeout(timeouts.write):
                    await self._can_write.wait()
            except TimeoutError:
                self.close()
                raise UpstreamError("send", "writing the request timed out", timeout=True) from None
            if self.lost_before_answer():
                # The worker never got the whole request: nothing to answer, safe to retry.
                raise UpstreamError("send", "the connection closed while the request was written")

    def lost_before_answer(self) -> bool:
        """Whether the connection closed before the answer's headers arrived."""
        return self.closed and not self._headers_done

    async def headers(self, limit_s: float) -> tuple[int, list[tuple[bytes, bytes]]]:
        while not self._headers_done:
            await self._wait(limit_s, "answer")
        assert self._parser is not None
        return self._parser.get_status_code(), self._headers

    async def next_chunk(self, limit_s: float) -> bytes | None:
        while not self._chunks:
            if self.complete:
                return None
            await self._wait(limit_s, "data")
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return self.complete and self._keep_alive and not self.closed and self._error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UpstreamResponse:
    """A worker's answer: status and headers now, the body as it arrives."""

    def __init__(
        self,
        pool: HttpPool,
        conn: _Connection,
        status: int,
        headers: list[tuple[bytes, bytes]],
        read_timeout: float,
    ) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status_code = status
        self.headers: Mapping[str, str] = {
            n.decode("latin-1").lower(): v.decode("latin-1") for n, v in headers
        }
        self._read_timeout = read_timeout

    async def next_chunk(self) -> bytes | None:
        """The next body bytes; None at the end (the connection is released then)."""
        conn = self._conn
        if conn is None:
            return None
        chunk = await conn.next_chunk(self._read_timeout)
        while chunk is not None and not chunk:
            chunk = await conn.next_chunk(self._read_timeout)
        if chunk is None:
            self._release()
        return chunk

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def aread(self) -> bytes:
        """The whole (rest of the) body."""
        parts = [chunk async for chunk in self.aiter_bytes()]
        return b"".join(parts)

    async def aclose(self) -> None:
        """Done with it: a finished answer releases its connection; an unfinished one
        closes it (the worker sees the client leave)."""
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._done(conn)


class HttpPool:
    """Keep-alive HTTP/1.1 connections to the workers, for POSTs with streamed answers."""

    def __init__(self, *, max_idle_per_host: int = 64, idle_s: float = 3.0) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.idle_s = idle_s
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self.connects = 0

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeouts: Timeouts
    ) -> UpstreamResponse:
        """Send ``body`` to ``url``; returns once the answer's headers arrived.

        Raises:
            UpstreamError: see its ``stage``.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError("connect", f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        key = (parts.hostname, port, tls)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        lines = [f"POST {target} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        reused = self._take(key)
        conn = reused or await self._connect(key, timeouts.connect)
        try:
            status, raw_headers = await self._exchange(conn, head, body, timeouts)
        except UpstreamError as exc:
            # A kept-alive connection the worker closed just as it was reused ends without
            # a byte of answer: the worker never took the request, so it goes once more on
            # a new connection (what HTTP clients do for a connection closed while idle).
            # A worker that is gone (the new connection is refused) keeps the first error:
            # the request reached a worker that died with it, and the dispatcher decides.
            if conn is not reused or exc.stage != "read" or exc.timeout or conn.answered:
                raise
            try:
                conn = await self._connect(key, timeouts.connect)
            except UpstreamError:
                raise exc from None
            status, raw_headers = await self._exchange(conn, head, body, timeouts)
        return UpstreamResponse(self, conn, status, raw_headers, timeouts.read)

    async def _exchange(
        self, conn: _Connection, head: bytes, body: bytes, timeouts: Timeouts
    ) -> tuple[int, list[tuple[bytes, bytes]]]:
        self._open.add(conn)
        try:
            await conn.send(head, body, timeouts)
            return await conn.headers(timeouts.read)
        except BaseException:
            conn.close()
            self._open.discard(conn)
            raise

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        for c in list(self._open):
            c.close()
        self._open.clear()

    def idle(self) -> int:
        """Idle connections held (for tests and metrics)."""
        return sum(len(q) for q in self._idle.values())

    def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        q = self._idle.get(key)
        now = time.monotonic()
        while q:
            conn = q.pop()  # the most recently used: the least likely to be closed
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    def _done(self, conn: _Connection) -> None:
        """A response is over: its connection goes back to the pool, or is closed."""
        self._open.discard(conn)
        if not conn.reusable():
            conn.close()
            return
        q = self._idle.setdefault(conn.key, deque())
        conn.idle_since = time.monotonic()
        q.append(conn)
        while len(q) > self.max_idle_per_host:
            q.popleft().close()

    async def _connect(self, key: tuple[str, int, bool], limit_s: float) -> _Connection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(limit_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(key), host, port, ssl=self._ssl if tls else None
                )
        except TimeoutError:
            reason = f"connecting to {host}:{port} timed out"
            raise UpstreamError("connect", reason, timeout=True) from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {host}:{port}: {exc}") from exc
        self.connects += 1
        return conn
