"""Sending a routed request to a worker, with retries before the first byte.

Candidates come best first (``Decision.ranked()``). Only an attempt that
provably did not start moves on to the next candidate (at most
``max_attempts``): the connection failed or the request could not be sent,
or the worker answered 503 (draining, or its engine is down). A worker that
refused the connection is benched until it heartbeats again.

A streaming request is also retried when the worker fails after taking it
but before its first byte (a read error or timeout, another 5xx): nothing
reached the client, and closing the connection aborts the first attempt on
its worker, so the client still gets exactly one answer. So is a
non-streaming request on a worker that marks its first token (below; learnt
from its last non-streaming answer). Any other non-streaming request is not:
a worker that failed while generating it answers 502 (504 on a timeout), so
a request is never generated twice. A worker's 4xx is the client's problem
and is passed through as is, like such a non-streaming 5xx.
Once the first byte reached the client the stream is committed: a failure
after it ends the stream with an OpenAI-style error event and
``data: [DONE]``.

Every attempt holds a :class:`~kvrouter.gateway.load.Ticket` on its worker,
released exactly once whatever happens (success, error, client gone). Its
first byte moves the request's count from queued prefill to decoding. A
non-streaming request asks its worker to mark that moment too
(``MARK_FIRST_TOKEN_HEADER``: a space at the first token, then the JSON body);
a worker that does not gives its first byte with the whole body.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from engine_worker.protocol import FIRST_TOKEN_HEADER, MARK_FIRST_TOKEN_HEADER, ApiError, error_body
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import Load, LoadTracker, Ticket
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.upstream import HttpPool, Timeouts, UpstreamError, UpstreamResponse

__all__ = ["Dispatcher", "Upstream"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Upstream:
    """An open response from the worker that took the request."""

    worker: str
    status: int
    headers: Mapping[str, str]
    first: bytes
    rest: AsyncIterator[bytes] | None
    response: UpstreamResponse | None
    ticket: Ticket
    #: When the first byte came: the first token for a stream and for a non-streaming
    #: answer whose worker marked it (``first_token``), the whole body's end otherwise.
    first_byte_at: float
    #: ``first_byte_at`` marks the first token.
    first_token: bool = True

    async def close(self) -> None:
        """Release the load ticket, then the connection (idempotent; never raises)."""
        self.ticket.end()
        response, self.response = self.response, None
        if response is not None:
            await response.aclose()


class Dispatcher:
    """Opens upstream responses with bounded retries."""

    def __init__(
        self,
        pool: HttpPool,
        directory: WorkerDirectory,
        load: LoadTracker,
        metrics: RouterMetrics,
        *,
        max_attempts: int = 3,
        connect_timeout_s: float = 2.0,
        first_byte_timeout_s: float = 300.0,
        internal_token: str | None = None,
    ) -> None:
        self.pool = pool
        self.directory = directory
        self.load = load
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.timeouts = Timeouts(connect=connect_timeout_s, write=30.0, read=first_byte_timeout_s)
        self.internal_token = internal_token
        #: Per worker, whether its last non-streaming answer marked its first token (asked
        #: to): where it does, a request that fails before its first byte generated
        #: nothing yet, so it is retried. A worker not in here is taken at its view's word
        #: (``marks_first_token``).
        self.marking: dict[str, bool] = {}

    async def open(
        self,
        candidates: list[str],
        path: str,
        body: bytes,
        request_id: str,
        prefill_tokens: dict[str, int],
        *,
        whole: bool,
        keys: Sequence[int] = (),
        prompt_tokens: int = 0,
        admission: Mapping[str, Load] | None = None,
    ) -> Upstream:
        """Send ``body`` to the first candidate that answers; ``whole`` reads the full body.

        ``prefill_tokens`` is what each candidate would still prefill, of a prompt of
        ``prompt_tokens``, and ``admission`` the cached blocks it would take from its
        free HBM pool and load from DRAM and SSD; ``keys`` the prompt's block keys,
        which the worker holds in HBM from the first byte to the end.

        Raises:
            ApiError: 503 when every attempt failed before the first byte.
        """
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if whole:
            headers[MARK_FIRST_TOKEN_HEADER] = "1"
        if self.internal_token:
            headers["authorization"] = f"Bearer {self.internal_token}"
        last_reason = "no candidate"
        for worker in candidates[: self.max_attempts]:
            view = self.directory.views.get(worker)
            if view is None or worker in self.directory.benched:
                continue
            ticket = self.load.begin(
                worker, prefill_tokens.get(worker, 0), keys, prompt_tokens,
                admission.get(worker) if admission else None,
            )  # fmt: skip
            try:
                marks = self.marking.get(worker, view.marks_first_token)
                up = await self._attempt(
                    worker, view.url + path, body, headers, ticket, whole, marks
                )
            except _RetryableError as exc:
                ticket.end()
                last_reason = f"{worker}: {exc.reason}"
                self.metrics.retries.labels(exc.kind).inc()
                log.warning("dispatch to %s failed before the first byte: %s", worker, exc.reason)
                if exc.kind == "connect":
                    self.directory.bench(worker)
                continue
            except BaseException:
                ticket.end()
                raise
            return up
        raise ApiError(
            503,
            f"no worker could take the request ({last_reason})",
            type_="service_unavailable",
            code="workers_unavailable",
        )

    async def _attempt(
        self, worker: str, url: str, body: bytes, headers: dict[str, str], ticket: Ticket,
        whole: bool, marks: bool,
    ) -> Upstream:  # fmt: skip
        # Whether a failure before the first byte may have generated the answer already:
        # a worker that does not mark a non-streaming answer's first token (``marks``)
        # sends its first byte with the whole body.
        unmarked = whole and not marks
        try:
            resp = await self.pool.post(url, body, headers, self.timeouts)
        except UpstreamError as exc:
            if exc.stage == "read":
                _started(exc, unmarked)
            raise _RetryableError(_KINDS[exc.stage], str(exc)) from exc
        try:
            if resp.status_code == 503 or (resp.status_code >= 500 and not unmarked):
                text = (await resp.aread())[:200].decode(errors="replace")
                raise _RetryableError("5xx", f"HTTP {resp.status_code}: {text}")
            if whole and resp.status_code == 200:
                if resp.headers.get(FIRST_TOKEN_HEADER):
                    self.marking[worker] = True
                    return await _read_marked(worker, resp, ticket)
                self.marking[worker] = False
            if whole or resp.status_code >= 400:
                data = await resp.aread()
                ticket.first_byte()
                await resp.aclose()
                return Upstream(worker, resp.status_code, resp.headers, data, None, None, ticket,
                                time.perf_counter(), first_token=False)  # fmt: skip
            chunks = resp.aiter_bytes()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            ticket.first_byte()
            return Upstream(worker, resp.status_code, resp.headers, first, chunks, resp, ticket,
                            time.perf_counter())  # fmt: skip
        except _RetryableError:
            await resp.aclose()
            raise
        except UpstreamError as exc:
            await resp.aclose()
            _started(exc, whole)
            raise _RetryableError("transport", str(exc)) from exc
        except BaseException:
            await resp.aclose()
            raise


async def _read_marked(worker: str, resp: UpstreamResponse, ticket: Ticket) -> Upstream:
    """A non-streaming answer whose first byte (a space) came at its first token
    (``MARK_FIRST_TOKEN_HEADER``): the prompt is prefilled from then on, so the load
    counts it as decoding, not queued, for the rest of its generation."""
    chunks = resp.aiter_bytes()
    first = await anext(chunks, b"")
    first_at = time.perf_counter()
    ticket.first_byte()
    data = (first + b"".join([chunk async for chunk in chunks])).lstrip()
    await resp.aclose()
    return Upstream(worker, 200, resp.headers, data, None, None, ticket, first_at)


#: The dispatcher's retry kinds (metrics label) by where the request failed.
_KINDS = {"connect": "connect", "send": "send", "read": "transport"}


def _started(exc: UpstreamError, generated: bool) -> None:
    """A non-streaming request failed after its worker took it: where the worker may have
    generated the answer (``generated``), answer, never retry."""
    if not generated:
        return
    timeout = exc.timeout
    raise ApiError(
        504 if timeout else 502,
        f"the worker failed while generating the answer ({exc}); "
        "it was not retried, so that it is never generated twice",
        type_="server_error",
        code="upstream_timeout" if timeout else "upstream_failed",
    ) from exc


class _RetryableError(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def stream_error_event(message: str) -> bytes:
    """The SSE events that end a broken stream cleanly."""
    payload = error_body(message, type_="server_error", code="upstream_failed")
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()
