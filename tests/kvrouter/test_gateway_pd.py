"""Prefill/decode disaggregation through the gateway, with real torch workers (tiny model)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine_worker.server import create_app as create_worker_app
from kvrouter.gateway.app import create_app as create_gateway_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.cluster import worker_settings
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app, wait_http

DEBUG = {"x-kvrouter-debug": "1"}
PROMPT = "The history of the printing press begins with movable type, which " * 3


@contextlib.contextmanager
def pd_cluster(pd: str, roles: dict[str, str]) -> Iterator[tuple[str, dict[str, str], Any]]:
    """Workers with the given roles (static discovery) behind a gateway in ``pd`` mode."""
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        stops: dict[str, contextlib.ExitStack] = {}
        for name, role in roles.items():
            port = free_port()
            own = contextlib.ExitStack()
            app = create_worker_app(worker_settings(name, port, None, role=role))
            urls[name] = own.enter_context(serve_app(app, port=port))
            stops[name] = stack.enter_context(own)
        gw_port = free_port()
        settings = RouterSettings(
            port=gw_port, models=["tiny"], workers=list(urls.values()), pd=pd,
            discovery_interval_s=0.1,
        )  # fmt: skip
        gw = stack.enter_context(serve_app(create_gateway_app(settings), port=gw_port))
        wait_http(f"{gw}/ready", timeout=30)
        yield gw, urls, stops


def complete(
    url: str, stream: bool = False, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def text_of(response: httpx.Response) -> str:
    if response.headers["content-type"].startswith("text/event-stream"):
        parts = []
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    parts.append(choice.get("text", ""))
        return "".join(parts)
    text: str = response.json()["choices"][0]["text"]
    return text


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{name}\{{?{re.escape(labels)}\}}? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def reference() -> str:
    """The colocated answer: one worker doing everything."""
    with pd_cluster("never", {"solo": "both"}) as (gw, _, _):
        r = complete(gw)
        assert r.status_code == 200, r.text
        return text_of(r)


@pytest.mark.parametrize("stream", [False, True])
def test_always_prefills_on_the_prefill_worker_and_decodes_on_the_decoder(
    reference: str, stream: bool
) -> None:
    with pd_cluster("always", {"p": "prefill", "d": "decode"}) as (gw, urls, _):
        r = complete(gw, stream, DEBUG)
        assert r.status_code == 200, r.text
        assert text_of(r) == reference
        decision = json.loads(r.headers["x-kvrouter-decision"])
        assert decision["pd"]["mode"] == "disaggregated"
        assert (decision["pd"]["prefill"], decision["pd"]["decode"]) == ("p", "d")
        # The hand-off happened on p, whose cache was cold (what the live replay counts).
        assert decision["pd"]["prefilled_on"] == "p"
        assert sum(decision["pd"]["prefill_cached_tokens_by_medium"].values()) == 0
        assert r.headers["x-kvrouter-worker"] == "d"
        sent = metric(urls["p"], "kvworker_kv_transfer_blocks_total", 'direction="sent"')
        received = metric(urls["d"], "kvworker_kv_transfer_blocks_total", 'direction="received"')
        assert sent == received > 0
        # The decoder's pull released the lease: nothing stays referenced on the prefill side.
        stats = httpx.get(f"{urls['p']}/kv/stats", timeout=10).json()
        assert stats["in_use_blocks"] == 0
        assert metric(gw, "kvrouter_pd_requests_total", 'mode="disaggregated"') == 1


def test_a_dead_prefill_worker_means_the_decoder_prefills_and_the_answer_is_the_same(
    reference: str,
) -> None:
    with pd_cluster("always", {"p": "prefill", "d": "decode"}) as (gw, urls, stops):
        stops["p"].close()  # the prefill worker is gone before the gateway notices
        r = complete(gw)
        assert r.status_code == 200, r.text
        assert text_of(r) == reference
        assert metric(urls["d"], "kvworker_kv_transfer_blocks_total", 'direction="received"') == 0


def test_never_and_auto_without_a_reason_to_split_stay_colocated(reference: str) -> None:
    with pd_cluster("never", {"p": "prefill", "d": "decode"}) as (gw, _, _):
        r = complete(gw, headers=DEBUG)
        assert text_of(r) == reference
        assert r.headers["x-kvrouter-worker"] == "p"
        assert "pd" not in json.loads(r.headers["x-kvrouter-decision"])
    # auto on idle workers: no decode to protect and a transfer to pay, so colocated.
    with pd_cluster("auto", {"a": "both", "b": "both"}) as (gw, _, _):
        r = complete(gw, headers=DEBUG)
        assert text_of(r) == reference
        pd = json.loads(r.headers["x-kvrouter-decision"])["pd"]
        assert pd["mode"] == "colocated"
        assert pd["reason"] == "cheaper_local"
        assert pd["predicted_s"]["split_transfer"] > 0
