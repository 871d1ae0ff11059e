"""The gateway app: ``create_app(settings)``.

The lifespan owns every connection and task (Redis client, index, httpx
client, discovery, load sharing) and loads the tokenizers of the served
models; no module-level app, settings or singletons.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import httpx
import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_worker.chat_template import ChatTemplate, ChatTemplateError
from engine_worker.http_errors import (
    ServerErrors,
    api_error_response,
    error_response,
    install_error_handlers,
)
from engine_worker.http_limits import BearerAuthMiddleware, BodyLimitMiddleware, replay_body
from engine_worker.http_stream import ClosingStreamingResponse, disconnected
from engine_worker.model.registry import resolve
from engine_worker.pd import remote_address
from engine_worker.profiles import default_profile
from engine_worker.protocol import (
    CLIENT_CLOSED,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
)
from engine_worker.tokenizer import load_tokenizer
from indexer.index.mirror import IndexMirror
from indexer.index.redis_index import RedisIndex
from indexer.ingest_reader import client_for
from indexer.metrics import MirrorMetrics
from indexer.views import Role, WorkerView
from indexer.wire import Keyspace
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.discovery import AllowedWorkers, WorkerDirectory
from kvrouter.gateway.dispatch import Dispatcher, Upstream, stream_error_event
from kvrouter.gateway.limits import RateLimiter, client_id, over_slo
from kvrouter.gateway.load import Load, LoadTracker, admission_load
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.pd import PdPlan, PdPlanner
from kvrouter.gateway.routing import ModelTokens, Routed, Router, unknown_model
from kvrouter.gateway.settings import RouterSettings
from kvrouter.gateway.upstream import HttpPool, UpstreamError
from kvrouter.logs import request_id_var
from kvrouter.policy_factory import build_policy
from kvrouter.router_core import prefill_tokens as prefill_tokens_of

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_T = TypeVar("_T")


@dataclass(slots=True)
class Gateway:
    """What the lifespan builds and the handlers use."""

    settings: RouterSettings
    router: Router
    dispatcher: Dispatcher
    directory: WorkerDirectory
    load: LoadTracker
    affinity: SessionAffinity
    metrics: RouterMetrics
    limiter: RateLimiter
    pd: PdPlanner | None = None
    draining: bool = False

    def decoders(self, model: str) -> list[WorkerView]:
        """Decode-capable workers serving ``model`` (role decode or both), by name."""
        return [v for v in self.directory.routable(model) if v.role in (Role.DECODE, Role.BOTH)]


async def get_gateway(request: Request) -> Gateway:
    """The app's gateway state (built by the lifespan; async: FastAPI would run a plain
    function in its thread pool, a thread hop on every request)."""
    gw: Gateway = request.state.gateway
    return gw


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def _load_models(specs: list[str]) -> dict[str, ModelTokens]:
    models: dict[str, ModelTokens] = {}
    for spec in specs:
        resolved = resolve(spec)
        tok = load_tokenizer(spec)
        try:
            template: ChatTemplate | None = ChatTemplate.for_tokenizer(tok)
        except ChatTemplateError:
            template = None
        models[resolved.name] = ModelTokens(tok, template)
        # Computed now, not on the first request: workers compare it (tokenized_prompt).
        log.info("model %s: tokenizer fingerprint %s", resolved.name, tok.fingerprint)
    return models


def create_app(settings: RouterSettings, *, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the gateway app."""
    metrics = RouterMetrics(registry or CollectorRegistry())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        import asyncio

        models = await asyncio.to_thread(_load_models, settings.models)
        keyspace = Keyspace(settings.key_prefix)
        # A cluster client when Redis runs in cluster mode (load leases, rate buckets,
        # discovery and the index all work on either).
        client = (
            await client_for(settings.redis_url, socket_timeout=1.0) if settings.redis_url else None
        )
        index: RedisIndex | IndexMirror | None = None
        if client is not None:
            index = RedisIndex(client, keyspace)
            if settings.index_mode == "mirror":
                index = IndexMirror(
                    index, client, keyspace=keyspace, metrics=MirrorMetrics(metrics.registry)
                )
                await index.start()
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000))
        directory = WorkerDirectory(
            metrics=metrics,
            block_size=settings.block_size,
            models=set(models),
            client=client,
            keyspace=keyspace,
            static_urls=settings.workers,
            http=http,
            interval_s=settings.discovery_interval_s,
            internal_token=(
                settings.internal_token.get_secret_value() if settings.internal_token else None
            ),
            allowed=AllowedWorkers.parse(settings.allowed_workers),
        )
        load = LoadTracker(
            client=client,
            keyspace=keyspace,
            lease_s=settings.load_lease_s,
            sync_interval_s=settings.load_sync_interval_s,
        )
        if settings.replica_id:
            load.replica_id = settings.replica_id
        directory.on_view = load.saw
        planner = PdPlanner(settings.pd, default_profile(), pooling=settings.pooling)
        affinity = SessionAffinity(ttl_s=settings.session_ttl_s, max_sessions=settings.max_sessions)
        router = Router(
            models=models,
            directory=directory,
            index=index,
            load=load,
            policy=build_policy(
                settings.policy,
                settings.seed,
                speculative_ttl_s=settings.speculative_ttl_s,
                pooling=settings.pooling,
            ),
            fallback=build_policy(settings.fallback_policy, settings.seed),
            metrics=metrics,
            block_size=settings.block_size,
            max_prompt_tokens=settings.max_prompt_tokens,
            affinity=affinity,
            planner=planner,
            prompt_cache_bytes=int(settings.prompt_cache_mib * 1024 * 1024),
        )
        token = settings.internal_token.get_secret_value() if settings.internal_token else None
        upstream = HttpPool()
        dispatcher = Dispatcher(
            upstream, directory, load, metrics,
            max_attempts=settings.max_attempts,
            connect_timeout_s=settings.connect_timeout_s,
            first_byte_timeout_s=settings.first_byte_timeout_s,
            internal_token=token,
        )  # fmt: skip
        await directory.refresh()
        directory.start()
        load.start()
        limiter = RateLimiter(
            metrics, client, keyspace,
            requests_per_s=settings.rate_limit_rps, tokens_per_min=settings.rate_limit_tpm,
            burst_s=settings.rate_limit_burst_s,
        )  # fmt: skip
        gw = Gateway(
            settings, router, dispatcher, directory, load, affinity, metrics, limiter, planner
        )

        async def drain() -> None:
            gw.draining = True
            metrics.draining.set(1)
            log.info("draining: not ready; in-flight requests get up to %.0f s", settings.drain_s)
            # Load balancers see /ready fail and stop sending; until then, serve as usual.
            await asyncio.sleep(settings.unready_grace_s)

        app.state.drain = drain
        log.info(
            "gateway on %s:%d: models %s, policy %s, %d workers known",
            settings.bind, settings.port, sorted(models), settings.policy, len(directory.views),
        )  # fmt: skip
        try:
            yield {"gateway": gw}
        finally:
            await directory.stop()
            await load.stop()
            await http.aclose()
            await upstream.aclose()
            if index is not None:
                await index.close()
            if client is not None:
                await client.aclose()

    app = FastAPI(title="kvrouter gateway", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    invalid = app.exception_handlers[RequestValidationError]
    endpoints = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

    async def counted_invalid(request: Request, exc: Exception) -> Response:
        # A body that fails validation never reaches a handler: count its 400 here.
        if (endpoint := endpoints.get(request.url.path)) is not None:
            metrics.requests.labels(endpoint, "400", settings.policy).inc()
        response = invalid(request, exc)
        return await response if inspect.isawaitable(response) else response

    app.add_exception_handler(RequestValidationError, counted_invalid)
    # Innermost: after the body limit and the auth check, before FastAPI's routing.
    app.add_middleware(DirectRoutes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    # Outermost: an unauthenticated client gets its 401 before any byte of its body is read.
    app.add_middleware(
        BearerAuthMiddleware,
        tokens=[k.get_secret_value().encode() for k in settings.api_keys],
        protected=lambda path: path.startswith("/v1/"),
        on_failure=metrics.auth_failures.inc,
    )
    app.add_middleware(ServerErrors)  # a bug anywhere inside: an OpenAI 500

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, gw: GatewayDep) -> Response:
        return await _handle(gw, "completions", "/v1/completions", body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, gw: GatewayDep) -> Response:
        return await _handle(gw, "chat", "/v1/chat/completions", body, request)

    def served(gw: Gateway) -> dict[str, dict[str, Any]]:
        models = [m for m in gw.directory.served_models() if m in gw.router.models]
        return {
            m: {"id": m, "object": "model", "created": 0, "owned_by": "kvrouter"} for m in models
        }

    @app.get("/v1/models")
    async def models(gw: GatewayDep) -> dict[str, Any]:
        return {"object": "list", "data": list(served(gw).values())}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, gw: GatewayDep) -> dict[str, Any]:
        # The openai SDK's models.retrieve(); a model id may hold slashes (org/name).
        found = served(gw).get(model)
        if found is None:
            raise unknown_model(model)
        return found

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(gw: GatewayDep) -> Response:
        if gw.draining:
            body = ApiError(503, "draining for shutdown", type_="service_unavailable").body()
            return JSONResponse(body, status_code=503)
        workers = sum(len(gw.directory.routable(m)) for m in gw.router.models)
        if workers == 0:
            body = ApiError(503, "no routable worker yet", type_="service_unavailable").body()
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready", "workers": workers})

    gauged: set[str] = set()

    @app.get("/metrics")
    async def metrics_endpoint(gw: GatewayDep) -> Response:
        # Every known worker has a series (one whose count fell to zero reads 0, not its
        # last value); a worker that left and holds no count loses its series.
        known = {*gw.load.workers(), *gw.directory.views}
        per_worker = (metrics.in_flight, metrics.held_blocks, metrics.queued_tokens)
        for w in gauged - known:
            for gauge in per_worker:
                with suppress(KeyError):
                    gauge.remove(w)
        for w in known:
            counted = gw.load.load(w)
            metrics.in_flight.labels(w).set(counted.in_flight)
            metrics.held_blocks.labels(w).set(counted.held_blocks)
            metrics.queued_tokens.labels(w).set(counted.queued_tokens)
        gauged.clear()
        gauged.update(known)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


#: The routes :class:`DirectRoutes` serves: path -> (endpoint label, request model).
_DIRECT: dict[str, tuple[str, type[CompletionRequest] | type[ChatCompletionRequest]]] = {
    "/v1/completions": ("completions", CompletionRequest),
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
}


class DirectRoutes:
    """The two generation routes, served without FastAPI's routing layers when they can be.

    FastAPI's per-request work (route matching, dependency solving, its body parsing)
    was about a quarter of a millisecond of the gateway's ~1.5 ms overhead on a short
    request. A POST to ``/v1/completions`` or ``/v1/chat/completions`` whose body is a
    JSON object (content type JSON, or none, as FastAPI reads it) that validates
    against the request model goes straight to the same handler, with the same
    parsed body, here. Anything else goes on to the FastAPI routes unchanged, so
    every error a malformed request gets, and the OpenAPI schema, stay FastAPI's.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _DIRECT.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST" or not _json_content(scope):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        endpoint, model = route
        try:
            raw = json.loads(body)
            parsed = model.model_validate(raw) if isinstance(raw, dict) else None
        except (ValueError, ValidationError):
            parsed = None
        except RecursionError:
            # Nested deeper than the parser recurses: FastAPI's parsing would hit the same.
            await error_response(400, "The request body is not valid JSON: nested too deeply.")(
                scope, receive, send
            )
            return
        if parsed is None:
            await self.app(scope, replay_body(body, receive), send)
            return
        request = Request(scope, receive)
        request._body, request._json = body, raw  # what FastAPI leaves on its Request
        gw: Gateway = scope["state"]["gateway"]
        try:
            response = await _handle(gw, endpoint, scope["path"], parsed, request)
        except ApiError as exc:
            response = api_error_response(exc)
        await response(scope, receive, send)


def _json_content(scope: Scope) -> bool:
    """Whether FastAPI would read the body as JSON: no content type, or a JSON one."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return True


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id", "")
    return rid if _REQUEST_ID.match(rid) else new_id("req")


@dataclass(slots=True)
class _Opened:
    """A request routed and sent: the worker's response is open."""

    routed: Routed
    plan: PdPlan | None
    up: Upstream
    #: PD: the worker that prefilled and handed the prompt off (None: no hand-off).
    prefilled_on: str | None = None
    #: PD: that worker's ``cached_tokens_by_medium`` for the prompt.
    prefill_cached: dict[str, int] | None = None


async def _handle(
    gw: Gateway,
    endpoint: str,
    path: str,
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
) -> Response:
    t0 = time.perf_counter()
    rid = _request_id(request)
    ctx = request_id_var.set(rid)
    labels = [gw.settings.policy]  # the policy that decided, once it did
    try:
        opened = await _unless_client_leaves(request, _open(gw, path, body, request, rid, labels))
    except ApiError as exc:
        gw.metrics.requests.labels(endpoint, str(exc.status), labels[0]).inc()
        raise
    finally:
        request_id_var.reset(ctx)
    if opened is None:
        gw.metrics.client_gone.labels("before_first_byte").inc()
        gw.metrics.requests.labels(endpoint, str(CLIENT_CLOSED), labels[0]).inc()
        return Response(status_code=CLIENT_CLOSED)
    up = opened.up
    try:
        return await _respond(gw, opened, endpoint, labels[0], body, request, rid, t0)
    except BaseException:
        await up.close()
        raise


async def _open(
    gw: Gateway,
    path: str,
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
    rid: str,
    labels: list[str],
) -> _Opened:
    """Route, admit, and open the worker's response (its first byte, or all of it)."""
    session = request.headers.get(gw.settings.session_header) or body.user or None
    raw: dict[str, Any] = await request.json()
    ids = None
    if gw.limiter.limits:
        ids = await gw.router.tokenize_async(body)
        api_key = request.headers.get("authorization", "").partition(" ")[2].strip()
        await gw.limiter.check(client_id(api_key), len(ids) + (body.max_tokens or 0))
    # From here to the dispatcher's ticket nothing may suspend: see Router.route.
    routed = await gw.router.route(body, rid, session, ids=ids)
    labels[0] = routed.decision.policy
    if refusal := over_slo(routed.decision.predicted_ttft_s, gw.settings.admission_max_ttft_s):
        gw.metrics.admission_rejected.inc()
        raise refusal
    worker = routed.worker
    candidates = [worker, *[h for h in routed.decision.ranked() if h != worker]]
    plan = _plan(gw, routed)
    if body.stream:
        raw["stream_options"] = {**(raw.get("stream_options") or {}), "include_usage": True}
    # The worker uses these ids instead of tokenizing the prompt again (when its tokenizer
    # is ours); what a client sent in this field is never passed on.
    raw.pop("tokenized_prompt", None)
    # Neither is a client's kv_transfer_params: PD and pooling are the gateway's to plan,
    # and a worker told to pull from a client's remote_host would connect there with the
    # fleet's internal token (or hold a prefill lease nobody claims).
    raw.pop("kv_transfer_params", None)
    if (sent := gw.router.tokenized_prompt(body, routed.ids)) is not None:
        raw["tokenized_prompt"] = sent
    prefill_tokens = prefill_tokens_of(
        routed.decision, plan, routed.prompt_tokens, routed.request.block_size
    )
    prefilled_on = prefill_cached = None
    if plan is not None and plan.disaggregate and plan.decode is not None:
        handed = await _prefill_elsewhere(
            gw, plan, candidates, path, raw, rid, prefill_tokens, routed.prompt_tokens
        )
        if handed is not None:
            raw["kv_transfer_params"], prefill_cached, prefilled_on = handed
        others = [v.host for v in gw.decoders(body.model) if v.host != plan.decode]
        candidates = [plan.decode, *others]
    elif plan is not None and plan.prefill != routed.decision.worker:
        # Colocated elsewhere than the policy's choice (on the decoder, or where affinity
        # sent it): the plan priced that worker, and any pull from a peer it makes.
        candidates = [plan.prefill, *[h for h in candidates if h != plan.prefill]]
        if pool := _pool_params(gw, plan.kv_source, routed, plan.matched_blocks):
            raw["kv_transfer_params"] = pool
    elif worker == routed.decision.worker and (
        pool := _pool_params(gw, routed.decision.kv_source, routed, routed.decision.matched_blocks)
    ):
        raw["kv_transfer_params"] = pool
    up = await gw.dispatcher.open(
        candidates, path, encode_body(raw), rid, prefill_tokens, whole=not body.stream,
        keys=routed.request.block_keys, prompt_tokens=routed.prompt_tokens,
        admission=_admission(routed),
    )  # fmt: skip
    gw.router.core.served(session, up.worker)
    return _Opened(routed, plan, up, prefilled_on, prefill_cached)


async def _unless_client_leaves(request: Request, work: Awaitable[_T]) -> _T | None:
    """Run ``work``; if the client disconnects first, cancel it and return None.

    Cancelling stops everything ``work`` started: the load ticket ends and the
    worker's connection closes, which aborts the request on the worker. ``work``
    runs in this task (no hop through the loop); a watcher task cancels it.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = asyncio.ensure_future(disconnected(request.receive))
    left = finished = False

    def on_gone(fut: asyncio.Future[None]) -> None:
        # Runs from the loop, possibly after ``work`` returned (then it must not cancel);
        # while ``work`` waits, the cancel lands inside it, where its cleanup is.
        nonlocal left
        if not finished and not fut.cancelled() and fut.exception() is None:
            left = True
            task.cancel()

    gone.add_done_callback(on_gone)
    try:
        return await work
    except (asyncio.CancelledError, ApiError):
        if not left:
            raise
        task.uncancel()  # our own cancel: the client left, nothing to propagate
        return None
    finally:
        finished = True
        gone.cancel()


async def _respond(
    gw: Gateway,
    opened: _Opened,
    endpoint: str,
    policy: str,
    body: CompletionRequest | ChatCompletionRequest,
    request: Request,
    rid: str,
    t0: float,
) -> Response:
    routed, plan, up = opened.routed, opened.plan, opened.up
    headers = {"x-request-id": rid, "x-kvrouter-worker": up.worker}
    if request.headers.get(gw.settings.debug_header):
        decision = gw.router.decision_header(routed)
        decision["worker"] = up.worker
        if plan is not None:
            decision["pd"] = plan.header()
            if plan.disaggregate:
                # Who prefilled and handed the prompt off (None: the decoder computed
                # it), and what that worker's cache served of the prompt.
                decision["pd"]["prefilled_on"] = opened.prefilled_on
                decision["pd"]["prefill_cached_tokens_by_medium"] = opened.prefill_cached
        headers["x-kvrouter-decision"] = json.dumps(decision, separators=(",", ":"))
    gw.metrics.prompt_tokens.inc(routed.prompt_tokens)
    if up.first_token and up.status == 200:
        ttft = up.first_byte_at - t0
        gw.metrics.ttft.observe(ttft)
        predicted = routed.decision.predicted_ttft_s
        if predicted:
            gw.metrics.predicted_ttft.observe(predicted)
            gw.metrics.ttft_error_ratio.observe(ttft / predicted)
    if up.rest is None:
        await up.close()  # the body was read whole
        if up.status == 200:
            with suppress(ValueError, AttributeError):
                _observe_usage(gw, json.loads(up.first).get("usage"))
        gw.metrics.requests.labels(endpoint, str(up.status), policy).inc()
        gw.metrics.e2e.observe(time.perf_counter() - t0)
        ctype = up.headers.get("content-type", "application/json")
        return Response(up.first, status_code=up.status, media_type=ctype, headers=headers)
    stream = _Stream(gw, up, body.include_usage, endpoint, policy, t0)
    return ClosingStreamingResponse(
        stream.relay(),
        on_close=stream.close,
        media_type="text/event-stream",
        headers={**headers, "cache-control": "no-cache"},
    )


def _plan(gw: Gateway, routed: Routed) -> PdPlan | None:
    """The request's prefill/decode plan, which the router core made (None without PD)."""
    plan = routed.plan
    if plan is not None:
        gw.metrics.pd_requests.labels("disaggregated" if plan.disaggregate else "colocated").inc()
    return plan


async def _prefill_elsewhere(
    gw: Gateway,
    plan: PdPlan,
    candidates: list[str],
    path: str,
    raw: dict[str, Any],
    rid: str,
    prefill_tokens: dict[str, int],
    prompt_tokens: int,
) -> tuple[dict[str, Any], dict[str, int], str] | None:
    """Run the prefill-only request: its ``kv_transfer_params``, the prefill worker's
    ``cached_tokens_by_medium`` and name; or None to prefill locally.

    Whatever goes wrong here (no prefill worker answers, an error status, a body
    without the parameters) the decoder computes the prompt itself: the client
    sees one answer either way.
    """
    body = {k: v for k, v in raw.items() if k not in ("stream", "stream_options")}
    body.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
    prefillers = [plan.prefill, *[h for h in candidates if h != plan.prefill]]
    reason = ""
    try:
        up = await gw.dispatcher.open(
            prefillers, path, encode_body(body), f"{rid}-prefill", prefill_tokens,
            whole=True, prompt_tokens=prompt_tokens,
        )  # fmt: skip
    except ApiError as exc:
        reason = "prefill_unavailable"
        log.warning("request %s: no prefill worker answered (%s); decoding locally", rid, exc)
    else:
        await up.close()
        if up.status != 200:
            reason = f"prefill_{up.status}"
        else:
            with suppress(ValueError, AttributeError):
                answer = json.loads(up.first)
                params = answer.get("kv_transfer_params")
                if isinstance(params, dict) and params.get("do_remote_prefill"):
                    return params, _cached_by_medium(answer), up.worker
            reason = "prefill_no_params"
    gw.metrics.pd_fallbacks.labels(reason).inc()
    return None


def encode_body(body: dict[str, Any]) -> bytes:
    """A request body for a worker, as JSON (msgspec: a long ``tokenized_prompt`` takes
    ~1 ms through ``json.dumps``, ~0.1 ms here); ``json`` for what msgspec cannot write
    (integers past 64 bits)."""
    try:
        return msgspec.json.encode(body)
    except (OverflowError, TypeError, msgspec.EncodeError):
        return json.dumps(body).encode()


def _cached_by_medium(answer: dict[str, Any]) -> dict[str, int]:
    """A completion's ``usage.cached_tokens_by_medium`` ({} when absent or malformed)."""
    try:
        by = (answer.get("usage") or {}).get("cached_tokens_by_medium") or {}
        return {str(k): int(v) for k, v in by.items()}
    except (AttributeError, TypeError, ValueError):
        return {}


def _pool_params(
    gw: Gateway, source: str | None, routed: Routed, blocks: int
) -> dict[str, Any] | None:
    """``kv_transfer_params`` that make the worker pull the prompt's first ``blocks``
    blocks from ``source`` (None: no pull)."""
    view = gw.directory.views.get(source) if source else None
    if view is None or not view.url:
        return None
    keys = list(routed.request.block_keys[:blocks])
    gw.metrics.pooled_pulls.inc()
    return {
        "do_remote_prefill": True,
        "remote_engine_id": source,
        **remote_address(view.url),
        "remote_block_ids": keys,
    }


def _admission(routed: Routed) -> dict[str, Load]:
    """Per candidate, the cached blocks its admission takes from the free pool and loads
    from DRAM and SSD (the policy's scores, where it scores them)."""
    return {h: admission_load(t) for h, t in routed.decision.scores.items()}


def _observe_usage(gw: Gateway, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    for medium, n in (usage.get("cached_tokens_by_medium") or {}).items():
        if n:
            gw.metrics.prefix_hit_tokens.labels(medium).inc(n)


@dataclass(slots=True)
class _Stream:
    """One relayed stream: its upstream, and what is counted when it ends."""

    gw: Gateway
    up: Upstream
    wants_usage: bool
    endpoint: str
    policy: str
    t0: float
    status: int = CLIENT_CLOSED  # until the relay reaches the end one way or the other
    closed: bool = False

    async def relay(self) -> AsyncIterator[bytes]:
        """Pass the worker's SSE through as it arrives; end cleanly if the worker breaks."""
        gw, up = self.gw, self.up
        assert up.rest is not None
        buf = b""
        try:
            chunk = up.first
            while True:
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                out = []
                for ev in events:
                    if b'"usage"' in ev and b'"choices":[]' in ev:
                        with suppress(ValueError, AttributeError):
                            usage = json.loads(ev.removeprefix(b"data: ")).get("usage")
                            _observe_usage(gw, usage)
                        if not self.wants_usage:
                            continue
                    out.append(ev + b"\n\n")
                if out:
                    yield b"".join(out)
                try:
                    chunk = await up.rest.__anext__()
                except StopAsyncIteration:
                    break
            if buf:
                yield buf
            self.status = 200
        except UpstreamError as exc:
            self.status = 502
            gw.metrics.stream_errors.inc()
            log.warning("stream from %s broke after the first byte: %s", up.worker, exc)
            yield stream_error_event(f"the worker's stream broke: {type(exc).__name__}")

    async def close(self) -> None:
        """Release the worker and count the request (once, however the stream ended)."""
        if self.closed:
            return
        self.closed = True
        m = self.gw.metrics
        try:
            await self.up.close()
        finally:
            if self.status == CLIENT_CLOSED:
                m.client_gone.labels("streaming").inc()
            m.requests.labels(self.endpoint, str(self.status), self.policy).inc()
            m.e2e.observe(time.perf_counter() - self.t0)
