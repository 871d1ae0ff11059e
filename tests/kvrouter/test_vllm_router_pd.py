"""vllm-router's PD mode (``--vllm-pd-disaggregation``, NIXL connector) drives our workers.

``vllm-router`` (the PyPI binary) sends the prompt to the prefill worker with
``kv_transfer_params: {"do_remote_decode": true, ...}``, ``max_tokens: 1`` and
``stream: false``, waits for the answer, then sends the client's request to the
decode worker with the ``kv_transfer_params`` the prefill worker returned,
unchanged. Our decoder pulls the blocks those parameters name, so the client
gets the colocated answer from a decoder that never computed the prompt.
docs/pd.md ("Interop with vllm-router's PD mode") has the observed flow and
what does not map (Mooncake, MoRI-IO, a dead prefill worker).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_worker.pd import parse_pd
from engine_worker.protocol import ApiError
from kvrouter.embedded_redis import free_port
from tests.support.servers import ServerProcess

VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")
BLOCK = 16

# What vllm-router 0.1.17 put in kv_transfer_params, as recorded by a logging proxy.
PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip
MOONCAKE_DECODE_PARAMS = {
    "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
    "remote_bootstrap_addr": "http://127.0.0.1:8998", "remote_engine_id": "engine-0",
}  # fmt: skip


def test_the_parameters_vllm_router_sends_parse_as_ours() -> None:
    """NIXL mode: the prefill request's nulls are ignored; the decode request is our own
    prefill answer passed through. Mooncake mode names no host or blocks: refused (400)."""
    pd = parse_pd(PREFILL_PARAMS)
    assert pd is not None
    assert pd.remote_decode
    assert not pd.remote_prefill
    answer = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
        "remote_host": "127.0.0.1", "remote_port": 8100, "remote_block_ids": [1, 2],
        "block_keys": [1, 2], "remote_request_id": "cmpl-1", "num_tokens": 40, "tp_size": 1,
    }  # fmt: skip
    pd = parse_pd(answer)
    assert pd is not None
    assert (pd.source, pd.block_keys, pd.lease) == ("http://127.0.0.1:8100", (1, 2), "cmpl-1")
    with pytest.raises(ApiError) as err:
        parse_pd(MOONCAKE_DECODE_PARAMS)
    assert err.value.status == 400
    assert "remote_host" in err.value.message


# -- the binary in front of two worker processes ---------------------------------------------


def worker_proc(tmp_path: Path, name: str, role: str) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        ["worker", "--model", "tiny", "--runner", "torch", "--role", role, "--name", name,
         "--port", str(port), "--hbm-blocks", "256", "--dram-blocks", "0",
         "--max-model-len", "2048", "--log-level", "warning"],
        health_url=f"{url}/health", log_path=tmp_path / f"{name}.log",
    )  # fmt: skip
    return proc, url


@contextmanager
def vllm_router_pd(tmp_path: Path, prefill: str, decode: str) -> Iterator[str]:
    """``vllm-router --vllm-pd-disaggregation`` on a free port; yields its URL."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--vllm-pd-disaggregation",
            "--prefill", prefill, "--decode", decode, "--policy", "round_robin",
            "--worker-startup-check-interval", "1", "--log-level", "debug"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    router = ServerProcess(args, program=[str(VLLM_ROUTER)], health_url=f"{url}/health",
                           log_path=tmp_path / "router.log", env={"NO_COLOR": "1"})  # fmt: skip
    router.start(60)
    try:
        yield url
    finally:
        router.stop()


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{name}\{{?{re.escape(labels)}\}}? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def blocks(url: str, direction: str) -> float:
    return metric(url, "kvworker_kv_transfer_blocks_total", f'direction="{direction}"')


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def answer(r: httpx.Response) -> tuple[str, dict[str, Any]]:
    """The text (completion, chat or SSE) and the usage of a response."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, data["usage"]
    parts: list[str] = []
    usage: dict[str, Any] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            parts += [c.get("text", "") for c in chunk.get("choices", [])]
            usage = chunk.get("usage") or usage
    return "".join(parts), usage


def prompt(tag: str) -> str:
    return f"{tag}: the history of the printing press begins with movable type, which " * 3


@pytest.mark.skipif(shutil.which(str(VLLM_ROUTER)) is None, reason="vllm-router is not installed")
def test_vllm_router_pd_mode_drives_our_prefill_and_decode_workers(tmp_path: Path) -> None:
    p, p_url = worker_proc(tmp_path, "p", "prefill")
    d, d_url = worker_proc(tmp_path, "d", "decode")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": prompt("completion")}),
        ("/v1/completions", {"prompt": prompt("stream"), "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt("chat")}]}),
    ]  # fmt: skip
    try:
        p.start()
        d.start()
        with vllm_router_pd(tmp_path, p_url, d_url) as router:
            for path, extra in cases:
                body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **extra}
                # The colocated answer, from a cold worker (the decoder never sees this prompt).
                reference, _ = answer(post(p_url, path, {**body, "stream": False}))
                received = blocks(d_url, "received")

                text, usage = answer(post(router, path, body))

                log = (tmp_path / "router.log").read_text(errors="replace")[-3000:]
                assert text == reference, (path, extra, log)
                pulled = blocks(d_url, "received") - received
                # The decoder pulled every full block of the prompt instead of computing it.
                assert pulled == usage["prompt_tokens"] // BLOCK > 0, (usage, log)
                assert usage["cached_tokens_by_medium"]["remote"] == pulled * BLOCK, usage
        # Nothing leaked: every lease claimed, no block referenced, nothing queued.
        for url in (p_url, d_url):
            stats = httpx.get(f"{url}/kv/stats", timeout=10).json()
            assert (stats["in_use_blocks"], stats["running"], stats["waiting"]) == (0, 0, 0), url
            assert metric(url, "kvworker_kv_leases") == 0
            assert metric(url, "kvworker_kv_leases_expired_total") == 0
        assert blocks(p_url, "sent") == blocks(d_url, "received")
        assert "kvworker_kv_transfer_failures_total{" not in httpx.get(f"{d_url}/metrics").text
    finally:
        p.stop()
        d.stop()
