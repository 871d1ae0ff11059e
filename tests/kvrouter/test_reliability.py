"""Issue 11's findings, each reproduced against real servers: leaks, auth, limits, bad ids.

Workers here are in-process ``sim`` workers on loopback (the findings live in the
HTTP and accounting layers, not in the model); the tests that must kill or signal
a process are in ``test_reliability_procs.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import tracemalloc
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from engine_worker.kv_layout import KVLayout
from engine_worker.publisher import EventPublisher
from engine_worker.server import create_app as create_worker_app
from engine_worker.ssd_tier import SSDTier
from engine_worker.tokenizer import load_tokenizer
from indexer.events import BlockStored, EventBatch, decode_message
from indexer.media import Medium
from indexer.views import WorkerView
from indexer.wire import EVENT_FIELD, Keyspace, decode_view, encode_view
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.app import create_app as create_gateway_app
from kvrouter.gateway.discovery import AllowedWorkers, WorkerDirectory
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.settings import RouterSettings
from policies.base import Decision
from tests.support.cluster import worker_settings
from tests.support.servers import serve_app

MODEL = "tiny"
KS = Keyspace()

# Slow prefill: 256-token steps of ~0.2 s (the sim profile x20), so 20 distinct
# 1,500-token prompts keep two workers busy for ~10 s, while an abort still lands
# within one step.
SLOW: dict[str, Any] = {
    "runner": "sim", "time_scale": 20.0, "max_num_batched_tokens": 256, "max_num_seqs": 64,
    "hbm_blocks": 4096, "max_model_len": 8192,
}  # fmt: skip


def start_workers(stack: ExitStack, redis_url: str | None, n: int, **kw: Any) -> dict[str, str]:
    urls = {}
    for i in range(n):
        port = free_port()
        settings = worker_settings(f"w{i}", port, redis_url, **{**SLOW, **kw})
        urls[f"w{i}"] = stack.enter_context(serve_app(create_worker_app(settings), port=port))
    return urls


def start_gateway(stack: ExitStack, expect: int, **kw: Any) -> str:
    """A gateway with ``kw`` settings, once it sees ``expect`` workers."""
    base: dict[str, Any] = {
        "port": free_port(), "models": [MODEL], "discovery_interval_s": 0.1,
        "load_sync_interval_s": 0.1,
    }  # fmt: skip
    settings = RouterSettings(**{**base, **kw})
    url = stack.enter_context(serve_app(create_gateway_app(settings), port=settings.port))
    deadline = time.monotonic() + 30
    while expect and httpx.get(f"{url}/ready").json().get("workers") != expect:
        assert time.monotonic() < deadline, "workers not discovered"
        time.sleep(0.05)
    return url


def prompt(i: int, n: int = 1500) -> list[int]:
    return [(1000 + 7 * i + j) % 30000 for j in range(n)]


async def hang_up_before_first_byte(url: str, body: dict[str, Any], wait_s: float) -> bytes:
    """A real client: send the request, wait ``wait_s``, close the socket; returns what
    arrived by then."""
    m = re.match(r"http://([^:/]+):(\d+)", url)
    assert m is not None
    reader, writer = await asyncio.open_connection(m.group(1), int(m.group(2)))
    data = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    got = b""
    deadline = time.monotonic() + wait_s
    with suppress(TimeoutError):
        while (left := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                break
            got += chunk
    writer.close()
    await writer.wait_closed()
    return got


def published_in_flight(redis_url: str) -> dict[str, int]:
    """Each worker's in-flight count as its heartbeat in Redis publishes it."""
    client = redis.Redis.from_url(redis_url)
    try:
        out = {}
        hosts: Any = client.hkeys(KS.hosts)
        for h in hosts:
            raw: Any = client.get(KS.heartbeat(h.decode()))
            if raw is not None:
                view = decode_view(raw)
                out[view.host] = view.in_flight
        return out
    finally:
        client.close()


def gauges(text: str, name: str) -> dict[str, float]:
    """A per-worker gauge's values in a Prometheus scrape."""
    pattern = rf'^{name}\{{worker="([^"]+)"\}} ([0-9.e+-]+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def wait_until(check: Any, timeout: float, every: float = 0.05) -> float:
    """Seconds until ``check()`` is true; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not true after {timeout} s: {check.__doc__}"
        time.sleep(every)
    return time.monotonic() - t0


# -- 1 and 9: clients that leave before their first byte -----------------------------------------


def test_clients_that_hang_up_before_the_first_byte_leave_no_load_anywhere(
    redis_url: str,
) -> None:
    """Findings 1 and 9: 20 streaming clients close their sockets while their prompts are
    still queued for prefill. Within a heartbeat TTL of the last one leaving, with no other
    traffic, every worker publishes 0 in flight (its requests were aborted, not generated
    for nobody) and the gateway counts 0 for every worker (its gauge too, not the last
    value), and no replica holds a load lease with a count."""
    with ExitStack() as stack:
        workers = start_workers(stack, redis_url, 2, heartbeat_interval_s=0.2)
        gw = start_gateway(stack, 2, redis_url=redis_url)

        async def clients() -> list[bytes]:
            bodies = [
                {"model": MODEL, "prompt": prompt(i), "max_tokens": 200, "stream": True}
                for i in range(20)
            ]
            return await asyncio.gather(*(hang_up_before_first_byte(gw, b, 1.0) for b in bodies))

        got = asyncio.run(clients())
        assert got == [b""] * 20  # nobody had a byte: all left before their first one

        def nothing_in_flight() -> bool:
            """workers publish 0 in flight and the gateway counts 0 in flight, held, queued"""
            published = published_in_flight(redis_url)
            if set(published) != set(workers) or any(published.values()):
                return False
            scrape = httpx.get(f"{gw}/metrics").text
            counted = gauges(scrape, "kvrouter_worker_in_flight")
            held = gauges(scrape, "kvrouter_worker_held_blocks")
            queued = gauges(scrape, "kvrouter_worker_queued_prefill_tokens")
            idle = not any([*counted.values(), *held.values(), *queued.values()])
            return set(counted) >= set(workers) and idle

        wait_until(nothing_in_flight, timeout=2.0)
        client = redis.Redis.from_url(redis_url)
        leases = [client.hgetall(k) for k in client.scan_iter(KS.load("r:*"))]
        client.close()
        assert not any(leases)
        for url in workers.values():
            view = httpx.get(f"{url}/worker/view").json()
            assert (view["running"], view["waiting"]) == (0, 0)
            scrape = httpx.get(f"{url}/metrics").text
            assert re.search(r"^kvworker_num_requests_running 0\.0$", scrape, re.M)
            assert re.search(r"^kvworker_num_requests_waiting 0\.0$", scrape, re.M)


def test_an_idle_worker_publishes_aborted_requests_at_once(redis_url: str) -> None:
    """Finding 9 on its own: requests aborted while the engine has nothing else to step
    leave the heartbeat view, /worker/view and the gauges at once, not at the next step."""
    with ExitStack() as stack:
        (url,) = start_workers(stack, redis_url, 1, heartbeat_interval_s=0.2).values()

        async def clients() -> list[bytes]:
            bodies = [
                {"model": MODEL, "prompt": prompt(i, 1000), "max_tokens": 50, "stream": True}
                for i in range(6)
            ]
            return await asyncio.gather(*(hang_up_before_first_byte(url, b, 0.5) for b in bodies))

        # The worker sends its headers at once; no client had a token when it left.
        assert not any(b"data:" in got for got in asyncio.run(clients()))

        def idle() -> bool:
            """the heartbeat and /worker/view show the worker idle"""
            view = httpx.get(f"{url}/worker/view").json()
            return published_in_flight(redis_url) == {"w0": 0} and view["in_flight"] == 0

        wait_until(idle, timeout=2.0)


# -- 2 and 8: who may call what ----------------------------------------------------------------


def test_a_worker_with_a_token_serves_nothing_but_health_without_it() -> None:
    port = free_port()
    settings = worker_settings("tok-w", port, None, internal_token="s3cret", runner="sim")
    bearer = {"authorization": "Bearer s3cret"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    with serve_app(create_worker_app(settings), port=port) as url:
        for method, path in [
            ("GET", "/kv/keys"), ("GET", "/kv/stats"), ("GET", "/v1/models"),
            ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("GET", "/worker/view"), ("POST", "/kv/pull"), ("GET", "/kv/endpoint"),
        ]:  # fmt: skip
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "s3cret"}):
                r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["code"] == "invalid_internal_token"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/kv/keys", headers=bearer).json()["host"] == "tok-w"
        r = httpx.post(f"{url}/v1/completions", json=body, headers=bearer, timeout=30)
        assert r.status_code == 200
    port = free_port()
    settings = worker_settings(
        "tok-m", port, None, internal_token="s3cret", runner="sim", metrics_require_token=True
    )
    with serve_app(create_worker_app(settings), port=port) as url:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=bearer).status_code == 200


def test_a_gateway_with_the_internal_token_reaches_static_workers_that_need_it() -> None:
    with ExitStack() as stack:
        urls = start_workers(stack, None, 1, internal_token="s3cret", time_scale=0.0)
        gw = start_gateway(stack, 1, workers=list(urls.values()), internal_token="s3cret")
        body = {"model": MODEL, "prompt": prompt(0, 40), "max_tokens": 3}
        r = httpx.post(f"{gw}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text


def test_the_gateway_authenticates_before_it_reads_the_body() -> None:
    """Finding 8: no key means 401, whatever the body (bad JSON, over the size limit)."""
    with ExitStack() as stack:
        gw = start_gateway(stack, 0, api_keys=["k1"], max_request_bytes=4096, workers=[])
        url = f"{gw}/v1/completions"
        for content in (b"{not json", b"x" * 100_000):
            r = httpx.post(url, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        auth = {"authorization": "Bearer k1", "content-type": "application/json"}
        assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
        assert httpx.post(url, content=b"x" * 100_000, headers=auth).status_code == 413
        assert httpx.get(f"{gw}/health").status_code == 200
        scrape = httpx.get(f"{gw}/metrics").text
        assert re.search(r"^kvrouter_auth_failures_total 2\.0$", scrape, re.M)


def test_ssd_tier_files_are_private_and_symlinks_are_not_followed(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    tier = SSDTier(tmp_path / "ssd", layout, 8)
    tier.close()
    for name in os.listdir(tmp_path / "ssd"):
        mode = (tmp_path / "ssd" / name).stat().st_mode & 0o777
        assert mode == 0o600, (name, oct(mode))
    assert (tmp_path / "ssd").stat().st_mode & 0o077 == 0
    # A file made world-readable by an older version is tightened when reopened.
    victim = tmp_path / "ssd" / os.listdir(tmp_path / "ssd")[0]
    victim.chmod(0o644)
    SSDTier(tmp_path / "ssd", layout, 8).close()
    assert victim.stat().st_mode & 0o777 == 0o600
    # A symlink planted where a tier file goes is refused, and its target is untouched.
    target = tmp_path / "elsewhere"
    target.write_bytes(b"precious")
    planted = tmp_path / "planted"
    planted.mkdir()
    for name in os.listdir(tmp_path / "ssd"):
        (planted / name).symlink_to(target)
        with pytest.raises(OSError, match="symbolic links"):
            SSDTier(planted, layout, 8)
        (planted / name).unlink()
    assert target.read_bytes() == b"precious"


async def test_discovery_refuses_workers_outside_the_allowed_networks(redis_url: str) -> None:
    """Finding 8: a heartbeat is a value in Redis; with allowed networks set, one that points
    the gateway at an address outside them is refused (metric), the others are kept."""
    client = aioredis.Redis.from_url(redis_url)
    views = {
        "inside": "http://10.1.2.3:8100", "named": "http://worker-0.workers.svc:8100",
        "outside": "http://169.254.169.254:80", "sneaky": "http://10.1.2.3.evil.example:8100",
    }  # fmt: skip
    for host, url in views.items():
        await client.hset(KS.hosts, host, 1)
        view = WorkerView(host=host, url=url, model=MODEL, block_size=16, ts=time.time())
        await client.set(KS.heartbeat(host), encode_view(view), ex=30)
    metrics = RouterMetrics(CollectorRegistry())
    directory = WorkerDirectory(
        metrics=metrics, block_size=16, models={MODEL}, client=client, keyspace=KS,
        allowed=AllowedWorkers.parse(["10.0.0.0/8", "worker-0.workers.svc"]),
    )  # fmt: skip
    await directory.refresh()
    await client.aclose()
    assert set(directory.views) == {"inside", "named"}
    refused = metrics.worker_refused.labels("outside", "address")._value.get()
    assert refused == 1
    with pytest.raises(ValueError, match="not a host name or a network"):
        RouterSettings(allowed_workers=["10.0.0.0/33"])


# -- 3: the publisher's shutdown race -----------------------------------------------------------


async def test_stopping_the_publisher_mid_send_sends_each_batch_once(redis_url: str) -> None:
    """Finding 3: ``stop()`` while the task's chunk is in flight (Redis paused for writes)
    must neither send that chunk again nor pop past the end of the outbox."""
    client = aioredis.Redis.from_url(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    pub = EventPublisher(client, "h", keyspace=KS, max_delay_s=0.0)
    pub.start()
    await admin.client_pause(400, all=False)  # writes wait 400 ms; reads go on
    for i in range(5):
        pub.put_events([BlockStored([1000 + i], None, Medium.HBM)])
    await asyncio.sleep(0.1)  # the task's XADDs are now waiting on the pause
    await pub.stop(flush_timeout=5.0)
    entries: Any = await admin.xrange(KS.events("h"))
    seqs = []
    for _, fields in entries:
        msg = decode_message(fields[EVENT_FIELD])
        assert isinstance(msg, EventBatch)
        seqs.append(msg.seq)
    assert seqs
    assert sorted(seqs) == list(range(1, len(seqs) + 1)), seqs
    assert pub.stats.batches_sent == len(seqs)
    assert pub.stats.buffered == 0
    await client.aclose()
    await admin.aclose()


# -- 6: session affinity memory --------------------------------------------------------------


def test_session_affinity_memory_is_bounded_whatever_the_ids() -> None:
    """Finding 6: 64 KiB session ids cost what short ones do, and the count is capped."""
    aff = SessionAffinity(max_sessions=1000)

    def sid(i: int) -> str:  # a fresh 64 KiB string each time, as each request brings
        return f"{i:08d}" + "x" * 65536

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(1500):
        aff.record(sid(i), f"w{i % 4}", now=1.0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 400 * 1000, grown  # ~150-250 bytes per entry, nothing per id byte
    assert len(aff) == 1000
    d = Decision("w3", "p", {f"w{i}": {"total": 1.0} for i in range(4)}, lower_is_better=True)
    assert aff.prefer(sid(1499), d, now=2.0) == "w3"
    assert aff.prefer(sid(1498), d, now=2.0) == "w2"  # within slack: the session's worker
    # Expired entries go as new ones come.
    aff.record("late", "w0", now=1.0 + aff.ttl_s + 1)
    assert len(aff) == 1


# -- 7: token ids ------------------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_are_a_400_everywhere() -> None:
    with ExitStack() as stack:
        workers = start_workers(stack, None, 1, time_scale=0.0)
        gw = start_gateway(stack, 1, workers=list(workers.values()))
        vocab = load_tokenizer(MODEL).vocab_size
        for url in (gw, workers["w0"]):
            # 20 tokens: the bad id sits in the first full block, which the gateway hashes.
            for bad_id in (2**32 + 5, 2**63, vocab, -1):
                bad = [*range(1, 10), bad_id, *range(10, 20)]
                body = {"model": MODEL, "prompt": bad, "max_tokens": 2}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                assert r.status_code == 400, (url, bad_id, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
            body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [2**40]}
            assert httpx.post(f"{url}/v1/completions", json=body).status_code == 400
        scrape = httpx.get(f"{workers['w0']}/metrics").text
        assert not re.search(r"^kvworker_prompt_tokens_total [1-9]", scrape, re.M)
        # Every 400 is counted, those refused by validation before any handler too (5 each).
        scrape = httpx.get(f"{gw}/metrics").text
        counted = re.search(
            r'^kvrouter_requests_total\{[^}]*status="400"[^}]*\} (\S+)$', scrape, re.M
        )
        assert counted is not None
        assert float(counted.group(1)) == 5


# -- admission control and rate limits ---------------------------------------------------------


def test_request_rate_limits_are_shared_by_gateway_replicas(redis_url: str) -> None:
    """Two replicas, one budget: 2 requests/s with a 1 s burst lets ~2 of 8 quick requests
    through a key, whichever replica they hit; the rest get 429 with Retry-After, and
    another key has its own budget."""
    with ExitStack() as stack:
        workers = start_workers(stack, redis_url, 1, time_scale=0.0)
        kw = {"redis_url": redis_url, "api_keys": ["a", "b"], "rate_limit_rps": 2.0}
        gws = [start_gateway(stack, len(workers), **kw) for _ in range(2)]
        body = {"model": MODEL, "prompt": prompt(0, 20), "max_tokens": 1}

        def send(i: int, key: str) -> httpx.Response:
            return httpx.post(
                f"{gws[i % 2]}/v1/completions", json=body, timeout=30,
                headers={"authorization": f"Bearer {key}"},
            )  # fmt: skip

        statuses = [send(i, "a") for i in range(8)]
        ok = [r for r in statuses if r.status_code == 200]
        limited = [r for r in statuses if r.status_code == 429]
        assert 2 <= len(ok) <= 3, [r.status_code for r in statuses]
        assert len(ok) + len(limited) == 8
        assert {r.json()["error"]["code"] for r in limited} == {"rate_limit_exceeded"}
        assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
        assert send(0, "b").status_code == 200
        time.sleep(1.1)
        assert send(1, "a").status_code == 200
        total = sum(
            float(m)
            for g in gws
            for m in re.findall(
                r'^kvrouter_rate_limited_total\{limit="requests"\} (\S+)$',
                httpx.get(f"{g}/metrics").text, re.M,
            )
        )  # fmt: skip
        assert total == len(limited)


def test_token_rate_limits_count_prompt_and_max_tokens(redis_url: str) -> None:
    with ExitStack() as stack:
        workers = start_workers(stack, redis_url, 1, time_scale=0.0)
        gw = start_gateway(
            stack, len(workers), redis_url=redis_url, api_keys=["a"], rate_limit_tpm=600.0
        )
        auth = {"authorization": "Bearer a"}
        big = {"model": MODEL, "prompt": prompt(0, 500), "max_tokens": 200}
        r = httpx.post(f"{gw}/v1/completions", json=big, headers=auth, timeout=30)
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "tokens_exceed_limit"
        small = {"model": MODEL, "prompt": prompt(1, 200), "max_tokens": 50}
        codes = [
            httpx.post(f"{gw}/v1/completions", json=small, headers=auth, timeout=30).status_code
            for _ in range(3)
        ]
        assert codes == [200, 200, 429]  # 250 + 250 of 600, then the bucket is short


def test_slo_admission_refuses_what_cannot_start_in_time() -> None:
    """With a TTFT bound, a request whose best predicted TTFT is over it gets 429 and
    Retry-After at once instead of a place in a queue; under the bound it is served."""
    with ExitStack() as stack:
        # Steps of 4,096 tokens: a 3,000-token prompt prefills in one (at 256 it would
        # take 12, each with its step overhead, and the worker publishes that).
        workers = start_workers(stack, None, 1, max_num_batched_tokens=4096)
        gw = start_gateway(
            stack, 1, workers=list(workers.values()), admission_max_ttft_s=1.6,
            discovery_interval_s=0.05,
        )  # fmt: skip
        # A 3,000-token prompt is predicted at ~1.3 s on this idle worker (the H100
        # profile's ~0.06 s, slowed by its time scale of 20): under the bound, served.
        solo = {"model": MODEL, "prompt": prompt(0, 3000), "max_tokens": 1}
        assert httpx.post(f"{gw}/v1/completions", json=solo, timeout=60).status_code == 200
        # Half a second into another one's ~1.3 s prefill it is not: it would answer ~2.1 s
        # after it came (the ~0.8 s left of that prefill, where a heartbeat names the step
        # in progress, else the whole of it, and its own ~1.3 s). A second in it would
        # answer ~1.6 s after it came, at the bound, and a fresh heartbeat admits it.
        flood = [{"model": MODEL, "prompt": prompt(1, 3000), "max_tokens": 1, "stream": True}]
        body = {"model": MODEL, "prompt": prompt(2, 3000), "max_tokens": 1}

        async def run() -> list[bytes]:
            return await asyncio.gather(*(hang_up_before_first_byte(gw, b, 3.0) for b in flood))

        async def probe() -> httpx.Response:
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(timeout=30) as http:
                return await http.post(f"{gw}/v1/completions", json=body)

        async def both() -> tuple[list[bytes], httpx.Response]:
            return await asyncio.gather(run(), probe())

        _, r = asyncio.run(both())
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "over_capacity"
        assert int(r.headers["retry-after"]) >= 1
        scrape = httpx.get(f"{gw}/metrics").text
        assert re.search(r"^kvrouter_admission_rejected_total [1-9]", scrape, re.M)


def test_a_served_app_that_cannot_go_on_exits_with_status_1(tmp_path: Path) -> None:
    # kvrouter.graceful.serve, as `kvrouter worker` and `kvrouter serve` run: an app that
    # calls app.state.fail (a worker whose engine loop died) stops its process with status
    # 1, which `kvrouter up`, Kubernetes and systemd restart; stopped by SIGTERM, it exits 0.
    import signal
    import subprocess
    import sys

    script = tmp_path / "app.py"
    script.write_text(
        "import asyncio, contextlib, sys\n"
        "from starlette.applications import Starlette\n"
        "from kvrouter.graceful import serve\n"
        "@contextlib.asynccontextmanager\n"
        "async def lifespan(app):\n"
        "    if sys.argv[1] == 'fail':\n"
        "        asyncio.get_running_loop().call_later(0.2, app.state.fail, 'the engine is gone')\n"
        "    yield\n"
        "serve(Starlette(lifespan=lifespan), host='127.0.0.1', port=int(sys.argv[2]), drain_s=1)\n"
    )
    failed = subprocess.run(
        [sys.executable, str(script), "fail", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    assert "the engine is gone" in failed.stderr
    port = free_port()
    ok = subprocess.Popen([sys.executable, str(script), "ok", str(port)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            with suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            assert ok.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ok.send_signal(signal.SIGTERM)
        assert ok.wait(30) == 0
    finally:
        if ok.poll() is None:
            ok.kill()
        ok.wait()
