"""One JSON log formatter, configured once at each entry point.

Every record carries ``component`` (worker, indexer, gateway) and, when
set through :data:`request_id_var` / :data:`worker_var`, the request id and
worker it concerns.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "request_id_var", "worker_var"]

#: The request being handled (set by the gateway per request).
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "request_id", default=None
)
#: The worker a record concerns (set by the gateway while dispatching).
worker_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("worker", default=None)


class JsonFormatter(logging.Formatter):
    """Formats records as one JSON object per line."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        """The record as JSON."""
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            out["request_id"] = rid
        worker = getattr(record, "worker", None) or worker_var.get()
        if worker:
            out["worker"] = worker
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(component: str, level: str = "info") -> None:
    """Route every logger to stderr through :class:`JsonFormatter`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
