"""Gateway benchmarks: overhead vs direct, requests/s, and the routing decision's cost.

    python -m kvrouter.tools.gateway_bench [--json PATH] [--quick]

1. Overhead: the same small non-streaming request sent straight to a
   ``sim`` worker and through the gateway, alternating, sequentially;
   latency p50/p99 and the ratio gateway/direct.
2. Throughput: requests/s of one gateway process at a fixed concurrency,
   against the same load sent straight to the workers, in the same run.
3. Decision time: the gateway's ``Router.route`` in-process against a
   real Redis index holding 64 hosts' entries, for 8K- and 100K-token
   prompts; p50/p99 of each stage (tokenize, hash, lookup, score).
4. Chat turns: the same for a chat history's first turn (prompt cache
   cold) and its follow-up turn (history + one new message, cache warm).

Workers run with ``--runner sim --time-scale 0`` so that what is measured
is HTTP, routing and bookkeeping, not modeled compute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from rich.console import Console

from engine_worker.protocol import ChatCompletionRequest, CompletionRequest
from indexer.events import BlockStored, Event, EventBatch
from indexer.index.bitmap import BitmapIndex
from indexer.index.redis_index import RedisIndex
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.views import WorkerView
from indexer.wire import Keyspace
from kvrouter.embedded_redis import EmbeddedRedis, free_port
from kvrouter.gateway.app import _load_models
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import LoadTracker
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.routing import Router
from kvrouter.policy_factory import build_policy
from kvrouter.supervisor import Supervisor
from kvrouter.tools.table import grid, p50_p99_ms, percentile, write_json

MODEL = "tiny"


async def _latency(gateway: str, workers: list[str], n: int) -> dict[str, float]:
    body = {"model": MODEL, "prompt": "The quick brown fox " * 16, "max_tokens": 1}
    direct: list[float] = []
    via: list[float] = []
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(n):
            for url, out in ((workers[i % len(workers)], direct), (gateway, via)):
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                out.append(time.perf_counter() - t0)
                r.raise_for_status()
    return {
        **p50_p99_ms("direct", direct),
        **p50_p99_ms("gateway", via),
        "ratio_p50": percentile(via, 0.5) / percentile(direct, 0.5),
    }


async def _throughput(urls: list[str], concurrency: int, seconds: float) -> float:
    body = {"model": MODEL, "prompt": "Throughput probe " * 8, "max_tokens": 1}
    done = 0
    stop = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def loop(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop:
                r = await client.post(f"{urls[i % len(urls)]}/v1/completions", json=body)
                r.raise_for_status()
                done += 1
                i += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0)


def http_benchmarks(n: int, seconds: float, concurrency: int) -> dict[str, Any]:
    """Parts 1 and 2, with a real gateway and two sim workers as subprocesses."""
    py = [sys.executable, "-m", "kvrouter"]
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory() as logs:
        sup = Supervisor(Path(logs), env={"KVWORKER_HEARTBEAT_INTERVAL_S": "0.5"})
        try:
            wports = [free_port(), free_port()]
            workers = [
                sup.spawn(
                    f"w{i}",
                    [
                        *py,
                        "worker",
                        "--model",
                        MODEL,
                        "--runner",
                        "sim",
                        "--time-scale",
                        "0",
                        "--port",
                        str(p),
                        "--name",
                        f"w{i}",
                        "--redis",
                        redis.url,
                        "--max-num-seqs",
                        "256",
                        "--log-level",
                        "warning",
                    ],
                    f"http://127.0.0.1:{p}/health",
                )
                for i, p in enumerate(wports)
            ]
            gport = free_port()
            gateway = sup.spawn(
                "gateway",
                [*py, "serve", "--port", str(gport), "--model", MODEL, "--redis", redis.url,
                 "--log-level", "warning"],
                f"http://127.0.0.1:{gport}/ready",
            )  # fmt: skip
            sup.wait_healthy([*workers, gateway], 120)
            wurls = [f"http://127.0.0.1:{p}" for p in wports]
            gurl = f"http://127.0.0.1:{gport}"
            lat = asyncio.run(_latency(gurl, wurls, n))
            direct = asyncio.run(_throughput(wurls, concurrency, seconds))
            via = asyncio.run(_throughput([gurl], concurrency, seconds))
        finally:
            sup.stop_all()
    return {
        **lat,
        "direct_rps": direct,
        "gateway_rps": via,
        "rps_ratio": via / direct,
        "concurrency": concurrency,
    }


async def _decisions(tokens: int, hosts: int, n: int, redis_url: str) -> dict[str, Any]:
    """Part 3: route ``n`` requests of ``tokens`` tokens against ``hosts`` indexed hosts."""
    models = _load_models([MODEL])
    tok = models[MODEL].tokenizer
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "zeta", "eta"]
    text = " ".join(rng.choice(words) for _ in range(tokens))
    ids = tok.encode(text)
    while len(ids) > tokens:  # trim to the target length
        text = text[: int(len(text) * tokens / len(ids))]
        ids = tok.encode(text)
    keys = block_keys(ids, 16, root_parent(MODEL))
    index = RedisIndex(redis_url, Keyspace("bench"))
    # Host h holds a prefix of (h+1)/hosts of the chain, a quarter of it on DRAM.
    for h in range(hosts):
        held = keys[: max(1, len(keys) * (h + 1) // hosts)]
        cut = len(held) * 3 // 4
        events: list[Event] = [
            BlockStored(held[:cut], None, Medium.HBM),
            BlockStored(held[cut:], None, Medium.DRAM),
        ]
        await index.apply(EventBatch(f"host-{h}", 1, 1, time.time(), events))
    metrics = RouterMetrics(CollectorRegistry())
    directory = WorkerDirectory(metrics=metrics, block_size=16, models={MODEL})
    directory.views = {
        f"host-{h}": WorkerView(
            host=f"host-{h}",
            url="http://unused",
            model=MODEL,
            block_size=16,
            queued_prefill_tokens=rng.randrange(0, 20000),
            running=rng.randrange(0, 32),
        )
        for h in range(hosts)
    }
    router = Router(
        models=models, directory=directory, index=index, load=LoadTracker(),
        policy=build_policy("kv_ttft"), fallback=build_policy("least_load"),
        metrics=metrics, block_size=16, max_prompt_tokens=10**6,
    )  # fmt: skip
    body = CompletionRequest(model=MODEL, prompt=text, max_tokens=1)
    stages: dict[str, list[float]] = {"tokenize": [], "hash": [], "lookup": [], "score": []}
    totals: list[float] = []
    for i in range(n):
        routed = await router.route(body, f"r{i}")
        for k, v in routed.timings.items():
            stages[k].append(v)
        totals.append(sum(routed.timings.values()))
        assert routed.decision.matched_blocks > 0
    await index.close()
    out: dict[str, Any] = {"tokens": len(ids), "blocks": len(keys), "hosts": hosts}
    for k, values in {**stages, "total": totals}.items():
        out |= p50_p99_ms(k, values)
    return out


def decision_benchmarks(n: int) -> list[dict[str, Any]]:
    """Part 3 for 8K and 100K tokens, 64 hosts."""
    out = []
    with EmbeddedRedis() as redis:
        for tokens, runs in ((8192, n), (100_000, max(n // 5, 10))):
            out.append(asyncio.run(_decisions(tokens, 64, runs, redis.url)))
    return out


async def _chat_turns(
    tokens: int, hosts: int, n: int, redis_url: str, index_mode: str = "redis"
) -> list[dict[str, Any]]:
    """Part 4: a chat history of ~``tokens`` tokens, first turn (cold) and follow-up turn.

    The follow-up is the same history plus the answer and one new user message, routed
    right after the first turn warmed the router's prompt cache (cleared before each
    first turn, so both figures are what one conversation sees). ``index_mode``:
    ``redis`` looks up in the Redis index (a Lua call), ``mirror`` in the in-process
    table a gateway's :class:`~indexer.index.mirror.IndexMirror` serves lookups from,
    fed the same events.
    """
    models = _load_models([MODEL])
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "zeta", "eta"]
    turn_words = 400
    history: list[dict[str, str]] = []
    while len(history) * turn_words * 1.3 < tokens:  # ~1.3 tokens per word here
        role = "user" if len(history) % 2 == 0 else "assistant"
        history.append({"role": role, "content": " ".join(rng.choices(words, k=turn_words))})
    if history[-1]["role"] == "assistant":
        history.pop()
    first = ChatCompletionRequest.model_validate({"model": MODEL, "messages": history})
    follow = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [
            *history, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "And what comes next?"},
        ]}
    )  # fmt: skip
    index: RedisIndex | BitmapIndex = (
        RedisIndex(redis_url, Keyspace(f"chat{tokens}")) if index_mode == "redis" else BitmapIndex()
    )
    metrics = RouterMetrics(CollectorRegistry())
    directory = WorkerDirectory(metrics=metrics, block_size=16, models={MODEL})
    directory.views = {
        f"host-{h}": WorkerView(
            host=f"host-{h}", url="http://unused", model=MODEL, block_size=16,
            queued_prefill_tokens=rng.randrange(0, 20000), running=rng.randrange(0, 32),
        )
        for h in range(hosts)
    }  # fmt: skip
    router = Router(
        models=models, directory=directory, index=index, load=LoadTracker(),
        policy=build_policy("kv_ttft"), fallback=build_policy("least_load"),
        metrics=metrics, block_size=16, max_prompt_tokens=10**6,
    )  # fmt: skip
    keys = block_keys(router.tokenize(follow), 16, root_parent(MODEL))
    for h in range(hosts):
        held = keys[: max(1, len(keys) * (h + 1) // hosts)]
        events: list[Event] = [BlockStored(held, None, Medium.HBM)]
        await index.apply(EventBatch(f"host-{h}", 1, 1, time.time(), events))
    cache = router.prompts[MODEL].cache
    rows = []
    for label, body in (("first turn", first), ("follow-up turn", follow)):
        stages: dict[str, list[float]] = {"tokenize": [], "hash": [], "lookup": [], "score": []}
        totals: list[float] = []
        for i in range(n):
            cache.clear()
            if body is follow:
                await router.route(first, f"warm{i}")
            routed = await router.route(body, f"r{i}")
            for k, v in routed.timings.items():
                stages[k].append(v)
            totals.append(sum(routed.timings.values()))
        row: dict[str, Any] = {
            "turn": label, "tokens": routed.prompt_tokens, "hosts": hosts, "index": index_mode,
        }  # fmt: skip
        for k, values in {**stages, "total": totals}.items():
            row |= p50_p99_ms(k, values)
        rows.append(row)
    await index.close()
    return rows


def chat_turn_benchmarks(n: int) -> list[dict[str, Any]]:
    """Part 4 for 8K- and 100K-token histories, 64 hosts."""
    out = []
    with EmbeddedRedis() as redis:
        for tokens, runs in ((8192, n), (100_000, max(n // 5, 10))):
            for mode in ("redis", "mirror"):
                out += asyncio.run(_chat_turns(tokens, 64, runs, redis.url, mode))
    return out


def main() -> None:
    """Run everything and print (and optionally save) the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer requests, shorter runs")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n = 60 if args.quick else 300
    console = Console()
    http = http_benchmarks(n, 3.0 if args.quick else 10.0, 32)
    decisions = decision_benchmarks(40 if args.quick else 200)
    turns = chat_turn_benchmarks(40 if args.quick else 200)
    overhead = [
        ("latency p50 (ms)", f"{http['direct_p50_ms']:.2f}", f"{http['gateway_p50_ms']:.2f}",
         f"{http['ratio_p50']:.2f}"),
        ("latency p99 (ms)", f"{http['direct_p99_ms']:.2f}", f"{http['gateway_p99_ms']:.2f}",
         f"{http['gateway_p99_ms'] / http['direct_p99_ms']:.2f}"),
        (f"requests/s at concurrency {http['concurrency']}", f"{http['direct_rps']:.0f}",
         f"{http['gateway_rps']:.0f}", f"{http['rps_ratio']:.2f}"),
    ]  # fmt: skip
    columns = ("measure", "direct", "gateway", "gateway / direct")
    console.print(grid("gateway vs direct (sim workers, time scale 0)", columns, overhead))
    stages = ("tokenize", "hash", "lookup", "score", "total")
    timings = [
        (f"{row['tokens']} tok / {row['blocks']} blocks",
         *(f"{row[f'{s}_p50_ms']:.2f} / {row[f'{s}_p99_ms']:.2f}" for s in stages))
        for row in decisions
    ]  # fmt: skip
    title = "routing decision time, 64 hosts in a real Redis index (ms)"
    console.print(grid(title, ("prompt", *(f"{s} p50/p99" for s in stages)), timings))
    chat = [
        (f"{row['turn']}, {row['tokens']} tok, {row['index']}",
         *(f"{row[f'{s}_p50_ms']:.2f} / {row[f'{s}_p99_ms']:.2f}" for s in stages))
        for row in turns
    ]  # fmt: skip
    title = "chat turns: first (cold) and follow-up (prompt cache warm), 64 hosts (ms)"
    console.print(grid(title, ("turn", *(f"{s} p50/p99" for s in stages)), chat))
    if args.json:
        write_json(args.json, {"http": http, "decisions": decisions, "chat_turns": turns})


if __name__ == "__main__":
    main()
