"""A streaming response whose cleanup runs however it ends (shared by the worker and
the gateway).

Starlette does not iterate the body of a response whose client left before it
started, and an async generator that never started never runs its ``finally``: a
request's cleanup (aborting it on the engine, releasing the router's counts) must
not live only there, or it waits for the garbage collector.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["ClosingStreamingResponse", "disconnected"]


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that awaits ``on_close`` once, however it ends: streamed
    out, failed, or its client gone before or while it streamed (its body then never
    iterated, or closed)."""

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's own __call__ (ASGI spec < 2.4, as uvicorn's) watches for the client
        # leaving in an anyio task group; two plain tasks do the same for less.
        try:
            relay = asyncio.ensure_future(self.stream_response(send))
            gone = asyncio.ensure_future(disconnected(receive))
            try:
                await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                relay.cancel()
                gone.cancel()
                await asyncio.gather(relay, gone, return_exceptions=True)
            if not relay.cancelled() and (exc := relay.exception()) is not None:
                raise exc
        finally:
            await self._on_close()
