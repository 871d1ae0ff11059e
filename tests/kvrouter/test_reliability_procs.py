"""Issue 11's findings that need real processes: SIGTERM drains, SIGKILL is not retried twice.

Workers and gateways here are ``kvrouter`` CLI processes (sim runner) in their own
process groups, so that signals reach them as they would in a rolling update.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from indexer.wire import Keyspace
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.servers import ServerProcess, serve_app

pytestmark = pytest.mark.slow

MODEL = "tiny"
FAST = {"KVWORKER_HEARTBEAT_INTERVAL_S": "0.2", "KVWORKER_HEARTBEAT_TTL_S": "2.0"}
# Decode steps of ~30 ms (sim profile x5): 300 tokens take ~9 s, longer than the 5 s
# that SIGTERM used to leave a stream.
LONG = 300


class Proc:
    """A ``kvrouter`` process on a free port."""

    def __init__(self, name: str, args: list[str], tmp_path: Path, env: dict[str, str],
                 health: str = "/health") -> None:  # fmt: skip
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = ServerProcess(
            [*args, "--port", str(self.port)], health_url=f"{self.url}{health}",
            log_path=tmp_path / f"{name}.log", env=env,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def signal(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.wait(timeout)


def sim_worker(name: str, redis_url: str, tmp_path: Path, time_scale: float = 5.0) -> Proc:
    args = [
        "worker", "--model", MODEL, "--runner", "sim", "--name", name, "--redis", redis_url,
        "--time-scale", str(time_scale), "--max-num-seqs", "16",
    ]  # fmt: skip
    return Proc(name, args, tmp_path, FAST)


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[dict[str, Proc]]:
    procs = {n: sim_worker(n, redis_url, tmp_path) for n in ("a", "b")}
    for p in procs.values():
        p.proc.start()
    yield procs
    for p in procs.values():
        p.proc.stop()


def in_process_gateway(redis_url: str, n_workers: int) -> Any:
    port = free_port()
    settings = RouterSettings(
        port=port, models=[MODEL], redis_url=redis_url, discovery_interval_s=0.1,
        load_sync_interval_s=0.1,
    )  # fmt: skip
    return serve_app(create_app(settings), port=port)


def wait_workers(gateway: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{gateway}/ready").json().get("workers") != n:
        assert time.monotonic() < deadline, "workers not discovered"
        time.sleep(0.05)


class Stream(threading.Thread):
    """A streaming completion read to the end on a thread; what came, and how it ended."""

    def __init__(self, url: str, max_tokens: int, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.first = threading.Event()
        self.worker = ""
        self.status = 0
        self.tokens = 0
        self.finish: str | None = None
        self.errors: list[Any] = []
        self.done = False
        self.seconds = 0.0

    def run(self) -> None:
        body = {
            "model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        t0 = time.monotonic()
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            self.worker = r.headers.get("x-kvrouter-worker", "")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                for choice in chunk.get("choices") or []:
                    self.first.set()
                    self.finish = choice.get("finish_reason") or self.finish
                if chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]
        self.seconds = time.monotonic() - t0
        self.first.set()


def prompt(i: int, n: int = 64) -> list[int]:
    return [(500 + 11 * i + j) % 30000 for j in range(n)]


def test_sigterm_withdraws_the_worker_then_lets_its_streams_finish(
    redis_url: str, workers: dict[str, Proc]
) -> None:
    """Finding 4: on SIGTERM the worker's heartbeat goes at once (the gateway routes new
    requests elsewhere) while its stream runs to the end, past the old 5 s cut, and the
    process then exits cleanly."""
    with in_process_gateway(redis_url, 2) as gw:
        wait_workers(gw, 2)
        stream = Stream(gw, LONG, prompt(0))
        stream.start()
        assert stream.first.wait(30)
        victim = workers[stream.worker]
        other = next(n for n in workers if n != stream.worker)
        t_term = time.monotonic()
        victim.signal(signal.SIGTERM)
        client = redis.Redis.from_url(redis_url)
        while client.exists(Keyspace().heartbeat(victim.name)):
            assert time.monotonic() - t_term < 1.0, "the heartbeat outlived SIGTERM by 1 s"
            time.sleep(0.02)
        client.close()
        # New requests go to the other worker while the victim drains.
        for i in range(1, 4):
            body = {"model": MODEL, "prompt": prompt(i), "max_tokens": 2}
            r = httpx.post(f"{gw}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] == other
        stream.join(60)
        assert stream.status == 200
        assert stream.errors == []
        assert stream.done
        assert (stream.tokens, stream.finish) == (LONG, "length")
        assert time.monotonic() - t_term > 5.0  # longer than the old grace
        assert victim.wait(30) == 0


def test_sigterm_makes_the_gateway_unready_and_drains_its_streams(
    redis_url: str, workers: dict[str, Proc], tmp_path: Path
) -> None:
    """Finding 4, gateway side: /ready answers 503 while it drains, its stream ends whole,
    and it exits cleanly."""
    env = {
        "KVROUTER_DISCOVERY_INTERVAL_S": "0.1", "KVROUTER_UNREADY_GRACE_S": "1.0",
        "KVROUTER_DRAIN_S": "60",
    }  # fmt: skip
    gateway = Proc("gw", ["serve", "--model", MODEL, "--redis", redis_url], tmp_path, env,
                   health="/ready")  # fmt: skip
    gateway.proc.start()
    try:
        stream = Stream(gateway.url, LONG, prompt(0))
        stream.start()
        assert stream.first.wait(30)
        gateway.signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.get(f"{gateway.url}/ready", timeout=5)
        assert r.status_code == 503
        assert "draining" in r.json()["error"]["message"]
        stream.join(60)
        assert (stream.tokens, stream.finish, stream.errors) == (LONG, "length", [])
        assert gateway.wait(30) == 0
    finally:
        gateway.proc.stop()


def test_a_non_streaming_request_whose_worker_dies_is_not_generated_again(
    redis_url: str, workers: dict[str, Proc]
) -> None:
    """Finding 5: the worker taking a non-streaming request is SIGKILLed mid-generation.
    The client gets a 502 and the other worker never sees the request (it used to be
    retried, up to three times in all)."""
    with in_process_gateway(redis_url, 2) as gw:
        wait_workers(gw, 2)
        result: dict[str, httpx.Response] = {}
        body = {"model": MODEL, "prompt": prompt(0), "max_tokens": LONG, "ignore_eos": True}

        def send() -> None:
            result["r"] = httpx.post(f"{gw}/v1/completions", json=body, timeout=120)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 30
        victim = None
        while victim is None:
            assert time.monotonic() < deadline, "no worker took the request"
            for name, w in workers.items():
                if httpx.get(f"{w.url}/worker/view").json()["running"] == 1:
                    victim = name
            time.sleep(0.05)
        time.sleep(0.5)  # well into the generation
        workers[victim].proc.kill()
        sender.join(60)
        r = result["r"]
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_failed"
        other = next(w for n, w in workers.items() if n != victim)
        scrape = httpx.get(f"{other.url}/metrics").text
        assert "kvworker_prompt_tokens_total 0.0" in scrape


@pytest.mark.parametrize("learned", [True, False])
def test_a_non_streaming_request_whose_worker_dies_before_its_first_token_is_retried(
    redis_url: str, tmp_path: Path, learned: bool
) -> None:
    """The worker taking a non-streaming request is SIGKILLed while it prefills. Workers
    mark a non-streaming answer's first token, so the gateway knows nothing was generated
    yet: it retries on the other worker, as it does a stream, and the client gets one
    answer instead of a 502. The gateway knows it from the workers' views
    (``marks_first_token``), or (``learned``) from answers that marked it; found under
    ``make run``: the first request to a worker that had not yet answered this gateway
    a non-streaming request got a 502 when the worker was killed."""
    # Sim steps x200: the 1,000-token prompt prefills for seconds, each decode step ~1 s.
    procs = {n: sim_worker(n, redis_url, tmp_path, time_scale=200.0) for n in ("a", "b")}
    try:
        for p in procs.values():
            p.proc.start()
        with in_process_gateway(redis_url, 2) as gw:
            wait_workers(gw, 2)
            # The gateway learns that a worker marks the first token from its answers: one
            # non-streaming answer from each (two at once go to different workers).
            served: set[str] = set()
            for i in range(5 if learned else 0):
                if served == set(procs):
                    break
                warm = [{"model": MODEL, "prompt": prompt(100 + 2 * i + k, 8), "max_tokens": 1}
                        for k in range(2)]  # fmt: skip
                with ThreadPoolExecutor(2) as pool:
                    answers = pool.map(
                        lambda b: httpx.post(f"{gw}/v1/completions", json=b, timeout=60), warm
                    )
                    served |= {r.headers["x-kvrouter-worker"] for r in answers}
            assert served == (set(procs) if learned else set())
            result: dict[str, httpx.Response] = {}
            body = {"model": MODEL, "prompt": prompt(0, 1000), "max_tokens": 2}
            sender = threading.Thread(
                target=lambda: result.update(
                    r=httpx.post(f"{gw}/v1/completions", json=body, timeout=120)
                ),
                daemon=True,
            )
            sender.start()
            deadline = time.monotonic() + 30
            victim = None
            while victim is None:  # the gateway's count: a busy worker answers late
                assert time.monotonic() < deadline, "no worker took the request"
                scrape = httpx.get(f"{gw}/metrics").text
                victim = next(
                    (
                        w
                        for w in procs
                        if f'kvrouter_worker_in_flight{{worker="{w}"}} 1.0' in scrape
                    ),
                    None,
                )
                time.sleep(0.05)
            time.sleep(0.5)  # prefilling: its first token is seconds away
            procs[victim].proc.kill()
            sender.join(120)
            r = result["r"]
            assert r.status_code == 200, r.text
            assert r.headers["x-kvrouter-worker"] != victim
            assert r.json()["usage"]["completion_tokens"] == 2
            scrape = httpx.get(f"{gw}/metrics").text
            assert 'kvrouter_retries_total{reason="transport"} 1.0' in scrape
    finally:
        for p in procs.values():
            p.proc.stop()


def _get_health(sock: socket.socket) -> bytes:
    """One ``GET /health`` on an open connection; the raw response (b"" if it was closed)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))  # fmt: skip
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the idle connection (its FIN is waiting to be read)."""
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_an_idle_keep_alive_connection_outlives_the_clients_own_5_s(
    redis_url: str, tmp_path: Path
) -> None:
    """Pooled clients (httpx, so the openai SDK) keep an idle connection 5 s and reuse it
    until then; a server that also closes at 5 s (uvicorn's default) resets the request that
    reuses it at that moment (seen as one ReadError in a closed-loop run). The gateway and
    the worker keep idle connections 75 s: one idle for 6 s still answers, on the same
    socket. ``KEEP_ALIVE_S`` is honoured: at 1 s the connection is closed by then."""
    procs = [
        Proc("gw", ["serve", "--model", MODEL, "--redis", redis_url], tmp_path, {}),
        Proc("gw1", ["serve", "--model", MODEL, "--redis", redis_url], tmp_path,
             {"KVROUTER_KEEP_ALIVE_S": "1"}),
        sim_worker("w", redis_url, tmp_path),
    ]  # fmt: skip
    socks: list[socket.socket] = []
    try:
        for p in procs:
            p.proc.start()
        socks = [socket.create_connection(("127.0.0.1", p.port), timeout=5) for p in procs]
        for s in socks:
            assert _get_health(s).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)
        gateway, short, worker = socks
        assert _closed(short)
        assert not _closed(gateway)
        assert not _closed(worker)
        gateway.settimeout(5)
        worker.settimeout(5)
        assert _get_health(gateway).startswith(b"HTTP/1.1 200")
        assert _get_health(worker).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.close()
        for p in procs:
            p.proc.stop()
