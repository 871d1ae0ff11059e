"""OpenAI-shaped error responses for every failure path, shared by the worker and the gateway.

:func:`install_error_handlers` turns our :class:`~engine_worker.protocol.ApiError`,
FastAPI's request validation errors and Starlette's HTTP errors (404, 405, ...)
into ``{"error": {"message", "type", "param", "code"}}`` bodies. It lives
apart from the worker's server so that the gateway can install the same
handlers without importing the engine (and torch) behind that server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_worker.protocol import ApiError

__all__ = ["api_error_response", "error_response", "install_error_handlers"]

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "NotFoundError",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable",
}


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
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "The request body is not valid JSON.")
        msg = first.get("msg", "invalid request")
        where = ".".join(loc)
        return error_response(400, f"{where}: {msg}" if where else msg, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))
