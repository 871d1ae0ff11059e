"""KV transfer between real workers (torch runner, tiny model) over loopback HTTP."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from engine_worker.server import create_app
from engine_worker.settings import WorkerSettings
from indexer.events import BlockStored, EventBatch, decode_message
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.wire import EVENT_FIELD, Keyspace
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = list(range(40, 120))  # 80 token ids: 5 full blocks of 16
KEYS = block_keys(PROMPT, 16, root_parent("tiny"))


def settings(name: str, **kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "model": "tiny", "name": name, "hbm_blocks": 48, "dram_blocks": 16,
        "max_model_len": 256, "max_num_batched_tokens": 128, "internal_token": TOKEN,
        "heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0,
    }  # fmt: skip
    base.update(kw)
    return WorkerSettings(**base)


@contextlib.contextmanager
def workers(*configs: WorkerSettings) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for config in configs:
            port = free_port()
            config = config.model_copy(update={"port": port})
            urls.append(stack.enter_context(serve_app(create_app(config), port=port)))
        yield urls


@pytest.fixture(scope="module")
def trio() -> Iterator[list[str]]:
    with workers(settings("a"), settings("b"), settings("c")) as urls:
        yield urls


def complete(url: str, prompt: list[int] = PROMPT, max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def pull(url: str, source: str, keys: list[int] = KEYS, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", AUTH)
    body = {"source": source, "keys": keys}
    return httpx.post(f"{url}/kv/pull", json=body, headers=headers, timeout=60)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^kvworker_{name}\{{?{re.escape(labels)}\}}? (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def hbm_keys(url: str) -> set[int]:
    blocks = httpx.get(f"{url}/kv/keys", headers=AUTH, timeout=10).json()["blocks"]
    return set(blocks.get(Medium.HBM.value, []))


def test_a_pulled_prefix_is_used_and_the_output_is_the_same_token_for_token(
    trio: list[str],
) -> None:
    a, b, c = trio
    reference = complete(a)
    assert set(KEYS) <= hbm_keys(a)
    r = pull(b, a)
    assert r.status_code == 200, r.text
    result = r.json()
    assert (result["requested"], result["present"], result["pulled"]) == (5, 0, 5)
    assert set(KEYS) <= hbm_keys(b)
    # B decodes from A's blocks: the same greedy tokens as A and as C, which computed
    # everything itself, and it reports the prefix as cached.
    pooled = complete(b)
    fresh = complete(c)
    assert pooled["choices"][0]["text"] == reference["choices"][0]["text"]
    assert fresh["choices"][0]["text"] == reference["choices"][0]["text"]
    # Every block hit: the last one is still computed (its last token must be sampled).
    assert pooled["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(a, "kv_transfer_blocks_total", 'direction="sent"') == 5
    assert metric(b, "kv_transfer_blocks_total", 'direction="received"') == 5
    view = httpx.get(f"{b}/worker/view", timeout=10).json()
    assert view["transfer_bandwidth"] > 0
    # Pulling again moves nothing: B holds the run.
    again = pull(b, a).json()
    assert (again["present"], again["pulled"]) == (5, 0)


def test_transfers_need_the_internal_token(trio: list[str]) -> None:
    a, b, _ = trio
    complete(a)
    r = httpx.post(f"{a}/kv/blocks", json={"keys": KEYS}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert pull(b, a, headers={}).status_code == 401
    with workers(settings("other", internal_token="another")) as (other,):
        prompt = list(range(200, 248))
        complete(other, prompt)
        before = hbm_keys(b)
        r = pull(b, other, keys=block_keys(prompt, 16, root_parent("tiny")))
        # ``other`` refuses B's token: nothing imported, the failure counted by reason.
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "auth"
        assert hbm_keys(b) == before
        assert metric(b, "kv_transfer_failures_total", 'reason="auth"') >= 1


def test_blocks_of_another_kv_layout_are_refused(trio: list[str]) -> None:
    _, b, _ = trio
    with workers(settings("half", kv_dtype="float16")) as (half,):
        prompt = list(range(300, 340))
        complete(half, prompt)
        other = block_keys(prompt, 16, root_parent("tiny"))
        r = pull(b, half, keys=other[:2])
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "dtype"
        assert not set(other[:2]) & hbm_keys(b)


def test_pulled_blocks_are_announced_to_the_index(redis_url: str) -> None:
    with workers(settings("src"), settings("dst", redis_url=redis_url)) as (src, dst):
        complete(src)
        assert pull(dst, src).status_code == 200
        client = redis.Redis.from_url(redis_url)
        stored: set[int] = set()
        try:
            for _ in range(100):
                entries: Any = client.xrange(Keyspace().events("dst"))
                for _, fields in entries:
                    message = decode_message(fields[EVENT_FIELD])
                    if isinstance(message, EventBatch):
                        for event in message.events:
                            if isinstance(event, BlockStored) and event.medium is Medium.HBM:
                                stored.update(event.keys)
                if set(KEYS) <= stored:
                    break
                time.sleep(0.05)
        finally:
            client.close()
        assert set(KEYS) <= stored
