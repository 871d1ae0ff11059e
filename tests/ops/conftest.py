"""One ``kvrouter up --runner sim`` cluster under a little traffic, shared by the live tests.

The traffic provokes the metrics that appear only after an event, so the
scrape test sees them: streaming and non-streaming completions (one reusing
a cached prefix), a 400, a 429 (a token-per-minute limit no normal request
reaches), a client that leaves mid-stream, a prefill/decode pair through the
workers' own API (KV transfer bytes, blocks, a lease) and a pull from a
peer that does not exist (a transfer failure).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvrouter.embedded_redis import free_port
from kvrouter.ops.exposition import Scrape
from tests.support.servers import free_port_run, wait_http

#: Far above what the test's requests ask, so only the deliberately huge one gets a 429.
TOKENS_PER_MINUTE = 1_000_000
PROMPT = (
    "The quick brown fox jumps over the lazy dog, again and again, until every KV block "
    "of sixteen tokens is full and the next request finds the whole prefix cached."
)


@dataclass(frozen=True, slots=True)
class Cluster:
    """A running ``kvrouter up`` and the addresses of its processes."""

    gateway: str
    indexer: str
    workers: tuple[str, ...]
    redis_url: str
    token: str
    log: Path


def _start(tmp: Path) -> tuple[subprocess.Popen[bytes], Cluster]:
    port, wport, iport = free_port(), free_port_run(2), free_port()
    log = tmp / "up.log"
    args = [
        sys.executable, "-m", "kvrouter", "up", "--workers", "2", "--runner", "sim",
        "--model", "tiny", "--port", str(port), "--worker-port", str(wport),
        "--indexer-port", str(iport), "--log-dir", str(tmp / "logs"), "--pd", "auto",
    ]  # fmt: skip
    env = {**os.environ, "KVROUTER_RATE_LIMIT_TPM": str(TOKENS_PER_MINUTE)}
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    gateway = f"http://127.0.0.1:{port}"
    workers = tuple(f"http://127.0.0.1:{wport + i}" for i in range(2))
    for url in (f"{gateway}/ready", *(f"{w}/health" for w in workers)):
        wait_http(url, timeout=120, proc=proc)
    found = re.search(r"redis://[^\s\"',)]+", log.read_text())
    assert found, log.read_text()
    token = (tmp / "logs" / "internal-token").read_text()
    cluster = Cluster(gateway, f"http://127.0.0.1:{iport}", workers, found.group(0), token, log)
    return proc, cluster


def _indexer_value(c: Cluster, name: str) -> float:
    text = httpx.get(f"{c.indexer}/metrics", timeout=10).text
    return Scrape.parse(text).value(name) or 0.0


def _wait_indexer(c: Cluster, name: str, at_least: float, timeout: float = 30.0) -> None:
    """Poll the indexer until ``name`` reaches ``at_least`` (it takes hosts every few s)."""
    deadline = time.monotonic() + timeout
    while _indexer_value(c, name) < at_least:
        assert time.monotonic() < deadline, f"indexer: {name} < {at_least} after {timeout}s"
        time.sleep(0.1)


def _traffic(c: Cluster) -> None:
    with httpx.Client(base_url=c.gateway, timeout=30) as http:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
        for _ in range(2):  # the second finds the prefix cached
            assert http.post("/v1/completions", json=body).status_code == 200
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        for prompt in (PROMPT, "A different prompt, streamed."):
            with http.stream("POST", "/v1/completions", json={**stream, "prompt": prompt}) as r:
                assert r.status_code == 200
                assert any(line == "data: [DONE]" for line in r.iter_lines())
        bad = {"model": "tiny", "prompt": "x", "max_tokens": -1}
        assert 400 <= http.post("/v1/completions", json=bad).status_code < 500
        huge = {"model": "tiny", "prompt": "x", "max_tokens": 2 * TOKENS_PER_MINUTE}
        assert http.post("/v1/completions", json=huge).status_code == 429
        # A client that leaves after its first token: status 499, a disconnect counted.
        gone = {**stream, "prompt": "Leave early.", "max_tokens": 400, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=gone) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    auth = {"authorization": f"Bearer {c.token}"}
    with httpx.Client(timeout=30, headers=auth) as http:
        prefill = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        r = http.post(f"{c.workers[0]}/v1/completions", json=prefill)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        decode = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
        assert http.post(f"{c.workers[1]}/v1/completions", json=decode).status_code == 200
        nowhere = {"source": "http://127.0.0.1:1", "keys": [12345, 67890]}  # keys it lacks
        r = http.post(f"{c.workers[1]}/kv/pull", json=nowhere)
        assert r.status_code == 502, r.text


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The running cluster, after the traffic; stopped (Ctrl-C) after the package's tests."""
    proc, c = _start(tmp_path_factory.mktemp("up"))
    try:
        _wait_indexer(c, "kvindex_ingest_hosts_owned", 2)
        _traffic(c)
        _wait_indexer(c, "kvindex_ingest_apply_lag_seconds_count", 1)
        yield c
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
