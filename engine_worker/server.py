"""The worker's HTTP server: OpenAI API, health, metrics and internal ``/kv`` endpoints.

``create_app(settings)`` builds the app; the lifespan loads the model,
starts the engine thread and (with Redis) the publisher and heartbeat, and
stops them on shutdown. No module-level app, settings or singletons.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_worker.http_errors import ServerErrors, error_response, install_error_handlers
from engine_worker.http_limits import BearerAuthMiddleware, BodyLimitMiddleware
from engine_worker.http_stream import ClosingStreamingResponse
from engine_worker.kv_transfer import MAX_TRANSFER_BLOCKS, TransferError
from engine_worker.metrics import WorkerMetrics
from engine_worker.protocol import (
    CLIENT_CLOSED,
    FIRST_TOKEN_HEADER,
    MARK_FIRST_TOKEN_HEADER,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    now_s,
)
from engine_worker.serving import (
    ClientGone,
    Generation,
    Prepared,
    full_body,
    marked_body,
    prepare_chat,
    prepare_completion,
    to_first_token,
)
from engine_worker.serving import stream_body as _stream_body
from engine_worker.settings import WorkerSettings
from engine_worker.worker import Worker
from indexer.media import MEDIA

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def get_worker(request: Request) -> Worker:
    """The app's worker, or 503 when its engine is not running."""
    worker: Worker = request.state.worker
    if not worker.engine.alive:
        raise ApiError(503, "the engine is not running", type_="service_unavailable")
    return worker


WorkerDep = Annotated[Worker, Depends(get_worker)]


def get_serving_worker(request: Request) -> Worker:
    """The worker, or 503 while it drains for shutdown (a router retries elsewhere)."""
    worker = get_worker(request)
    if worker.draining:
        raise ApiError(
            503, "this worker is shutting down", type_="service_unavailable", code="draining"
        )
    return worker


ServingDep = Annotated[Worker, Depends(get_serving_worker)]


class _CountErrors:
    """Counts responses with a 4xx/5xx status (``kvworker_request_errors_total``)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.counter.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def create_app(settings: WorkerSettings, *, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the worker app. The model loads when the app starts (lifespan)."""
    metrics = WorkerMetrics(registry or CollectorRegistry())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        import asyncio

        worker = await asyncio.to_thread(Worker.build, settings, metrics)
        await worker.start()
        log.info(
            "worker %s serving %s on %s (runner=%s, block_size=%d, hbm=%d dram=%d ssd=%d)",
            worker.name, worker.model_name, settings.url, settings.runner,
            settings.block_size, settings.hbm_blocks, settings.dram_blocks, settings.ssd_blocks,
        )  # fmt: skip
        app.state.worker = worker
        app.state.drain = worker.drain
        # Served by kvrouter.graceful, a dead engine stops the process to be restarted.
        fail = getattr(app.state, "fail", None)
        if fail is not None and not settings.keep_alive_on_engine_death:
            worker.on_engine_death = fail
        try:
            yield {"worker": worker}
        finally:
            await worker.stop()

    app = FastAPI(title="kvrouter worker", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    # Outermost: with a token, nothing but /health (and /metrics unless asked) runs
    # without it, so the gateway's keys, limits and load accounting cannot be bypassed.
    open_paths = {"/health"} if settings.metrics_require_token else {"/health", "/metrics"}
    token = settings.internal_token
    app.add_middleware(
        BearerAuthMiddleware,
        tokens=[token.get_secret_value().encode()] if token is not None else [],
        protected=lambda path: path not in open_paths,
        message="a valid internal token is required",
        type_="authentication_error",
        code="invalid_internal_token",
    )
    app.add_middleware(ServerErrors)  # a bug anywhere inside: an OpenAI 500
    app.add_middleware(_CountErrors, counter=metrics.request_errors)  # outermost: sees all

    async def respond(gen: Generation, request: Request) -> Response:
        rid = {"X-Request-Id": gen.prep.request_id}
        try:
            # The request is running on the engine from here: a client gone before its
            # body starts must still abort it (on_close), not wait for the collector.
            if gen.prep.stream:
                deltas, close = await to_first_token(gen)
                return ClosingStreamingResponse(
                    _stream_body(gen, deltas, close),
                    on_close=close,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", **rid},
                )
            if request.headers.get(MARK_FIRST_TOKEN_HEADER):
                body, close = await marked_body(gen)
                return ClosingStreamingResponse(
                    body,
                    on_close=close,
                    media_type="application/json",
                    headers={FIRST_TOKEN_HEADER: "marked", **rid},
                )
            return JSONResponse(await full_body(gen), headers=rid)
        except ClientGone:
            # Aborted on the engine already; the status is for the access log only.
            return Response(status_code=CLIENT_CLOSED, headers=rid)

    @app.post("/v1/completions")
    async def completions(
        body: CompletionRequest, request: Request, worker: ServingDep
    ) -> Response:
        gen = Generation(worker, prepare_completion(worker, body), request.is_disconnected)
        return await respond(gen, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, worker: ServingDep) -> Response:
        gen = Generation(worker, prepare_chat(worker, body), request.is_disconnected)
        return await respond(gen, request)

    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest, worker: WorkerDep) -> list[Any]:
        """vLLM's render API: the request as token ids, nothing generated (routers that
        hash prompts the worker's way call it, e.g. ``vllm-router --policy kv_aware``)."""
        return [rendered(prepare_completion(worker, body))]

    @app.post("/v1/chat/completions/render")
    async def chat_render(body: ChatCompletionRequest, worker: WorkerDep) -> dict[str, Any]:
        """vLLM's render API for chat: the templated conversation as token ids."""
        return rendered(prepare_chat(worker, body))

    @app.get("/v1/models")
    async def models(worker: WorkerDep) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": worker.model_name,
                    "object": "model",
                    "created": int(worker.started_at),
                    "owned_by": "kvrouter",
                    "max_model_len": worker.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health(request: Request) -> Response:
        worker: Worker = request.state.worker
        if not worker.engine.alive:
            return error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok", "worker": worker.name, "time": now_s()})

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        request.state.worker.update_metrics()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/worker/view")
    async def view(worker: WorkerDep) -> Response:
        """The worker's view (what its heartbeat publishes), for static discovery."""
        return Response(msgspec.json.encode(worker.view()), media_type="application/json")

    @app.get("/kv/keys")
    async def kv_keys(worker: WorkerDep) -> Response:
        """Every cached key per medium, taken between two engine steps (for the audit)."""
        blocks = await worker.engine.acall(lambda s: s.pool.snapshot())
        payload = {
            "host": worker.name,
            "epoch": worker.epoch,
            "blocks": {m.value: keys for m, keys in blocks.items()},
        }
        return Response(json.dumps(payload), media_type="application/json")

    @app.get("/kv/stats")
    async def kv_stats(worker: WorkerDep) -> dict[str, Any]:
        """Pool counters and usage (tests and operators)."""

        def read(s: Any) -> dict[str, Any]:
            st = s.pool.stats()
            cap = s.pool.capacity()
            # Referenced blocks: a request's (HBM) or pinned for a transfer (any medium).
            held = {m: cap.of(m) - s.pool.num_free(m) for m in MEDIA}
            return {
                "in_use_blocks": sum(held.values()),
                "in_use_by_medium": {m.value: n for m, n in held.items()},
                "usage": {m.value: n for m, n in s.pool.usage().items()},
                "demotions": {m.value: n for m, n in st.demotions.items()},
                "promotions": {m.value: n for m, n in st.promotions.items()},
                "evictions": {m.value: n for m, n in st.evictions.items()},
                "running": s.num_running,
                "waiting": s.num_waiting,
            }

        result: dict[str, Any] = await worker.engine.acall(read)
        return result

    @app.post("/kv/blocks")
    async def kv_blocks(body: BlocksBody, worker: WorkerDep) -> Response:
        """Serve the longest cached run of ``keys`` in the binary transfer format."""
        chunks = await worker.export_stream(body.keys, body.release)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.get("/kv/endpoint")
    async def kv_endpoint(worker: WorkerDep) -> dict[str, Any]:
        """Where this worker serves KV transfers over a plain socket."""
        return {"port": worker.kv_server.port}

    @app.post("/kv/pull")
    async def kv_pull(body: PullBody, worker: WorkerDep) -> dict[str, Any]:
        """Pull the run ``keys`` from the worker at ``source`` into this worker's pool."""
        try:
            result = await worker.puller.pull(body.source, body.keys)
        except TransferError as exc:
            raise ApiError(
                502, f"KV transfer from {body.source} failed: {exc}", type_="transfer_error",
                code=exc.reason,
            ) from exc  # fmt: skip
        return {
            "requested": result.requested,
            "present": result.present,
            "pulled": result.pulled,
            "bytes": result.bytes,
            "seconds": result.seconds,
        }

    return app


def rendered(prep: Prepared) -> dict[str, Any]:
    """A prepared request in the shape of vLLM's ``GenerateRequest`` (render endpoints)."""
    sp = prep.sampling
    return {
        "request_id": prep.request_id,
        "model": prep.model,
        "token_ids": prep.prompt_ids,
        "sampling_params": {
            "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k, "min_p": sp.min_p, "seed": sp.seed, "stop": prep.stops,
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
            "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
            "repetition_penalty": sp.repetition_penalty,
            "logit_bias": {str(t): b for t, b in sp.logit_bias} or None,
        },
        "cache_salt": prep.cache_salt,
        "stream": prep.stream,
    }  # fmt: skip


_U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


class BlocksBody(BaseModel):
    """``POST /kv/blocks``: the keys asked for, a contiguous run of one prefix chain."""

    model_config = ConfigDict(extra="forbid")
    keys: list[_U64] = Field(max_length=MAX_TRANSFER_BLOCKS)
    release: str | None = Field(None, max_length=128, description="PD lease to release after")


class PullBody(BaseModel):
    """``POST /kv/pull``: pull ``keys`` (a prefix chain from its first block) from ``source``."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(pattern=r"^https?://", max_length=2048)
    keys: list[_U64] = Field(max_length=64 * MAX_TRANSFER_BLOCKS)
