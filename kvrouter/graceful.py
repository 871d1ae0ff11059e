"""Serving an app with uvicorn so that SIGTERM drains instead of cutting.

On the first SIGTERM or SIGINT the app's drain hook runs first
(``app.state.drain``, an async callable its lifespan installs: a worker
withdraws its heartbeat and refuses new requests with 503, a gateway turns
``/ready`` false). Then uvicorn stops accepting connections and lets the
requests in flight, streams included, finish for up to ``drain_s`` seconds
before it cancels them and runs the lifespan's shutdown. A second signal
skips the wait; a third forces the exit.

An app whose process can no longer do its job (a worker whose engine loop died)
calls ``app.state.fail(reason)``, which the server installs: the server shuts
down as on a signal (the app's drain hook, then the requests in flight) and
:func:`serve` exits the process with status 1, so whatever runs it (``kvrouter
up``, Kubernetes, systemd) restarts it. vLLM's API server does the same when its
engine core dies (its launcher's watchdog, unless
``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set).

Idle keep-alive connections stay open for ``keep_alive_s`` (75 s by default, nginx's
default), not uvicorn's 5 s. Pooled HTTP clients (httpx, and so the ``openai`` SDK,
keep idle connections 5 s too) reuse a connection just as a 5 s server closes it, and
the request fails with a reset the client cannot safely retry; a server that keeps its
connections longer than its clients do never closes one under them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette

__all__ = ["DEFAULT_KEEP_ALIVE_S", "FAILED_EXIT_CODE", "DrainingServer", "serve"]

log = logging.getLogger(__name__)

#: Seconds an idle keep-alive connection stays open: nginx's default, above the 5 s that
#: pooled clients (httpx, the ``openai`` SDK) keep theirs and the 60 s of common load
#: balancers, so the client side always closes first.
DEFAULT_KEEP_ALIVE_S = 75.0

#: The process's exit status after the app called ``app.state.fail``.
FAILED_EXIT_CODE = 1


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the app first.

    It installs ``app.state.fail``: the app calls it (on the server's event loop) when
    it can no longer serve, and the server then stops as on a first signal, with
    :attr:`failure` set to the reason.
    """

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None
        #: Why the app asked the server to stop (None: it did not).
        self.failure: str | None = None
        app.state.fail = self.fail

    def fail(self, reason: str) -> None:
        """Stop serving because the app cannot go on (call it on the server's loop)."""
        if self.failure is None:
            self.failure = reason
            log.critical("stopping: %s", reason)
        if not self._draining:
            self._draining = True
            self._start_drain()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Run until told to exit (remembers its loop for the signal handler)."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain, then exit; later ones: uvicorn's (exit now, then force)."""
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.info("signal %d: draining before shutdown", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        hook: Callable[[], Awaitable[None]] | None = getattr(self.app.state, "drain", None)
        try:
            if hook is not None:
                await hook()
        except Exception:
            log.exception("the drain hook failed; shutting down anyway")
        finally:
            self.should_exit = True


def serve(
    app: Starlette,
    *,
    host: str,
    port: int,
    drain_s: float,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
) -> None:
    """Serve ``app`` until a signal, draining in-flight requests for up to ``drain_s``;
    idle keep-alive connections are closed after ``keep_alive_s``.

    Raises:
        SystemExit: with :data:`FAILED_EXIT_CODE` when the app called ``app.state.fail``.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False,
        timeout_graceful_shutdown=max(1, round(drain_s)),
        timeout_keep_alive=max(1, round(keep_alive_s)),
    )  # fmt: skip
    server = DrainingServer(config, app)
    server.run()
    if server.failure is not None:
        raise SystemExit(FAILED_EXIT_CODE)
