"""Stopping background tasks reliably.

Every long-lived process here runs loops that talk to Redis and carry on
when it fails (heartbeats, discovery, load sharing, publishing, ingestion).
Cancelling such a loop once is not enough: a cancellation can be replaced
by another exception raised while a library cleans up -- redis-py's
pipeline reset on a connection the server has just closed raises
``ConnectionError`` over the ``CancelledError`` -- and the loop, which
handles that error and goes on, then never ends. A gateway stopping while
Redis went away hung in its shutdown that way, forever.

:func:`cancel_and_wait` repeats the cancellation until the tasks are done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float = 10.0, every_s: float = 0.05
) -> None:
    """Cancel ``tasks`` and wait until every one is done, cancelling again each ``every_s``.

    Returns after ``timeout_s`` at the latest, logging the tasks still running. Their
    results and exceptions are consumed (nothing is logged as never retrieved).
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error("tasks still running %.0f s after their cancellation: %s", timeout_s,
                      sorted(t.get_name() for t in pending))  # fmt: skip
            break
        _, pending = await asyncio.wait(pending, timeout=min(every_s, remaining))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
