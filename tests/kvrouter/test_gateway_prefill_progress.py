"""The gateway's own estimate of the prefill a worker is computing: a request whose prefix
is being prefilled waits out the rest of that prefill instead of recomputing the prefix
elsewhere, though no heartbeat shows the prefill (real Redis, indexer, sim workers)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from tests.support.cluster import run_cluster, run_ingester

PREFIX = list(range(1000, 1000 + 2000))
DEBUG = {"x-kvrouter-debug": "1"}
#: Modeled steps 20x slower than the H100 profile (a 2K-token prompt prefills in about
#: a second, in one step) and heartbeats 5 s apart: the gateway routes on views taken
#: before the prefill began, and only its own records say how far along it is.
SLOW = {"runner": "sim", "time_scale": 20.0, "hbm_blocks": 1024, "dram_blocks": 0,
        "max_model_len": 4096, "max_num_batched_tokens": 2048,
        "heartbeat_interval_s": 5.0, "heartbeat_ttl_s": 20.0}  # fmt: skip


def complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=DEBUG, timeout=120)


def test_a_request_sharing_a_prefix_in_prefill_waits_for_it_instead_of_recomputing(
    redis_url: str,
) -> None:
    with run_ingester(redis_url), run_cluster(redis_url, worker=SLOW) as cluster:
        first: dict[str, httpx.Response] = {}
        sender = threading.Thread(
            target=lambda: first.setdefault("r", complete(cluster.gateway, [*PREFIX, 1, 2]))
        )
        sender.start()
        # Well into the first request's prefill, well before its end.
        time.sleep(0.4)
        second = complete(cluster.gateway, [*PREFIX, 3, 4])
        sender.join()
        a = first["r"]
        assert a.status_code == 200, a.text
        assert second.status_code == 200, second.text
        holder = a.headers["x-kvrouter-worker"]
        prefill = json.loads(a.headers["x-kvrouter-decision"])["scores"][holder]["prefill_s"]
        decision: dict[str, Any] = json.loads(second.headers["x-kvrouter-decision"])
        scores = decision["scores"]
        # Counted whole, the first prefill made the holder look as far as recomputing
        # the prefix on the idle worker, and the prefix was computed twice.
        assert second.headers["x-kvrouter-worker"] == holder, scores
        assert scores[holder]["queue_s"] < 0.8 * prefill, (prefill, scores)
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1984
