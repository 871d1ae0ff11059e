"""The KV data path: block transfers over a plain TCP socket, beside the HTTP API.

Python HTTP stacks move large bodies at a fraction of what a socket does
(uvicorn + httpx: ~0.4 GB/s on loopback against ~2 GB/s for a socket copy on
the same machine), so blocks travel over a dedicated listener, as NIXL and
Mooncake's transfer engine keep a data plane apart from the control plane.
One request per connection::

    client -> b"KVQ1" | u32 length | msgpack {"token", "keys", "release"}
    server -> the transfer (:mod:`engine_worker.kv_transfer`: b"KVX1" header + blocks)
           or b"KVE1" | u32 length | msgpack {"reason", "message"}; then it closes.

The request and the refusal go over the event loop; the transfer itself is
moved by one blocking thread per end (the server sends the header, then every
block from where it is pinned, the KV tensors themselves for host memory, reading
each SSD block just before it goes; the client receives each block into the pool
block reserved for it and checks it as it lands), so the bytes are copied only
by the kernel, as in a raw socket copy, without an event-loop round per
``send``/``recv``. The loop keeps the deadline: when it passes, or the task is
cancelled, the socket is shut down, which ends the thread's blocking call, and
the blocks are released only once the thread is done with them.

The request is bounded (1 MiB, 10 s to arrive), the internal token compared
in constant time, the keys capped like ``POST /kv/blocks``. A worker's data
port is found once per source through ``GET /kv/endpoint`` (internal token).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from engine_worker.kv_transfer import (
    MAX_HEADER_BYTES,
    MAX_TRANSFER_BLOCKS,
    Expected,
    Landing,
    Outgoing,
    SocketReader,
    TransferError,
    TransferHeader,
    check_block,
    encode_transfer,
    fresh_views,
    in_thread,
    read_header,
)
from indexer.tasks import cancel_and_wait

__all__ = ["TRANSFER_THREADS", "KvSocketServer", "fetch_blocks"]

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">4sI")
_REQUEST = b"KVQ1"
_ERROR = b"KVE1"
_REQUEST_TIMEOUT_S = 10.0
_U64_MAX = 2**64 - 1
#: Socket buffers of a transfer (the kernel may cap them): fewer wake-ups per block.
_SOCKET_BUFFER = 8 << 20
#: Threads moving blocks at once, per server and per client (more transfers queue).
TRANSFER_THREADS = 16


class TransferRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a puller asks for."""

    token: str | None = None
    keys: list[int]
    release: str | None = None


class TransferRefusal(msgspec.Struct, kw_only=True):
    """Why a server refused."""

    reason: str
    message: str


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(TransferRequest)
_refusal_decoder = msgspec.msgpack.Decoder(TransferRefusal)

#: Serves a request: the blocks to send (released by the server once sent).
Export = Callable[[Sequence[int], str | None], Awaitable[Outgoing]]


def _frame(tag: bytes, body: bytes) -> bytes:
    return _FRAME.pack(tag, len(body)) + body


class KvSocketServer:
    """Serves transfers on ``host:port`` (0: any free port) from ``export``.

    Each block goes from the source's memory to the kernel in one blocking
    ``sendall``, on a sender thread, as in a raw socket copy. A receiver that takes
    longer than ``send_timeout_s`` to take a transfer is cut off (its blocks stay
    pinned until then).
    """

    def __init__(
        self,
        export: Export,
        token: str | None,
        host: str,
        port: int = 0,
        *,
        send_timeout_s: float = 60.0,
    ) -> None:
        self._export = export
        self._send_timeout_s = send_timeout_s
        self._token = token
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._senders: ThreadPoolExecutor | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._listener is None:
            raise RuntimeError("the KV data socket is not listening")
        port: int = self._listener.getsockname()[1]
        return port

    async def start(self) -> None:
        """Listen."""
        listener = socket.create_server((self._host, self._port), reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self._senders = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="kv-send")
        self._accepting = asyncio.create_task(self._accept(listener))

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        await cancel_and_wait(tasks)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._senders is not None:
            self._senders.shutdown(wait=False)
            self._senders = None

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                log.warning("KV data socket: accept failed: %r", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            task = asyncio.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                request = await asyncio.wait_for(self._request(conn), _REQUEST_TIMEOUT_S)
                out = await self._export(request.keys, request.release)
            except TransferError as exc:
                refusal = TransferRefusal(reason=exc.reason, message=str(exc))
                await loop.sock_sendall(conn, _frame(_ERROR, _encoder.encode(refusal)))
                await _linger(conn)
                return
            try:
                limit = self._send_timeout_s
                send = functools.partial(_send, conn, out, limit)
                await in_thread(send, self._senders, limit, _shut(conn))
            finally:
                out.close()
        except (TimeoutError, OSError) as exc:
            log.info("KV data connection dropped: %r", exc)
        except Exception as exc:  # e.g. a read off the SSD failed mid-stream
            log.warning("KV transfer to a peer failed, the stream cut short: %r", exc)
        finally:
            conn.close()

    async def _request(self, conn: socket.socket) -> TransferRequest:
        reader = SocketReader(conn)
        try:
            tag, length = _FRAME.unpack(await reader.read(_FRAME.size, "request"))
            if tag != _REQUEST or length > MAX_HEADER_BYTES:
                raise TransferError("request", "not a KV transfer request")
            request = _request_decoder.decode(await reader.read(length, "request"))
        except msgspec.MsgspecError as exc:
            raise TransferError("request", f"bad request: {exc}") from exc
        if self._token is not None and not hmac.compare_digest(
            (request.token or "").encode(), self._token.encode()
        ):
            raise TransferError("auth", "a valid internal token is required")
        if len(request.keys) > MAX_TRANSFER_BLOCKS or any(
            not 0 <= k <= _U64_MAX for k in request.keys
        ):
            raise TransferError("request", f"at most {MAX_TRANSFER_BLOCKS} u64 keys")
        return request


def _send(conn: socket.socket, out: Outgoing, timeout_s: float) -> None:
    """Send the transfer's header, then each block, reading the SSD blocks one by one as
    they go (blocking, each call within ``timeout_s``: the thread ends even if nobody
    shuts the socket down; on a sender thread). The kernel sends what is queued while the
    next block is read, so reads and the network overlap."""
    header = out.stream_header()
    conn.settimeout(timeout_s)
    conn.sendall(encode_transfer(header))
    for i in range(len(header.keys)):
        data = out.take(i)
        if len(data):
            conn.sendall(data)


def _receive(
    sock: socket.socket, header: TransferHeader, views: Sequence[memoryview], timeout_s: float
) -> None:
    """Receive the blocks of ``header`` into ``views``, each checked as it lands, then the
    end of the stream (blocking, each call within ``timeout_s``; on a receiver thread)."""
    sock.settimeout(timeout_s)
    recv_into = sock.recv_into
    for i in range(len(header.keys)):
        view = views[i]
        got, n = 0, len(view)
        while got < n:
            k = recv_into(view[got:])
            if k == 0:
                short = f"stream ended {n - got} bytes short in the block {i}"
                raise TransferError("truncated", short)
            got += k
        check_block(header, i, view)
    if sock.recv(1):
        raise TransferError("trailing", "bytes after the last block")


def _shut(sock: socket.socket) -> Callable[[], None]:
    def shut() -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    return shut


async def _linger(conn: socket.socket, limit: int = 1 << 20, timeout_s: float = 1.0) -> None:
    """Half-close and discard what the peer still sends (a little, briefly): closing a
    socket with unread bytes resets the connection, and the peer could lose our answer."""
    loop = asyncio.get_running_loop()
    conn.shutdown(socket.SHUT_WR)
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(timeout_s):
            while limit > 0 and (chunk := await loop.sock_recv(conn, 65536)):
                limit -= len(chunk)


async def _address(host: str, port: int) -> tuple[int, int, int, Any]:
    """Family, type, protocol and address of ``host:port``; an IP address is taken as it
    is (no resolver thread: a pull is on a request's path)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, kind, proto, _, address = infos[0]
    return family, kind, proto, address


async def fetch_blocks(
    host: str,
    port: int,
    token: str | None,
    keys: Sequence[int],
    release: str | None,
    expected: Expected,
    timeout_s: float,
    land: Landing | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> tuple[TransferHeader, Sequence[memoryview], int]:
    """Pull ``keys`` from the data port at ``host:port``; validated as
    :func:`~engine_worker.kv_transfer.read_transfer` (blocks received where ``land``
    says, by default into fresh buffers, by a thread of ``executor``).

    Returns the header, the blocks and the bytes received.

    Raises:
        TransferError: Refused (the server's reason), unreachable (``http``), or invalid.
    """
    loop = asyncio.get_running_loop()
    try:
        family, kind, proto, address = await _address(host, port)
        sock = socket.socket(family, kind, proto)
    except (OSError, IndexError) as exc:
        raise TransferError("http", f"{host}:{port}: {exc!r}") from exc
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(sock, address)
            request = TransferRequest(token=token, keys=list(keys), release=release)
            await loop.sock_sendall(sock, _frame(_REQUEST, _encoder.encode(request)))
            reader = SocketReader(sock)
            head = await reader.read(_FRAME.size, "prefix")
            tag, length = _FRAME.unpack(head)
            if tag == _ERROR:
                body = await reader.read(min(length, 1 << 16), "refusal")
                refusal = _refusal_decoder.decode(body)
                raise TransferError(refusal.reason, refusal.message)
            reader.push_back(head)
            header = await read_header(reader, expected)
            views = await land(header) if land is not None else fresh_views(header)
            receive = functools.partial(_receive, sock, header, views, timeout_s)
            await in_thread(receive, executor, abort=_shut(sock))
        return header, views, _FRAME.size + length + header.block_bytes * len(header.keys)
    except (OSError, TimeoutError) as exc:
        raise TransferError("http", f"{host}:{port}: {exc!r}") from exc
    finally:
        sock.close()
