"""The KV data path: block transfers over a plain TCP socket, beside the HTTP API.

Python HTTP stacks move large bodies at a fraction of what a socket does
(uvicorn + httpx: ~0.4 GB/s on loopback against ~2 GB/s for a socket copy on
the same machine), so blocks travel over a dedicated listener, as NIXL and
Mooncake's transfer engine keep a data plane apart from the control plane.
One request per connection::

    client -> b"KVQ1" | u32 length | msgpack {"token", "keys", "release"}
    server -> the transfer (:mod:`engine_worker.kv_transfer`: b"KVX1" header + blocks)
           or b"KVE1" | u32 length | msgpack {"reason", "message"}; then it closes.

The request is bounded (1 MiB, 10 s to arrive), the internal token compared
in constant time, the keys capped like ``POST /kv/blocks``. A worker's data
port is found once per source through ``GET /kv/endpoint`` (internal token).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from engine_worker.kv_transfer import (
    MAX_HEADER_BYTES,
    MAX_TRANSFER_BLOCKS,
    Expected,
    TransferError,
    TransferHeader,
    encode_transfer,
    read_transfer,
)

__all__ = ["KvSocketServer", "fetch_blocks"]

log = logging.getLogger(__name__)

_FRAME = struct.Struct(">4sI")
_REQUEST = b"KVQ1"
_ERROR = b"KVE1"
_REQUEST_TIMEOUT_S = 10.0
_U64_MAX = 2**64 - 1


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

Export = Callable[[Sequence[int], str | None], Awaitable[tuple[TransferHeader, list[bytes]]]]


def _frame(tag: bytes, body: bytes) -> bytes:
    return _FRAME.pack(tag, len(body)) + body


class KvSocketServer:
    """Serves transfers on ``host:port`` (0: any free port) from ``export``."""

    def __init__(self, export: Export, token: str | None, host: str, port: int = 0) -> None:
        self._export = export
        self._token = token
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the KV data socket is not listening")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        """Listen."""
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await asyncio.wait_for(self._request(reader), _REQUEST_TIMEOUT_S)
            except TransferError as exc:
                writer.write(_frame(_ERROR, _encoder.encode(TransferRefusal(
                    reason=exc.reason, message=str(exc)))))  # fmt: skip
                await writer.drain()
                return
            header, blocks = await self._export(request.keys, request.release)
            writer.write(encode_transfer(header))
            for block in blocks:
                writer.write(block)
                await writer.drain()
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            log.info("KV data connection dropped: %r", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _request(self, reader: asyncio.StreamReader) -> TransferRequest:
        tag, length = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        if tag != _REQUEST or length > MAX_HEADER_BYTES:
            raise TransferError("request", "not a KV transfer request")
        try:
            request = _request_decoder.decode(await reader.readexactly(length))
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


async def fetch_blocks(
    host: str,
    port: int,
    token: str | None,
    keys: Sequence[int],
    release: str | None,
    expected: Expected,
    timeout_s: float,
) -> tuple[TransferHeader, list[bytes], int]:
    """Pull ``keys`` from the data port at ``host:port``; validated as :func:`read_transfer`.

    Returns the header, the blocks and the bytes received.

    Raises:
        TransferError: Refused (the server's reason), unreachable (``http``), or invalid.
    """
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 22), timeout_s
        )
    except (OSError, TimeoutError) as exc:
        raise TransferError("http", f"{host}:{port}: {exc!r}") from exc
    try:
        request = TransferRequest(token=token, keys=list(keys), release=release)
        writer.write(_frame(_REQUEST, _encoder.encode(request)))
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(_FRAME.size), timeout_s)
        tag, length = _FRAME.unpack(head)
        if tag == _ERROR:
            refusal = _refusal_decoder.decode(await reader.readexactly(min(length, 1 << 16)))
            raise TransferError(refusal.reason, refusal.message)
        header, blocks = await asyncio.wait_for(
            read_transfer(reader, expected, head=head), timeout_s
        )
        return header, blocks, _FRAME.size + length + header.block_bytes * len(blocks)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise TransferError("http", f"{host}:{port}: {exc!r}") from exc
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
