"""OpenAI-shaped error responses for every failure path, shared by the worker and the gateway.

:func:`install_error_handlers` turns our :class:`~engine_worker.protocol.ApiError`,
FastAPI's request validation errors and Starlette's HTTP errors (404, 405, ...)
into ``{"error": {"message", "type", "param", "code"}}`` bodies. :class:`ServerErrors`
answers what nothing handled (a bug) with the same shape. It lives
apart from the worker's server so that the gateway can install the same
handlers without importing the engine (and torch) behind that server.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_worker.protocol import ApiError

__all__ = ["ServerErrors", "api_error_response", "error_response", "install_error_handlers"]

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "NotFoundError",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


#: Pydantic's names for the members of a union in an error's location (``str``,
#: ``list[int]``, ``function-after[_unicode(), str]``): which member failed, not where.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|[\w-]+\[.*\])$")


def api_error_response(exc: ApiError) -> JSONResponse:
    """The response of a raised :class:`ApiError` (its status, body and headers)."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def error_response(status: int, message: str, **kw: Any) -> JSONResponse:
    """An OpenAI error response whose ``type`` follows from the HTTP status.

    Args:
        status: HTTP status code.
        message: Human-readable message.
        **kw: ``param`` and ``code`` of the error body (see :class:`ApiError`).
    """
    err = ApiError(status, message, type_=_STATUS_TYPES.get(status, "server_error"), **kw)
    return JSONResponse(err.body(), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for every failure path (shared by the worker and the gateway)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors: list[dict[str, Any]] = list(exc.errors())
        # Where every member of a union failed, pydantic lists each member's error: the
        # one our own validators raised (a value error) says what is wrong, else the one
        # of the member that got furthest in (an image part: `content.0.type` should be
        # 'text'), not that the value is not a string.
        ours = [e for e in errors if e.get("type") == "value_error"]
        first = max(ours or errors, key=lambda e: len(e.get("loc", ())), default={})
        loc = [
            str(x) for x in first.get("loc", ()) if x != "body" and not _UNION_MEMBER.match(str(x))
        ]
        if first.get("type") == "json_invalid":
            return error_response(400, "The request body is not valid JSON.")
        msg = first.get("msg", "invalid request")
        where = ".".join(loc)
        return error_response(400, f"{where}: {msg}" if where else msg, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class ServerErrors:
    """Answer an exception no handler took (a bug) with an OpenAI-shaped 500, and keep
    the connection.

    Starlette's own last resort sends a plain-text 500 and re-raises, and uvicorn then
    closes the connection: a pooled client's next request on it (httpx, the ``openai``
    SDK) fails with a reset it cannot safely retry. This logs the exception and sends
    ``{"error": {"type": "server_error", ...}}`` instead. Once a response has started
    nothing more can be said in it, and the exception goes on (the server closes the
    connection: the only signal left). Add it outside every other middleware that can
    raise.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            message = f"internal error ({type(exc).__name__}); see the server log"
            await error_response(500, message)(scope, receive, send)
