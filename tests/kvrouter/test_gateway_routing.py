"""Cache-aware routing end to end: gateway + real workers + indexer + real Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine_worker.chat_template import ChatTemplate
from engine_worker.tokenizer import load_tokenizer
from indexer.index.redis_index import RedisIndex
from indexer.keys import block_keys, root_parent
from tests.support.cluster import Cluster, run_cluster, run_ingester

MODEL = "tiny"
SPECULATIVE_TTL_S = 0.3
SYSTEM = (
    "You are the support assistant of a company that sells gardening tools. Answer in two "
    "sentences, be polite, never invent prices, and always suggest the online manual. "
) * 6


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    import redis as sync_redis

    sync_redis.Redis.from_url(redis_server.url).flushall()
    # A short speculative TTL, so that routing after it is explained by the index alone.
    gateway = {"speculative_ttl_s": SPECULATIVE_TTL_S}
    with (
        run_ingester(redis_server.url),
        run_cluster(redis_server.url, workers=2, gateway=gateway) as c,
    ):
        yield c


def chat(cluster: Cluster, messages: list[dict[str, str]], max_tokens: int = 8) -> httpx.Response:
    r = httpx.post(
        f"{cluster.gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        headers={"x-kvrouter-debug": "1"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def prompt_keys(messages: list[dict[str, str]]) -> list[int]:
    """The block keys the gateway computes for this chat (same tokenizer and template)."""
    tok = load_tokenizer(MODEL)
    text = ChatTemplate.for_tokenizer(tok).render(messages, add_generation_prompt=True)
    return block_keys(tok.encode(text, add_special_tokens=False), 16, root_parent(MODEL))


def wait_indexed(redis_url: str, messages: list[dict[str, str]], worker: str) -> int:
    """Poll the index until it credits ``worker`` with the conversation's prefix, and the
    gateway's speculative entry for it has expired; returns the credited blocks."""
    keys = prompt_keys(messages)
    started = time.monotonic()

    async def match() -> int:
        index = RedisIndex(redis_url)
        try:
            m = await index.match(keys)
        finally:
            await index.close()
        return m[worker].blocks if worker in m else 0

    while True:
        blocks = asyncio.run(match())
        if blocks and time.monotonic() - started > SPECULATIVE_TTL_S:
            return blocks
        assert time.monotonic() - started < 15, "the indexer never credited the prefix"
        time.sleep(0.05)


def test_a_multi_turn_conversation_returns_to_the_worker_holding_its_prefix(
    cluster: Cluster,
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "My rake broke after a week. What should I do?"},
    ]
    first = chat(cluster, messages)
    home = first.headers["x-kvrouter-worker"]
    for turn in range(3):
        assert wait_indexed(cluster.redis_url, messages, home) > 0
        messages += [
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"Follow-up question number {turn}: and the hoe?"},
        ]
        r = chat(cluster, messages)
        decision = json.loads(r.headers["x-kvrouter-decision"])
        usage = r.json()["usage"]
        assert r.headers["x-kvrouter-worker"] == home
        assert decision["worker"] == home
        assert decision["matched_blocks"] > 0
        assert decision["scores"][home]["cached_tokens"] >= decision["matched_blocks"] * 16
        # The worker really served the prefix from its cache, on HBM.
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(SYSTEM) // 8
        assert usage["cached_tokens_by_medium"]["hbm"] == cached
        first = r


def test_the_index_learns_prefixes_from_worker_events(cluster: Cluster) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Index probe: do you ship to Norway?"},
    ]
    worker = chat(cluster, messages).headers["x-kvrouter-worker"]
    blocks = wait_indexed(cluster.redis_url, messages, worker)
    # Everything but the block holding the last prompt token (computed again) is indexed.
    assert blocks >= len(prompt_keys(messages)) - 1
    text = httpx.get(f"{cluster.gateway}/metrics").text
    assert "kvrouter_cache_aware_routing 1.0" in text


def test_a_burst_sharing_one_system_prompt_spreads_over_the_workers(cluster: Cluster) -> None:
    system = SYSTEM.replace("gardening tools", "kitchen appliances") * 2

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> str:
                body = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Customer {i} asks about warranty terms."},
                    ],
                    "max_tokens": 16,
                    "temperature": 0,
                }
                r = await client.post(f"{cluster.gateway}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.headers["x-kvrouter-worker"]

            return list(await asyncio.gather(*(one(i) for i in range(12))))

    spread = Counter(asyncio.run(burst()))
    assert set(spread) == set(cluster.workers), spread
