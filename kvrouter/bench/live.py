"""Online replay: a trace against a running gateway, with the offline simulator's report.

Each trace record becomes a streaming ``/v1/completions`` request at its
(time-scaled) arrival: the prompt as token ids (the same pseudo-random
tokens the simulator uses, :class:`~kvrouter.bench.trace.PromptFactory`),
``max_tokens`` = the record's output length with ``ignore_eos``. The
records (first token, finish, worker from ``x-kvrouter-worker``, cached
tokens per medium from the usage chunk) feed the same
:func:`~kvrouter.bench.report.summarize` as the simulator's. With the
cluster's Redis, workers are found through their heartbeats: their step
time counters give busy time per worker (load imbalance) and their
capacities give the oracle bound.

A replay through another router (``kvrouter bench compare``) passes
``prompt`` (text prompts, :mod:`kvrouter.bench.text_prompts`) and the
workers' URLs instead of Redis; such a router sends no ``x-kvrouter-worker``
header, so its records name worker ``"?"`` and busy time still comes from
the workers themselves.

With ``decisions=True`` every request asks our gateway for its decision header
(``x-kvrouter-debug``). A request it split into prefill and decode (PD) then
records the worker that prefilled it (``prefill_worker``) and, as its cached
tokens, what that worker's cache served of the prompt, as the offline
simulator counts a hand-off (the decoder's usage counts the blocks it pulled
as hits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import redis.asyncio as aioredis

from indexer.keys import root_parent
from indexer.media import Medium
from indexer.views import WorkerView
from indexer.wire import Keyspace, decode_view
from kvrouter.bench.oracle import OracleBound, trace_bound
from kvrouter.bench.report import RequestRecord
from kvrouter.bench.trace import PromptFactory, TraceRecord, arrival_times

__all__ = ["LiveResult", "cluster_views", "replay_live", "served_by_medium"]

log = logging.getLogger(__name__)

_STEP_SUM = re.compile(rb"^kvworker_engine_step_seconds_sum ([0-9.eE+-]+)$", re.M)


@dataclass(slots=True)
class LiveResult:
    """One live replay."""

    records: list[RequestRecord]
    busy_s: dict[str, float]
    oracle: OracleBound | None
    errors: int


async def cluster_views(
    redis_url: str, keyspace: Keyspace | None = None, *, model: str | None = None
) -> list[WorkerView]:
    """Workers with a live heartbeat in the registry (those serving ``model``, if given)."""
    ks = keyspace or Keyspace()
    client = aioredis.Redis.from_url(redis_url)
    try:
        hosts = [h.decode() for h in await client.hkeys(ks.hosts)]  # type: ignore[union-attr]
        beats: list[bytes | None] = [await client.get(ks.heartbeat(h)) for h in hosts]  # type: ignore[misc]
    finally:
        await client.aclose()
    views = [decode_view(b) for b in beats if b is not None]
    return [v for v in views if model is None or v.model == model]


async def _busy(http: httpx.AsyncClient, urls: Mapping[str, str]) -> dict[str, float]:
    """Step time so far per worker (host -> URL) that answers; a dead worker's heartbeat
    outlives it by up to its TTL, so one that does not answer is left out, not fatal."""
    out = {}
    for host, url in urls.items():
        try:
            r = await http.get(f"{url}/metrics", timeout=10)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("live replay: worker %s at %s does not answer (%s); left out", host,
                        url, exc)  # fmt: skip
            continue
        m = _STEP_SUM.search(r.content)
        out[host] = float(m.group(1)) if m else 0.0
    return out


def served_by_medium(by: Mapping[str, Any]) -> tuple[int, int, int]:
    """A worker's ``cached_tokens_by_medium`` as a record's (hbm, dram, ssd) tokens.

    Tokens pulled from a peer (``remote``, cross-node pooling) count as HBM hits, as the
    offline simulator counts them: the blocks land in the worker's HBM before its
    prefill, and the prompt's ``cached_tokens`` includes them. Leaving them out made a
    pooling router's live hit rate look lower than the simulator's for the same
    choices.
    """
    hbm = int(by.get("hbm", 0)) + int(by.get("remote", 0))
    return hbm, int(by.get("dram", 0)), int(by.get("ssd", 0))


def _pd_handoff(header: str | None) -> tuple[str, tuple[int, int, int]] | None:
    """From a decision header: the worker that prefilled a split request and what its
    cache served (hbm, dram, ssd); None when the request was not handed off."""
    if not header:
        return None
    try:
        pd = json.loads(header).get("pd") or {}
        host = pd.get("prefilled_on")
        if not isinstance(host, str):
            return None
        return host, served_by_medium(pd.get("prefill_cached_tokens_by_medium") or {})
    except (ValueError, TypeError, AttributeError):
        return None


async def _one(
    http: httpx.AsyncClient, gateway: str, body: dict[str, object], rec: RequestRecord,
    t0: float, headers: dict[str, str],
) -> bool:  # fmt: skip
    async with http.stream(
        "POST", f"{gateway}/v1/completions", json=body, headers=headers
    ) as resp:  # fmt: skip
        if resp.status_code != 200:
            await resp.aread()
            return False
        rec.worker = resp.headers.get("x-kvrouter-worker", "?")
        handoff = _pd_handoff(resp.headers.get("x-kvrouter-decision"))
        if not body.get("stream"):
            await resp.aread()  # a client sees no first token
            _take_usage(rec, resp.json().get("usage"))
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return False
                if chunk.get("choices") and rec.first_token_s is None:
                    rec.first_token_s = time.perf_counter() - t0
                _take_usage(rec, chunk.get("usage"))
        rec.finish_s = time.perf_counter() - t0
    if handoff is not None:
        rec.prefill_worker, rec.cached_tokens = handoff
    return True


def _take_usage(rec: RequestRecord, usage: dict[str, Any] | None) -> None:
    """A response's ``usage`` (when it has one) into ``rec``."""
    if usage:
        rec.output_tokens = usage["completion_tokens"]
        rec.cached_tokens = served_by_medium(usage.get("cached_tokens_by_medium") or {})


async def replay_live(
    trace: Sequence[TraceRecord],
    gateway: str,
    *,
    model: str,
    time_scale: float = 1.0,
    block_size: int = 16,
    vocab_size: int = 32000,
    redis_url: str | None = None,
    api_key: str | None = None,
    progress: Callable[[int], None] | None = None,
    prompt: Callable[[TraceRecord], str | list[int]] | None = None,
    worker_urls: Mapping[str, str] | None = None,
    decisions: bool = False,
    stream: bool = True,
) -> LiveResult:
    """Replay ``trace`` against ``gateway`` in real time (arrivals divided by ``time_scale``).

    ``prompt`` replaces the token-id prompts (text, say); ``worker_urls`` (host -> URL)
    names the workers whose busy time to read when there is no ``redis_url``;
    ``decisions`` asks our gateway for its decision headers (PD hand-offs, above).
    ``stream=False`` sends non-streaming requests: each record has its end and its
    usage, no first token (a client sees none).
    """
    factory = PromptFactory(block_size, root_parent(model), vocab_size=vocab_size)
    make_prompt = prompt or factory.tokens
    arrivals = arrival_times(trace, time_scale)
    views = await cluster_views(redis_url, model=model) if redis_url else []
    urls = dict(worker_urls) if worker_urls is not None else {v.host: v.url for v in views}
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if decisions:
        headers["x-kvrouter-debug"] = "1"
    records = [RequestRecord(i, "?", arrivals[i], rec.input_length) for i, rec in enumerate(trace)]
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        before = await _busy(http, urls)
        views = [v for v in views if v.host in before]
        t0 = time.perf_counter()

        async def run(i: int) -> bool:
            rec = trace[i]
            delay = arrivals[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body: dict[str, object] = {
                "model": model,
                "prompt": make_prompt(rec),
                "max_tokens": max(rec.output_length, 1),
                "ignore_eos": True,
                "temperature": 0,
                "stream": stream,
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
            try:
                ok = await _one(http, gateway, body, records[i], t0, headers)
            except httpx.HTTPError:
                ok = False
            if progress is not None:
                progress(1)
            return ok

        results = await asyncio.gather(*(run(i) for i in range(len(trace))))
        after = await _busy(http, {h: u for h, u in urls.items() if h in before})
    busy = {h: after[h] - before.get(h, 0.0) for h in after}
    oracle = None
    if views:
        total = sum(sum(v.kv_capacity_blocks.get(m, 0) for m in Medium) for v in views)
        oracle = trace_bound(
            trace, total, block_size, model, vocab_size=vocab_size, time_scale=time_scale
        )
    return LiveResult(records, busy, oracle, errors=sum(not ok for ok in results))
