"""A worker's published event stream, heartbeat and control stream, against a real Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from engine_worker.server import create_app
from engine_worker.settings import WorkerSettings
from indexer.events import EventBatch, Snapshot, decode_message
from indexer.media import MEDIA, Medium
from indexer.views import WorkerView
from indexer.wire import CONTROL_FIELD, EVENT_FIELD, OP_SNAPSHOT, Keyspace, decode_view
from kvrouter.graceful import DrainingServer
from tests.engine_worker.event_replay import EventReplay
from tests.support.redis_proc import RedisProcess, free_port
from tests.support.servers import running_server, serve_app

KS = Keyspace()
HOST = "w-events"


def settings(redis_url: str, **kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "model": "tiny", "name": HOST, "redis_url": redis_url, "hbm_blocks": 24,
        "dram_blocks": 16, "max_model_len": 256, "max_num_batched_tokens": 128,
        "heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0,
    }  # fmt: skip
    base.update(kw)
    return WorkerSettings(**base)


@pytest.fixture
def worker(redis_url: str) -> Iterator[str]:
    port = free_port()
    with serve_app(create_app(settings(redis_url, port=port)), port=port) as url:
        yield url


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def mixed_workload(url: str, rounds: int = 3) -> None:
    """Shared prefixes, distinct prompts and enough volume to demote blocks to DRAM."""
    shared = "You are a careful assistant. " * 6
    for i in range(rounds * 4):
        if i % 2:
            complete(url, shared + f"Question {i}?")
        else:
            complete(url, f"Unrelated prompt number {i} " * (20 + i % 3), max_tokens=8)


def pool_keys(url: str) -> dict[Medium, set[int]]:
    blocks = httpx.get(f"{url}/kv/keys", timeout=30).json()["blocks"]
    return {m: set(blocks.get(m.value, [])) for m in MEDIA}


def read_stream(url: str) -> list[EventBatch | Snapshot]:
    client = redis.Redis.from_url(url)
    try:
        entries: Any = client.xrange(KS.events(HOST))
    finally:
        client.close()
    return [decode_message(fields[EVENT_FIELD]) for _, fields in entries]


def replay(messages: list[EventBatch | Snapshot]) -> tuple[EventReplay, list[int]]:
    """Replay the stream from its latest snapshot; returns the state and the batch seqs used."""
    start = max(i for i, m in enumerate(messages) if isinstance(m, Snapshot))
    snap = messages[start]
    assert isinstance(snap, Snapshot)
    state = EventReplay()
    for medium, keys in snap.blocks.items():
        state.held[medium] = set(keys)
    seqs = []
    for m in messages[start + 1 :]:
        if isinstance(m, EventBatch) and m.epoch == snap.epoch and m.seq > snap.seq:
            state.apply(m.events)
            seqs.append(m.seq)
    return state, [snap.seq, *seqs]


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_replaying_the_stream_equals_the_pool_per_medium(worker: str, redis_url: str) -> None:
    mixed_workload(worker)
    real = pool_keys(worker)
    assert real[Medium.DRAM], "the workload should have demoted blocks to DRAM"

    def consistent() -> bool:
        state, _ = replay(read_stream(redis_url))
        return state.held == pool_keys(worker)

    eventually(consistent)
    messages = read_stream(redis_url)
    assert isinstance(messages[0], Snapshot), "every epoch starts with a snapshot"
    _, seqs = replay(messages)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no seq gaps"
    assert {m.host for m in messages} == {HOST}


def test_resync_after_redis_restart_mid_run(
    worker: str, redis_url: str, redis_server: RedisProcess
) -> None:
    mixed_workload(worker, rounds=1)
    redis_server.stop()
    mixed_workload(worker, rounds=1)  # keeps serving with Redis down
    redis_server.start()
    mixed_workload(worker, rounds=1)

    def consistent() -> bool:
        messages = read_stream(redis_url)
        if not any(isinstance(m, Snapshot) for m in messages):
            return False
        state, _ = replay(messages)
        return state.held == pool_keys(worker)

    eventually(consistent, timeout=20)
    metrics = httpx.get(f"{worker}/metrics").text
    assert "kvworker_redis_up 1.0" in metrics


def test_heartbeat_registers_and_describes_the_worker(worker: str, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        eventually(lambda: client.exists(KS.heartbeat(HOST)) == 1)
        view = decode_view(client.get(KS.heartbeat(HOST)))  # type: ignore[arg-type]
        ttl = client.pttl(KS.heartbeat(HOST))
        assert 0 < ttl <= 2000
        assert client.hget(KS.hosts, HOST) is not None
    finally:
        client.close()
    assert view.host == HOST
    assert view.model == "tiny"
    assert view.block_size == 16
    assert view.url == worker
    assert view.kv_capacity_blocks == {Medium.HBM: 24, Medium.DRAM: 16, Medium.SSD: 0}
    assert view.profile is not None
    # The torch runner copies DRAM blocks up in the step that admits their request.
    assert view.async_loads is False


def test_heartbeat_names_the_newest_batch_of_the_stream(worker: str, redis_url: str) -> None:
    mixed_workload(worker, rounds=1)
    client = redis.Redis.from_url(redis_url)
    try:

        def caught_up() -> bool:
            batches = [m for m in read_stream(redis_url) if isinstance(m, EventBatch)]
            view = decode_view(client.get(KS.heartbeat(HOST)))  # type: ignore[arg-type]
            # What the ingester compares to see a lost tail: nothing lost, nothing ahead.
            return (
                bool(batches)
                and view.epoch == batches[-1].epoch
                and (view.events_seq == batches[-1].seq)
            )

        eventually(caught_up)
    finally:
        client.close()


def test_heartbeat_says_when_the_step_in_progress_ends_and_what_it_prefills(
    redis_url: str,
) -> None:
    # A sim worker whose 128-token chunks take ~0.5 s each: a heartbeat taken while a long
    # prompt prefills names the chunk in progress and when it should end.
    name = "w-step"
    slow = settings(
        redis_url, name=name, runner="sim", time_scale=100.0, heartbeat_interval_s=0.05,
        max_model_len=1024, hbm_blocks=64,
    )  # fmt: skip
    with serve_app(create_app(slow)) as url:
        client = redis.Redis.from_url(redis_url)
        try:
            eventually(lambda: client.exists(KS.heartbeat(name)) == 1)
            idle = decode_view(client.get(KS.heartbeat(name)))  # type: ignore[arg-type]
            assert (idle.step_ends_ts, idle.step_prefill_tokens) == (0.0, 0)
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(complete, url, "word " * 500, 1)
                views: list[WorkerView] = []

                def mid_prefill() -> bool:
                    v = decode_view(client.get(KS.heartbeat(name)))  # type: ignore[arg-type]
                    views.append(v)
                    # Past its first step: the request is running (not queued) in the
                    # state the heartbeat publishes.
                    return v.step_prefill_tokens > 0 and bool(v.kv_release)

                eventually(mid_prefill)
                v = views[-1]
                assert v.step_prefill_tokens == 128  # one chunk of the step budget
                assert v.queued_prefill_tokens >= 256  # this chunk and those after it
                assert v.step_prefill_context >= 128 * 128 // 2
                # Ends after the heartbeat was taken, within one modeled chunk of it.
                assert v.ts < v.step_ends_ts < v.ts + 2.0
                # The one running request finishes after the prefill still queued and its
                # one token, and frees all it holds then (nobody shares it): at least the
                # blocks of the tokens still to compute.
                ((ahead, left, freed),) = v.kv_release
                assert (ahead, left) == (v.queued_prefill_tokens, 1)
                assert freed >= -(-(ahead + left) // v.block_size)
                done.result(timeout=60)
            eventually(
                lambda: decode_view(client.get(KS.heartbeat(name))).step_ends_ts == 0.0  # type: ignore[arg-type]
            )
            assert decode_view(client.get(KS.heartbeat(name))).kv_release == []  # type: ignore[arg-type]
        finally:
            client.close()


def test_a_snapshot_request_on_the_control_stream_is_answered(worker: str, redis_url: str) -> None:
    complete(worker, "some prompt to cache " * 4)
    client = redis.Redis.from_url(redis_url)
    try:
        eventually(lambda: len(read_stream(redis_url)) >= 2)
        before = sum(isinstance(m, Snapshot) for m in read_stream(redis_url))
        client.xadd(KS.control(HOST), {CONTROL_FIELD: OP_SNAPSHOT})
    finally:
        client.close()
    eventually(lambda: sum(isinstance(m, Snapshot) for m in read_stream(redis_url)) > before)
    snap = [m for m in read_stream(redis_url) if isinstance(m, Snapshot)][-1]
    assert {m: set(k) for m, k in snap.blocks.items()} == pool_keys(worker)


def test_heartbeat_disappears_on_clean_shutdown(redis_url: str) -> None:
    with serve_app(create_app(settings(redis_url, name="w-bye"))):
        client = redis.Redis.from_url(redis_url)
        eventually(lambda: client.exists(KS.heartbeat("w-bye")) == 1)
    assert client.exists(KS.heartbeat("w-bye")) == 0
    client.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_whose_engine_loop_dies_withdraws_its_heartbeat(
    redis_url: str, stream: bool
) -> None:
    # Found live: one request (seed 2**70, since refused) killed the engine loop; the
    # heartbeat went on, and the gateway kept sending the worker requests that got 503.
    # The request in flight, which had no token yet, gets a 503 a router retries (a
    # stream too: its headers wait for its first token), not a 200 with nothing in it.
    app = create_app(settings(redis_url, name="w-crash"))
    with serve_app(app) as url:
        client = redis.Redis.from_url(redis_url)
        eventually(lambda: client.exists(KS.heartbeat("w-crash")) == 1)
        complete(url, "a healthy request first")

        break_engine(app)
        r = httpx.post(
            f"{url}/v1/completions", timeout=60,
            json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream},
        )  # fmt: skip
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        # Deleted, before the heartbeat's 2 s TTL could expire it (and it would have been
        # renewed forever): room for a loaded CI machine, none for the old behaviour.
        eventually(lambda: client.exists(KS.heartbeat("w-crash")) == 0, timeout=1.8)
        assert httpx.get(f"{url}/health").status_code == 503
        after = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert after.status_code == 503
        assert after.json()["error"]["type"] == "service_unavailable"
        time.sleep(2.5)  # past the TTL: no heartbeat came back
        assert client.exists(KS.heartbeat("w-crash")) == 0
        client.close()


def break_engine(app: Any) -> None:
    """Make the worker's next engine step raise: a fault in the real engine's step."""

    def fail(_: object) -> None:
        raise RuntimeError("injected fault: the step failed")

    app.state.worker.engine.runner.execute = fail


@pytest.mark.parametrize("keep_alive", [False, True])
def test_a_worker_whose_engine_loop_dies_exits_to_be_restarted(
    redis_url: str, keep_alive: bool
) -> None:
    # Served as `kvrouter worker` serves it: the process stops (and `serve` exits with
    # status 1) so `kvrouter up`, Kubernetes or systemd restart it with a fresh engine,
    # as vLLM's API server exits when its engine core dies; with keep_alive_on_engine_death
    # it stays up answering 503, as before.
    app = create_app(settings(redis_url, name="w-exit", keep_alive_on_engine_death=keep_alive))
    with running_server(app, server_cls=DrainingServer) as (url, server, thread):
        assert isinstance(server, DrainingServer)
        client = redis.Redis.from_url(redis_url)
        eventually(lambda: client.exists(KS.heartbeat("w-exit")) == 1)
        complete(url, "a healthy request first")
        break_engine(app)
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=60)
        assert r.status_code == 503, r.text
        eventually(lambda: client.exists(KS.heartbeat("w-exit")) == 0, timeout=1.8)
        if keep_alive:
            time.sleep(1.5)
            assert thread.is_alive()
            assert server.failure is None
            assert httpx.get(f"{url}/health").status_code == 503
        else:
            thread.join(15)
            assert not thread.is_alive(), "the server kept serving with a dead engine"
            assert server.failure is not None
            assert "engine loop died" in server.failure
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health")
        client.close()
