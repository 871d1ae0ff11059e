"""ASGI guards in front of the app, shared by the worker and the gateway.

:class:`BearerAuthMiddleware` checks a ``Bearer`` token before anything
else (no body is read or parsed for a client without one: 401, not 400 or
413). :class:`BodyLimitMiddleware` refuses bodies over a size limit with an
OpenAI-style 413: it reads the body (up to the limit) before the app sees
it, so an oversized upload is cut off early and never parsed; the buffered
body is then replayed to the app unchanged.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BearerAuthMiddleware", "BodyLimitMiddleware", "bearer_ok", "replay_body"]


class BodyLimitMiddleware:
    """Refuse HTTP bodies larger than ``max_bytes`` (413, OpenAI error JSON)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        await self.app(scope, replay_body(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send) -> None:
        await send_error(
            send, 413, f"request body over {self.max_bytes} bytes", "invalid_request_error",
            "body_too_large", close=True,
        )  # fmt: skip


def replay_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the request body, already read, handed out once more first."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def bearer_ok(authorization: str, tokens: Sequence[bytes]) -> bool:
    """Whether an ``Authorization`` header carries one of ``tokens`` (constant-time compare)."""
    scheme, _, given = authorization.partition(" ")
    value = given.strip().encode()
    if scheme.lower() != "bearer" or not value:
        return False
    return any(hmac.compare_digest(value, t) for t in tokens)


class BearerAuthMiddleware:
    """Refuse HTTP requests without a valid ``Bearer`` token (401) before reading their body.

    ``protected(path)`` says which paths need a token; ``on_failure`` runs on each
    refusal (a metric). Without tokens every request passes.
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: Sequence[bytes],
        protected: Callable[[str], bool],
        *,
        message: str = "Incorrect or missing API key.",
        type_: str = "invalid_request_error",
        code: str = "invalid_api_key",
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.tokens = [t for t in tokens if t]
        self.protected = protected
        self.message = message
        self.type = type_
        self.code = code
        self.on_failure = on_failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or not self.protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        auth = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                auth = value
                break
        if bearer_ok(auth.decode("latin-1"), self.tokens):
            await self.app(scope, receive, send)
            return
        if self.on_failure is not None:
            self.on_failure()
        await send_error(
            send, 401, self.message, self.type, self.code,
            extra=[(b"www-authenticate", b"Bearer")],
        )  # fmt: skip


async def send_error(
    send: Send,
    status: int,
    message: str,
    type_: str,
    code: str,
    *,
    close: bool = False,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer with an OpenAI-style error body straight from ASGI."""
    payload: dict[str, Any] = {
        "error": {"message": message, "type": type_, "param": None, "code": code}
    }
    data = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *extra,
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
