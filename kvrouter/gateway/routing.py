"""From an OpenAI request body to a routing decision.

tokenize (the model's own tokenizer and chat template, identical ids to the
workers'; a prompt's cached prefix is not tokenized again, and a long prompt
is tokenized in a worker thread so the event loop keeps serving) -> block
keys (``indexer.keys``) -> index lookup (one round trip) -> the router core
(``kvrouter.router_core``: load overlay, policy, session affinity, PD plan),
the same code the offline simulator runs. Each stage is timed for the
``kvrouter_decision_seconds{stage}`` histogram.

If the index cannot answer (Redis away), routing falls back to a load-only
policy and says so (``kvrouter_cache_aware_routing`` 0) until the index
answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine_worker.chat_template import ChatTemplate, ChatTemplateError
from engine_worker.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from engine_worker.tokenizer import Tokenizer
from indexer.index.base import KVIndex, KVIndexError
from indexer.keys import block_keys, root_parent
from indexer.views import PrefixMatch, WorkerView
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import LoadTracker
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.pd import PdPlan, PdPlanner
from kvrouter.gateway.prompt_tokens import PromptTokenizer, PromptTooLongError
from kvrouter.router_core import RouterCore, candidates, overlay, route_request
from policies.base import Decision, NoWorkerError, Policy, RouteRequest

__all__ = ["ModelTokens", "Routed", "Router", "unknown_model"]

log = logging.getLogger(__name__)

#: Prompts longer than this (characters) are rendered and tokenized in a worker thread;
#: shorter ones cost less than the hop to the thread.
OFFLOAD_CHARS = 16 * 1024


def unknown_model(model: str) -> ApiError:
    """The 404 for a model the gateway does not route (OpenAI's ``model_not_found``)."""
    return ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError",
                    param="model", code="model_not_found")  # fmt: skip


@dataclass(slots=True)
class ModelTokens:
    """A served model's tokenizer and chat template."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


@dataclass(slots=True)
class Routed:
    """A routing decision with what led to it.

    ``worker`` is where the request goes before any PD plan: the policy's choice, or
    the session's last worker when affinity holds; ``plan`` is the PD plan, if any.
    """

    decision: Decision
    request: RouteRequest
    cache_aware: bool
    timings: dict[str, float] = field(default_factory=dict)
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    worker: str = ""
    plan: PdPlan | None = None
    #: The prompt's token ids, as the workers compute them.
    ids: list[int] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.ids)

    def uncached_tokens(self) -> int:
        """Prompt tokens the chosen worker still has to prefill."""
        cached = self.decision.matched_blocks * self.request.block_size
        return max(self.prompt_tokens - cached, 1)


class Router:
    """Makes routing decisions; holds no connection of its own."""

    def __init__(
        self,
        *,
        models: dict[str, ModelTokens],
        directory: WorkerDirectory,
        index: KVIndex | None,
        load: LoadTracker,
        policy: Policy,
        fallback: Policy,
        metrics: RouterMetrics,
        block_size: int,
        max_prompt_tokens: int,
        affinity: SessionAffinity | None = None,
        planner: PdPlanner | None = None,
        prompt_cache_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.models = models
        self.prompts = {
            name: PromptTokenizer(mt.tokenizer, prompt_cache_bytes) for name, mt in models.items()
        }
        self.directory = directory
        self.index = index
        self.load = load
        self.core = RouterCore(policy, fallback, affinity, planner)
        self.metrics = metrics
        self.block_size = block_size
        self.max_prompt_tokens = max_prompt_tokens
        self.index_ok = index is not None
        self._roots: dict[tuple[str, str], int] = {}
        metrics.cache_aware.set(1 if self.index_ok else 0)

    def tokenized_prompt(
        self, body: CompletionRequest | ChatCompletionRequest, ids: list[int]
    ) -> dict[str, Any] | None:
        """The ``tokenized_prompt`` field that spares the worker tokenizing ``body`` again.

        None when the prompt came as token ids (nothing to spare) or there are none.
        """
        mt = self.models.get(body.model)
        text = isinstance(body, ChatCompletionRequest) or isinstance(body.prompt, str)
        if mt is None or not ids or not text:
            return None
        return {"tokenizer": mt.tokenizer.fingerprint, "ids": ids}

    def tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """Token ids of the request's prompt, exactly as the worker will compute them."""
        mt = self.models.get(body.model)
        if mt is None:
            raise unknown_model(body.model)
        if isinstance(body, ChatCompletionRequest):
            if mt.chat_template is None:
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            try:
                text = mt.chat_template.render(
                    body.template_messages(), add_generation_prompt=body.add_generation_prompt
                )
            except ChatTemplateError as exc:
                raise ApiError(400, f"cannot render the chat: {exc}", param="messages") from exc
            ids = self._encode(body, text, add_special_tokens=False)
        elif isinstance(body.prompt, str):
            ids = self._encode(body, body.prompt, add_special_tokens=True)
        else:
            ids = list(body.prompt)  # type: ignore[arg-type]
            vocab = mt.tokenizer.vocab_size
            if any(t >= vocab for t in ids):
                raise ApiError(
                    400, f"prompt token ids must be < {vocab}, the size of `{body.model}`'s "
                    "vocabulary", param="prompt", code="invalid_token_id",
                )  # fmt: skip
        if len(ids) > self.max_prompt_tokens:
            raise self._too_long(body, f"{len(ids)}")
        return ids

    async def tokenize_async(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """:meth:`tokenize`, in a worker thread when the prompt is long (the loop keeps serving)."""
        if _prompt_chars(body) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self.tokenize, body)
        return self.tokenize(body)

    def _encode(
        self, body: CompletionRequest | ChatCompletionRequest, text: str, add_special_tokens: bool
    ) -> list[int]:
        try:
            return self.prompts[body.model].encode(
                text, add_special_tokens=add_special_tokens, limit=self.max_prompt_tokens
            )
        except PromptTooLongError as exc:
            raise self._too_long(body, f"{'' if exc.exact else 'at least '}{exc.at_least}") from exc

    def _too_long(self, body: CompletionRequest | ChatCompletionRequest, count: str) -> ApiError:
        return ApiError(
            400,
            f"the prompt has {count} tokens, over this gateway's limit of {self.max_prompt_tokens}",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="prompt_too_long",
        )

    @property
    def policy(self) -> Policy:
        """The routing policy."""
        return self.core.policy

    @property
    def fallback(self) -> Policy:
        """The load-only policy used while the index cannot answer."""
        return self.core.fallback

    def _root(self, model: str, salt: str) -> int:
        key = (model, salt)
        root = self._roots.get(key)
        if root is None:
            root = root_parent(model, "", salt)
            if len(self._roots) < 4096:
                self._roots[key] = root
        return root

    def views(self, model: str) -> list[WorkerView]:
        """Routable workers with the gateway's load accounting laid over their heartbeats.

        Heartbeats lag by up to one interval; the gateway's counts of what it
        routed (all replicas) are current: each term is the count now plus what the
        heartbeat showed beyond the count when it arrived (``router_core.overlay``).
        """
        laid = overlay(self.directory.routable(model), self.load.load, self.load.seen_at)
        return candidates(laid)

    async def route(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        session_id: str | None = None,
        *,
        ids: list[int] | None = None,
    ) -> Routed:
        """Decide where ``body`` goes; raises ApiError (404 model, 400 prompt, 503 no worker).

        ``ids``: the prompt's token ids when the caller has tokenized it already.
        """
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        ids = await self.tokenize_async(body) if ids is None else ids
        t1 = time.perf_counter()
        timings["tokenize"] = t1 - t0
        keys = block_keys(ids, self.block_size, self._root(body.model, body.cache_salt or ""))
        t2 = time.perf_counter()
        timings["hash"] = t2 - t1
        matches = await self._lookup(keys)
        t3 = time.perf_counter()
        timings["lookup"] = t3 - t2
        # The views are read after the lookup, with no suspension point between them, the
        # policy and the dispatcher's ticket: requests whose lookups overlapped (a burst)
        # each see the load of those decided before them. Read before the lookup, a whole
        # burst saw the same idle views and piled onto the worker the first one picked.
        now = time.time()
        routable = self.directory.routable(body.model)
        if not routable:
            raise ApiError(
                503,
                f"no healthy worker serves `{body.model}` right now",
                type_="service_unavailable",
                code="no_worker",
            )
        req = route_request(
            request_id, body.model, len(ids), keys, self.block_size, now,
            body.max_tokens or 0, session_id,
        )  # fmt: skip
        # Without an index at all (no Redis) the policy still has its speculative entries;
        # with an index that fails, cached prefixes are unknown: route by load only.
        try:
            out = self.core.decide(
                req, routable, self.load.load, matches,
                cache_aware=matches is not None or self.index is None, held_of=self.load.held.get,
                seen_of=self.load.seen_at,
            )  # fmt: skip
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), type_="service_unavailable", code="no_worker") from exc
        timings["score"] = time.perf_counter() - t3
        for stage, seconds in timings.items():
            self.metrics.decision.labels(stage).observe(seconds)
        return Routed(
            out.decision, req, matches is not None, timings, matches or {},
            out.worker, out.plan, ids,
        )  # fmt: skip

    async def _lookup(self, keys: list[int]) -> dict[str, PrefixMatch] | None:
        if self.index is None:
            return None
        if not keys:
            # Nothing to look up (a prompt shorter than a block): no news about the index.
            return {} if self.index_ok else None
        try:
            matches = await self.index.match(keys)
        except (KVIndexError, OSError) as exc:
            self.metrics.redis_errors.labels("lookup").inc()
            if self.index_ok:
                log.warning("index lookup failed (%s): routing by load only until it answers", exc)
            self.index_ok = False
            self.metrics.cache_aware.set(0)
            return None
        if not self.index_ok:
            log.info("index answers again: cache-aware routing resumed")
            self.index_ok = True
            self.metrics.cache_aware.set(1)
        return matches

    def decision_header(self, routed: Routed, top: int = 4) -> dict[str, Any]:
        """The debug header's content: the decision and the best candidates' scores."""
        d = routed.decision
        ranked = d.ranked()[:top]
        return {
            "worker": d.worker,
            "policy": d.policy,
            "cache_aware": routed.cache_aware,
            "predicted_ttft_s": d.predicted_ttft_s,
            "matched_blocks": d.matched_blocks,
            "kv_source": d.kv_source,
            "prompt_tokens": routed.prompt_tokens,
            "scores": {h: d.scores.get(h, {}) for h in ranked},
            "timings_s": routed.timings,
        }


def _prompt_chars(body: CompletionRequest | ChatCompletionRequest) -> int:
    """The prompt's size in characters (text content only; token ids count as none)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) for m in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0
