"""From an OpenAI request body to a routing decision.

tokenize (the model's own tokenizer and chat template, identical ids to the
workers') -> block keys (``indexer.keys``) -> index lookup (one round trip)
-> policy over the routable workers, whose views are overlaid with the
gateway's own load accounting. Each stage is timed for the
``kvrouter_decision_seconds{stage}`` histogram.

If the index cannot answer (Redis away), routing falls back to a load-only
policy and says so (``kvrouter_cache_aware_routing`` 0) until the index
answers again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from engine_worker.chat_template import ChatTemplate, ChatTemplateError
from engine_worker.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from engine_worker.tokenizer import Tokenizer
from indexer.index.base import KVIndex, KVIndexError
from indexer.keys import block_keys, root_parent
from indexer.views import PrefixMatch, Role, WorkerView
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import LoadTracker
from kvrouter.gateway.metrics import RouterMetrics
from policies.base import Decision, NoWorkerError, Policy, RouteRequest

__all__ = ["ModelTokens", "Routed", "Router"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelTokens:
    """A served model's tokenizer and chat template."""

    tokenizer: Tokenizer
    chat_template: ChatTemplate | None


@dataclass(slots=True)
class Routed:
    """A routing decision with what led to it."""

    decision: Decision
    request: RouteRequest
    prompt_tokens: int
    cache_aware: bool
    timings: dict[str, float] = field(default_factory=dict)
    matches: dict[str, PrefixMatch] = field(default_factory=dict)

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
    ) -> None:
        self.models = models
        self.directory = directory
        self.index = index
        self.load = load
        self.policy = policy
        self.fallback = fallback
        self.metrics = metrics
        self.block_size = block_size
        self.max_prompt_tokens = max_prompt_tokens
        self.index_ok = index is not None
        self._roots: dict[tuple[str, str], int] = {}
        metrics.cache_aware.set(1 if self.index_ok else 0)

    def tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """Token ids of the request's prompt, exactly as the worker will compute them."""
        mt = self.models.get(body.model)
        if mt is None:
            raise ApiError(
                404,
                f"The model `{body.model}` does not exist.",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )
        if isinstance(body, ChatCompletionRequest):
            if mt.chat_template is None:
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            try:
                text = mt.chat_template.render(
                    body.template_messages(), add_generation_prompt=body.add_generation_prompt
                )
            except ChatTemplateError as exc:
                raise ApiError(400, f"cannot render the chat: {exc}", param="messages") from exc
            ids = mt.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(body.prompt, str):
            ids = mt.tokenizer.encode(body.prompt)
        else:
            ids = list(body.prompt)  # type: ignore[arg-type]
            vocab = mt.tokenizer.vocab_size
            if any(t >= vocab for t in ids):
                raise ApiError(
                    400, f"prompt token ids must be < {vocab}, the size of `{body.model}`'s "
                    "vocabulary", param="prompt", code="invalid_token_id",
                )  # fmt: skip
        if len(ids) > self.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens, over this gateway's limit of "
                f"{self.max_prompt_tokens}",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="prompt_too_long",
            )
        return ids

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
        routed (all replicas) are current. Each term takes the larger of the two,
        so a burst routed since the last heartbeat is seen at once.
        """
        out = []
        routable = self.directory.routable(model)
        # Decode-only workers take whole requests only when no other worker is left.
        prefill_capable = any(v.role is not Role.DECODE for v in routable)
        for v in routable:
            if v.role is Role.DECODE and prefill_capable:
                continue
            tracked = self.load.load(v.host)
            out.append(
                replace(
                    v,
                    in_flight=max(v.in_flight, tracked.in_flight),
                    queued_prefill_tokens=max(v.queued_prefill_tokens, tracked.queued_tokens),
                )
                if tracked.in_flight or tracked.queued_tokens
                else v
            )
        return out

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
        ids = self.tokenize(body) if ids is None else ids
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
        workers = self.views(body.model)
        if not workers:
            raise ApiError(
                503,
                f"no healthy worker serves `{body.model}` right now",
                type_="service_unavailable",
                code="no_worker",
            )
        req = RouteRequest(
            request_id=request_id,
            model=body.model,
            num_tokens=len(ids),
            block_keys=tuple(keys),
            block_size=self.block_size,
            now=now,
            max_tokens=body.max_tokens or 0,
            session_id=session_id,
        )
        # Without an index at all (no Redis) the policy still has its speculative entries;
        # with an index that fails, cached prefixes are unknown: route by load only.
        policy = self.policy if matches is not None or self.index is None else self.fallback
        try:
            decision = policy.choose(req, workers, matches or {})
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), type_="service_unavailable", code="no_worker") from exc
        timings["score"] = time.perf_counter() - t3
        for stage, seconds in timings.items():
            self.metrics.decision.labels(stage).observe(seconds)
        return Routed(decision, req, len(ids), matches is not None, timings, matches or {})

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
            "prompt_tokens": routed.prompt_tokens,
            "scores": {h: d.scores.get(h, {}) for h in ranked},
            "timings_s": routed.timings,
        }
