"""The streaming response whose cleanup runs however it ends (worker and gateway)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from engine_worker.http_stream import ClosingStreamingResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST"}


async def _run(*, client_leaves: bool) -> tuple[list[str], list[MutableMapping[str, Any]], int]:
    """Serve one response: (what its body generator did, what was sent, on_close calls)."""
    events: list[str] = []
    sent: list[MutableMapping[str, Any]] = []
    closed = 0

    async def body() -> AsyncIterator[bytes]:
        events.append("started")
        try:
            for chunk in (b"a", b"b"):
                yield chunk
        finally:
            events.append("finally")

    async def on_close() -> None:
        nonlocal closed
        closed += 1

    async def receive() -> MutableMapping[str, Any]:
        if client_leaves:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if client_leaves:
            await asyncio.sleep(0.05)  # the headers are slow to go out: the client has left

    response = ClosingStreamingResponse(body(), on_close=on_close, media_type="text/plain")
    await response(SCOPE, receive, send)
    return events, sent, closed


def test_a_client_gone_before_the_body_starts_still_closes_the_response() -> None:
    # The worker's request keeps running on the engine and the gateway's counts stay
    # raised unless on_close runs: the body generator never started, so its own
    # ``finally`` never will.
    events, sent, closed = asyncio.run(_run(client_leaves=True))
    assert events == []
    assert [m["type"] for m in sent] == ["http.response.start"]
    assert closed == 1


def test_a_response_streamed_out_closes_once_after_its_body() -> None:
    events, sent, closed = asyncio.run(_run(client_leaves=False))
    assert events == ["started", "finally"]
    assert b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body") == b"ab"
    assert closed == 1
