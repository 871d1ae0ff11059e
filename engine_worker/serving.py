"""OpenAI completions and chat completions on top of the engine loop.

A request becomes token ids (the chat template renders messages first),
the ids a :class:`~engine_worker.request.Request`, and the engine's token
events a stream of text deltas: incrementally detokenized, cut at the first
stop string (which is never sent), and ended with OpenAI's
``finish_reason``. A client that goes away aborts its request, so its KV
blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine_worker.engine import TokenEvent
from engine_worker.kv_transfer import TransferError
from engine_worker.pd import PdParams, parse_pd, remote_address
from engine_worker.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    new_id,
    now_s,
)
from engine_worker.request import FinishReason, Request, SamplingParams
from engine_worker.scheduler import RequestTooLargeError
from engine_worker.worker import Worker
from indexer.media import MEDIA, Medium

__all__ = ["ClientGone", "Generation", "Prepared", "prepare_chat", "prepare_completion", "sse"]

log = logging.getLogger(__name__)

_CANCEL_POLL_S = 0.25


@dataclass(slots=True)
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    endpoint: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    cache_salt: str | None
    stream: bool
    include_usage: bool
    echo_text: str = ""
    pd: PdParams | None = None


def _sampling(worker: Worker, body: CompletionRequest | ChatCompletionRequest, n_prompt: int,
              default_max: int) -> SamplingParams:  # fmt: skip
    limit = worker.max_model_len
    if n_prompt >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{n_prompt} tokens.",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = (
        body.max_tokens if body.max_tokens is not None else min(default_max, limit - n_prompt)
    )
    if n_prompt + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens; the prompt has {n_prompt} "
            f"and max_tokens asks for {max_tokens} more.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(worker, body.logit_bias),
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def _logit_bias(worker: Worker, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; an id outside the vocabulary is a 400."""
    if not bias:
        return ()
    vocab = worker.tokenizer.vocab_size
    pairs = tuple((int(k), v) for k, v in bias.items())
    if any(t >= vocab for t, _ in pairs):
        raise ApiError(400, f"logit_bias token ids must be < {vocab}", param="logit_bias")
    return pairs


def _check_model(worker: Worker, model: str) -> None:
    if model != worker.model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. This worker serves `{worker.model_name}`.",
            type_="NotFoundError",
            param="model",
            code="model_not_found",
        )


def _sent_ids(worker: Worker, body: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
    """The request's ``tokenized_prompt`` ids when they are this worker's to use, else None.

    Used only when the sender tokenized with the same tokenizer and chat template
    (equal fingerprints); an id outside the vocabulary is the sender's error (400).
    """
    sent = body.tokenized_prompt
    if sent is None:
        worker.metrics.prompt_ids.labels("tokenized").inc()
        return None
    if sent.tokenizer != worker.tokenizer.fingerprint:
        worker.metrics.prompt_ids.labels("ignored").inc()
        return None
    vocab = worker.tokenizer.vocab_size
    if min(sent.ids) < 0 or max(sent.ids) >= vocab:
        raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokenized_prompt")
    worker.metrics.prompt_ids.labels("sent").inc()
    return sent.ids


def prepare_completion(worker: Worker, body: CompletionRequest) -> Prepared:
    """Validate a completions request against this worker; raise ApiError when it cannot run."""
    _check_model(worker, body.model)
    if isinstance(body.prompt, str):
        ids = _sent_ids(worker, body) or worker.tokenizer.encode(body.prompt)
        echo = body.prompt
    else:
        ids = list(body.prompt)  # type: ignore[arg-type]
        vocab = worker.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be < {vocab}", param="prompt")
        echo = worker.tokenizer.decode(ids) if body.echo else ""
    if not ids:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return _with_pd(
        Prepared(
            request_id=new_id("cmpl"),
            endpoint="completions",
            model=worker.model_name,
            prompt_ids=ids,
            sampling=_sampling(worker, body, len(ids), 16),
            stops=body.stop_list(),
            cache_salt=body.cache_salt,
            stream=body.stream,
            include_usage=body.include_usage,
            echo_text=echo if body.echo else "",
        ),
        body,
    )


def prepare_chat(worker: Worker, body: ChatCompletionRequest) -> Prepared:
    """Render, tokenize and validate a chat request; raise ApiError when it cannot run."""
    _check_model(worker, body.model)
    if worker.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions")
    from engine_worker.chat_template import ChatTemplateError

    ids = _sent_ids(worker, body)
    if ids is None:
        try:
            text = worker.chat_template.render(
                body.template_messages(), add_generation_prompt=body.add_generation_prompt
            )
        except ChatTemplateError as exc:
            raise ApiError(400, f"cannot render the chat: {exc}", param="messages") from exc
        ids = worker.tokenizer.encode(text, add_special_tokens=False)
    return _with_pd(
        Prepared(
            request_id=new_id("chatcmpl"),
            endpoint="chat",
            model=worker.model_name,
            prompt_ids=ids,
            sampling=_sampling(worker, body, len(ids), worker.max_model_len),
            stops=body.stop_list(),
            cache_salt=body.cache_salt,
            stream=body.stream,
            include_usage=body.include_usage,
        ),
        body,
    )


def _with_pd(prep: Prepared, body: CompletionRequest | ChatCompletionRequest) -> Prepared:
    """Attach the request's ``kv_transfer_params``; a prefill-only request makes one token."""
    pd = parse_pd(body.kv_transfer_params)
    if pd is not None and pd.remote_decode:
        if prep.stream:
            raise ApiError(
                400, "a prefill-only request (do_remote_decode) cannot be streamed",
                param="stream",
            )  # fmt: skip
        prep.sampling = dataclasses.replace(prep.sampling, max_tokens=1)
    prep.pd = pd
    return prep


class ClientGone(Exception):  # noqa: N818 - an event, not an error
    """The client closed its connection while its request ran: the request was aborted.

    Not ``asyncio.CancelledError``: nothing cancelled the handler, which answers it by
    ending quietly (a 499 nobody reads, or the end of a streamed body), where a
    cancellation rising out of it is logged by the server as an ASGI failure.
    """


@dataclass(slots=True)
class Delta:
    """New text of a request, and its end."""

    text: str
    finish_reason: str | None = None


@dataclass(slots=True)
class Generation:
    """One request through the engine: text deltas, stop strings, usage, metrics."""

    worker: Worker
    prep: Prepared
    is_disconnected: Callable[[], Any] | None = None
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    pulled_tokens: int = 0
    _done: bool = False
    #: Keys of the prompt's full blocks, hashed once by the request (the scheduler reuses them).
    _prompt_keys: list[int] = field(default_factory=list)

    async def pull_prefill(self) -> None:
        """PD decode: pull the prefilled blocks this worker lacks; on failure compute them."""
        pd = self.prep.pd
        if pd is None or not pd.remote_prefill:
            return
        own = self._prompt_keys
        run = 0
        while run < min(len(own), len(pd.block_keys)) and own[run] == pd.block_keys[run]:
            run += 1
        try:
            result = await self.worker.puller.pull(pd.source, own[:run], release=pd.lease)
            self.pulled_tokens = result.pulled * self.worker.block_size
        except TransferError as exc:
            log.warning(
                "request %s: KV pull from %s failed (%s); computing the prompt here",
                self.prep.request_id, pd.source, exc,
            )  # fmt: skip

    async def hand_off(self) -> dict[str, Any] | None:
        """PD prefill: hold the prompt's blocks for a decoder; its ``kv_transfer_params``."""
        pd = self.prep.pd
        if pd is None or not pd.remote_decode:
            return None
        w, p = self.worker, self.prep
        held = await w.hold_blocks(p.request_id, self._prompt_keys)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": w.name,
            **remote_address(w.settings.url),
            "remote_block_ids": held,
            "block_keys": held,
            "remote_request_id": p.request_id,
            "num_tokens": len(p.prompt_ids),
            "tp_size": 1,
        }

    def usage(self) -> Usage:
        """Token counts so far (final once the stream ended)."""
        n = len(self.prep.prompt_ids)
        cached = sum(self.cached.values())
        by_medium = dict(self.cached)
        # Blocks pulled from a peer for this request were hit in HBM: report them as remote.
        remote = min(self.pulled_tokens, by_medium.get(Medium.HBM.value, 0))
        if remote:
            by_medium[Medium.HBM.value] -= remote
            by_medium["remote"] = remote
        return Usage(
            prompt_tokens=n,
            completion_tokens=self.completion_tokens,
            total_tokens=n + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            cached_tokens_by_medium=by_medium,
        )

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Run the request; yields text deltas, the last one carrying the finish reason."""
        w, p = self.worker, self.prep
        req = Request(
            p.request_id,
            p.prompt_ids,
            p.sampling,
            w.root(p.cache_salt),
            w.block_size,
            frozenset(w.tokenizer.eos_token_ids),
        )
        try:
            w.scheduler.check(req)
        except RequestTooLargeError as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc
        t0 = time.perf_counter()
        if p.pd is not None:
            # Copied: the engine thread extends the request's chain as output blocks fill.
            self._prompt_keys = list(req.ensure_keys(len(p.prompt_ids)))
            await self.pull_prefill()
        last = t0
        first_at: float | None = None
        queue = w.engine.submit(req)
        decoder = w.tokenizer.incremental_decoder(p.prompt_ids)
        stops = p.stops
        hold = max((len(s) for s in stops), default=1) - 1
        text = ""
        sent = 0
        opened = False
        try:
            while True:
                ev = await self._next(queue)
                if ev.finished and first_at is None and w.engine.error is not None:
                    # The engine loop died with this request in it, before its first token:
                    # nothing was generated, and a 503 lets a router retry it elsewhere
                    # where a 200 would be an empty answer.
                    raise ApiError(
                        503, "the engine stopped before this request's first token",
                        type_="service_unavailable",
                    )  # fmt: skip
                if ev.token is not None:
                    now = time.perf_counter()
                    if first_at is None:
                        first_at = now
                        w.metrics.ttft.observe(now - t0)
                    last = now
                    self.completion_tokens = ev.num_output_tokens
                    if not (ev.finished and ev.token in req.eos_token_ids):
                        text += decoder.push(ev.token)
                self.cached = {m.value: ev.cached_tokens.get(m, 0) for m in MEDIA}
                reason = ev.finish_reason.value if ev.finish_reason else None
                if ev.finished and reason == FinishReason.ABORT.value:
                    reason = "abort"
                cut = _find_stop(text, stops, max(sent - hold, 0))
                if cut is not None:
                    text = text[:cut]
                    if not ev.finished:
                        w.engine.abort(req.request_id, FinishReason.STOP)
                    reason = FinishReason.STOP.value
                    self._done = True
                elif ev.finished:
                    text += decoder.finish()
                    self._done = True
                upto = len(text) if self._done else max(len(text) - hold, sent)
                # The first token always yields (empty while its text is held back):
                # a response's first byte marks the end of prefill.
                if upto > sent or self._done or not opened:
                    opened = True
                    yield Delta(text[sent:upto], reason if self._done else None)
                    sent = upto
                if self._done:
                    break
        finally:
            if not self._done:
                w.engine.abort(req.request_id)
                w.metrics.requests.labels(p.endpoint, "abort").inc()
            else:
                w.metrics.requests.labels(p.endpoint, reason or "stop").inc()
                self._record(t0, first_at, last)

    async def _next(self, queue: asyncio.Queue[TokenEvent]) -> TokenEvent:
        if self.is_disconnected is None:
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), _CANCEL_POLL_S)
            except TimeoutError:
                if await self.is_disconnected():
                    raise ClientGone(self.prep.request_id) from None

    def _record(self, t0: float, first_at: float | None, last: float) -> None:
        m = self.worker.metrics
        m.e2e.observe(last - t0)
        if first_at is not None and self.completion_tokens > 1:
            m.tpot.observe((last - first_at) / (self.completion_tokens - 1))
        m.prompt_tokens.inc(len(self.prep.prompt_ids))
        m.generation_tokens.inc(self.completion_tokens)
        for medium, n in self.cached.items():
            if n:
                m.prefix_hit_tokens.labels(medium).inc(n)


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    best: int | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def completion_chunk(p: Prepared, text: str, reason: str | None, created: int) -> dict[str, Any]:
    """A ``text_completion`` (stream chunk or whole response body without usage)."""
    return {
        "id": p.request_id,
        "object": "text_completion",
        "created": created,
        "model": p.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
    }


def chat_chunk(
    p: Prepared, delta: dict[str, Any], reason: str | None, created: int
) -> dict[str, Any]:
    """A ``chat.completion.chunk``."""
    return {
        "id": p.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": p.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
    }


#: What ends a request on the engine, if it has not ended, however its response ends.
Close = Callable[[], Awaitable[None]]


async def to_first_token(gen: Generation) -> tuple[AsyncIterator[Delta], Close]:
    """Run ``gen`` to its first token: a failure before it (a prompt too long, the
    engine gone) raises here, so the response keeps its status and a router can retry
    it elsewhere. Returns every delta, the first included, and the call that ends the
    request on the engine if it has not ended (call it however the response ends)."""
    deltas = gen.deltas()
    first = await anext(deltas, None)

    async def replay() -> AsyncIterator[Delta]:
        if first is not None:
            yield first
        async for d in deltas:
            yield d

    return replay(), deltas.aclose


async def stream_body(
    gen: Generation, deltas: AsyncIterator[Delta], close: Close
) -> AsyncIterator[bytes]:
    """SSE body of a streaming response (``deltas`` from :func:`to_first_token`),
    ``data: [DONE]`` last.

    NOTE: the headers and the opening chunk (chat's assistant role, completions'
    echo) go out with the first token, not before: the first byte then marks the end
    of prefill, which is what the gateway's TTFT and its retry-before-first-byte rule
    rely on, and a failure before it keeps its own status.
    """
    p = gen.prep
    created = now_s()
    chat = p.endpoint == "chat"
    opened = False
    try:
        async for d in deltas:
            if not opened:
                opened = True
                if chat:
                    yield sse(chat_chunk(p, {"role": "assistant", "content": ""}, None, created))
                elif p.echo_text:
                    yield sse(completion_chunk(p, p.echo_text, None, created))
            if not d.text and d.finish_reason is None:
                continue
            if chat:
                delta = {"content": d.text} if d.text else {}
                yield sse(chat_chunk(p, delta, d.finish_reason, created))
            else:
                yield sse(completion_chunk(p, d.text, d.finish_reason, created))
        if p.include_usage:
            chunk = (
                chat_chunk(p, {}, None, created) if chat else completion_chunk(p, "", None, created)
            )
            chunk["choices"] = []
            chunk["usage"] = gen.usage().model_dump()
            yield sse(chunk)
        yield sse("[DONE]")
    except ApiError as exc:
        yield sse({"error": exc.body()["error"]})
        yield sse("[DONE]")
    except ClientGone:
        pass  # nobody to send the rest to
    finally:
        await close()  # aborts the request on the engine if it did not end


async def full_body(gen: Generation, deltas: AsyncIterator[Delta] | None = None) -> dict[str, Any]:
    """The JSON body of a non-streaming response (from ``deltas``: the rest of
    ``gen.deltas()`` when a caller took its first)."""
    p = gen.prep
    parts: list[str] = []
    reason: str | None = None
    async for d in gen.deltas() if deltas is None else deltas:
        parts.append(d.text)
        reason = d.finish_reason or reason
    text = "".join(parts)
    created = now_s()
    if p.endpoint == "chat":
        body: dict[str, Any] = {
            "id": p.request_id,
            "object": "chat.completion",
            "created": created,
            "model": p.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
            ],
        }
    else:
        body = completion_chunk(p, p.echo_text + text, reason, created)
    body["usage"] = gen.usage().model_dump()
    if (params := await gen.hand_off()) is not None:
        body["kv_transfer_params"] = params
    return body


async def marked_body(gen: Generation) -> tuple[AsyncIterator[bytes], Close]:
    """A non-streaming body whose first byte marks the first token
    (``MARK_FIRST_TOKEN_HEADER``): one space once the first token is out, the JSON
    body when the request is done. Runs the request up to its first token before it
    returns, so that a failure before it (a prompt too long) keeps its status; one
    after it breaks the connection, which a router answers as a worker failure.
    Returns the body and the call that ends the request on the engine if it has not
    ended (call it however the response ends: the body may never be iterated).
    """
    deltas, close = await to_first_token(gen)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b" "
            with contextlib.suppress(ClientGone):  # nobody to send the body to
                yield json.dumps(await full_body(gen, deltas)).encode()
        finally:
            await close()  # aborts the request on the engine if it did not end

    return body(), close
