"""The gateway's HTTP/1.1 client to its workers, against real servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvrouter.embedded_redis import free_port
from kvrouter.gateway.upstream import HttpPool, Timeouts, UpstreamError
from tests.support.servers import serve_app

JSON = {"content-type": "application/json"}


class Seen:
    """What the test server saw: request bodies, and streams whose client left."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.left = threading.Event()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Seen]]:
    seen = Seen()

    async def echo(request: Request) -> Response:
        body = await request.body()
        seen.bodies.append(body)
        return JSONResponse({"size": len(body), "head": body[:16].decode(errors="replace")})

    async def sse(request: Request) -> Response:
        n = int(request.query_params.get("n", "5"))
        delay = float(request.query_params.get("delay", "0"))
        await request.body()

        async def events() -> AsyncIterator[bytes]:
            done = False
            try:
                for i in range(n):
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                    await asyncio.sleep(delay)
                yield b"data: [DONE]\n\n"
                done = True
            finally:
                if not done:
                    seen.left.set()  # stopped because the client left

        return StreamingResponse(events(), media_type="text/event-stream")

    async def slow(request: Request) -> Response:
        await asyncio.sleep(float(request.query_params.get("s", "2")))
        return JSONResponse({})

    async def big(request: Request) -> Response:
        return Response(bytes(range(256)) * (3 << 12), media_type="application/octet-stream")

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]),
                            Route("/sse", sse, methods=["POST"]),
                            Route("/slow", slow, methods=["POST"]),
                            Route("/big", big, methods=["POST"])])  # fmt: skip
    with serve_app(app) as base:
        yield base, seen


async def test_connections_are_kept_alive_across_json_and_streamed_answers(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    pool = HttpPool()
    try:
        r = await pool.post(f"{base}/echo", b'{"a": 1}', JSON, Timeouts())
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert json.loads(await r.aread()) == {"size": 8, "head": '{"a": 1}'}
        for _ in range(3):
            r = await pool.post(f"{base}/sse?n=4", b"{}", JSON, Timeouts())
            assert r.headers["transfer-encoding"] == "chunked"
            body = await r.aread()  # de-chunked: exactly the events the server wrote
            events = [e for e in body.split(b"\n\n") if e]
            assert events[:4] == [f"data: {json.dumps({'i': i})}".encode() for i in range(4)]
            assert events[4:] == [b"data: [DONE]"]
        # One upload big enough to be written in pieces, its bytes intact.
        payload = b"x" * (3 << 20)
        r = await pool.post(f"{base}/echo", payload, JSON, Timeouts())
        assert json.loads(await r.aread())["size"] == len(payload)
        assert seen.bodies[-1] == payload
        # A response larger than the read-pause threshold arrives whole, in order.
        r = await pool.post(f"{base}/big", b"", JSON, Timeouts())
        assert await r.aread() == bytes(range(256)) * (3 << 12)
        assert pool.connects == 1
        assert pool.idle() == 1
    finally:
        await pool.aclose()
    assert pool.idle() == 0


async def test_closing_an_unfinished_stream_closes_its_connection(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.left.clear()
    pool = HttpPool()
    try:
        r = await pool.post(f"{base}/sse?n=200&delay=0.01", b"{}", JSON, Timeouts())
        first = await r.next_chunk()
        assert first is not None
        assert first.startswith(b"data: ")
        await r.aclose()  # the client left: the worker must see it and stop
        assert await asyncio.to_thread(seen.left.wait, 5)
        assert pool.idle() == 0
        r = await pool.post(f"{base}/echo", b"{}", JSON, Timeouts())
        await r.aread()
        assert pool.connects == 2  # a fresh connection, never the aborted one
    finally:
        await pool.aclose()


async def test_idle_connections_expire_before_the_workers_keep_alive(
    server: tuple[str, Seen],
) -> None:
    base, _ = server
    pool = HttpPool(idle_s=0.05)
    try:
        for _ in range(2):
            r = await pool.post(f"{base}/echo", b"{}", JSON, Timeouts())
            await r.aread()
            await asyncio.sleep(0.1)
        assert pool.connects == 2
    finally:
        await pool.aclose()


async def test_errors_say_where_they_happened(server: tuple[str, Seen]) -> None:
    base, _ = server
    pool = HttpPool()
    try:
        with pytest.raises(UpstreamError) as refused:
            await pool.post(f"http://127.0.0.1:{free_port()}/echo", b"{}", JSON, Timeouts())
        assert refused.value.stage == "connect"
        assert not refused.value.timeout
        with pytest.raises(UpstreamError) as slow:
            await pool.post(f"{base}/slow?s=2", b"{}", JSON, Timeouts(read=0.2))
        assert slow.value.stage == "read"
        assert slow.value.timeout
        with pytest.raises(UpstreamError) as bad:
            await pool.post("ftp://127.0.0.1/x", b"", JSON, Timeouts())
        assert bad.value.stage == "connect"
        # A timed-out connection is never reused.
        assert pool.idle() == 0
    finally:
        await pool.aclose()


@contextlib.asynccontextmanager
async def raw_server(
    reply: bytes, *, close_after_s: float | None = None, gone_on_reuse: bool = False
) -> AsyncIterator[tuple[str, HttpPool]]:
    """A TCP server answering each connection's first request (a ``{}`` body) with
    ``reply`` bytes, and a pool to talk to it.

    Then it closes the connection ``close_after_s`` later; or, without it, on the
    connection's next request, unanswered (a worker closing an idle connection just as
    it is reused), and with ``gone_on_reuse`` it also stops accepting (a worker gone).
    """
    holder: list[asyncio.Server] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(reply)
        await writer.drain()
        if close_after_s is not None:
            await asyncio.sleep(close_after_s)
        else:
            with contextlib.suppress(asyncio.IncompleteReadError):
                await reader.readuntil(b"\r\n\r\n")
            if gone_on_reuse:
                holder[0].close()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    holder.append(srv)
    pool = HttpPool()
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", pool
    finally:
        await pool.aclose()
        srv.close()
        await srv.wait_closed()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


async def test_a_body_cut_short_is_an_error_not_a_short_answer() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"y" * 40
    async with raw_server(reply, close_after_s=0.05) as (base, pool):
        r = await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
        assert await r.next_chunk() == b"y" * 40
        with pytest.raises(UpstreamError) as cut:
            await r.next_chunk()
        assert cut.value.stage == "read"
        assert pool.idle() == 0


async def test_a_connection_the_worker_closed_while_idle_is_dropped() -> None:
    async with raw_server(OK, close_after_s=0.05) as (base, pool):
        r = await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
        assert await r.aread() == b"{}"
        assert pool.idle() == 1
        await asyncio.sleep(0.3)  # the server closed it meanwhile
        r = await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
        assert await r.aread() == b"{}"
        assert pool.connects == 2


async def test_a_kept_alive_connection_closed_as_it_is_reused_is_retried_once_on_a_new_one() -> (
    None
):
    async with raw_server(OK) as (base, pool):
        for _ in range(3):
            r = await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
            assert await r.aread() == b"{}"
        # Every reuse was closed unanswered and sent again on a new connection.
        assert pool.connects == 3


async def test_a_worker_gone_after_taking_the_request_keeps_the_read_error() -> None:
    async with raw_server(OK, gone_on_reuse=True) as (base, pool):
        r = await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
        assert await r.aread() == b"{}"
        with pytest.raises(UpstreamError) as lost:
            await pool.post(f"{base}/x", b"{}", JSON, Timeouts())
        # Not a connect error: the dispatcher must know the request may have been taken.
        assert lost.value.stage == "read"
