"""Gateway parts against real Redis and real workers: load leases, discovery rules, affinity."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis
from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from engine_worker.protocol import CompletionRequest
from engine_worker.server import create_app as create_worker_app
from engine_worker.tokenizer import load_tokenizer
from indexer.index.redis_index import RedisIndex
from indexer.views import WorkerView
from indexer.wire import Keyspace, encode_view
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import Load, LoadTracker, admission_load
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.routing import ModelTokens, Router
from kvrouter.gateway.settings import RouterSettings
from kvrouter.policy_factory import build_policy
from policies.base import Decision
from tests.support.cluster import worker_settings
from tests.support.servers import serve_app
from tests.support.tcp_proxy import TcpProxy


async def test_replicas_share_load_and_a_dead_replicas_counts_expire(redis_url: str) -> None:
    ca, cb = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
    a = LoadTracker(client=ca, replica_id="a", lease_s=0.5)
    b = LoadTracker(client=cb, replica_id="b", lease_s=0.5)
    t1 = a.begin("w0", 1000)
    t2 = a.begin("w0", 500)
    await a.sync()
    await b.sync()
    assert (b.load("w0").in_flight, b.load("w0").queued_tokens) == (2, 1500)
    t1.first_byte()
    t1.first_byte()  # idempotent
    t2.end()
    t2.end()  # idempotent
    await a.sync()
    await b.sync()
    assert (b.load("w0").in_flight, b.load("w0").queued_tokens) == (1, 0)
    # Replica a "crashes" while holding t1: its lease expires and its counts with it.
    deadline = time.monotonic() + 5
    while b.load("w0").in_flight:
        assert time.monotonic() < deadline, "a dead replica's counts never expired"
        await asyncio.sleep(0.1)
        await b.sync()
    t1.end()
    assert a.load("w0").in_flight == 0
    assert "w0" not in a.local
    await ca.aclose()
    await cb.aclose()


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[tuple[LoadTracker, LoadTracker]]:
    """Two gateway replicas' trackers sharing one Redis; an ``old`` replica's entries
    that a test publishes (:func:`publish_old`) go with them."""
    ca, cb = aioredis.Redis.from_url(redis_url), aioredis.Redis.from_url(redis_url)
    a = LoadTracker(client=ca, replica_id="a", lease_s=5)
    b = LoadTracker(client=cb, replica_id="b", lease_s=5)
    yield a, b
    ks = Keyspace()
    await ca.delete(ks.load("r:old"))
    await ca.zrem(ks.load("replicas"), "old")
    await a.stop()
    await b.stop()
    await ca.aclose()
    await cb.aclose()


async def publish_old(tracker: LoadTracker, entries: dict[str, str]) -> None:
    """Lease entries of a replica ``old`` running an earlier version."""
    assert tracker.client is not None
    ks = Keyspace()
    await tracker.client.zadd(ks.load("replicas"), {"old": int(time.time() * 1000) + 5000})
    await tracker.client.hset(ks.load("r:old"), mapping=entries)  # type: ignore[arg-type]


async def test_replicas_share_the_distinct_prompt_blocks_a_worker_holds_once_prefilled(
    replicas: tuple[LoadTracker, LoadTracker], caplog: pytest.LogCaptureFixture
) -> None:
    # Two prompts sharing a 2-block prefix: each queued until its first byte, then its
    # blocks held in the worker's HBM until it ends, the shared ones counted once (the
    # worker stores them once). This is what a heartbeat taken before them misses.
    a, b = replicas
    t1 = a.begin("w0", 1000, (11, 12, 13, 14))
    t2 = a.begin("w0", 30, (11, 12, 15))
    await a.sync()
    await b.sync()
    assert b.load("w0") == Load(2, 1030, 0)
    t1.first_byte()
    t2.first_byte()
    t2.first_byte()  # idempotent
    await a.sync()
    await b.sync()
    # Both past their first token: decoding, the batch a heartbeat taken before misses.
    assert b.load("w0") == Load(2, 0, 5, running=2)
    # An older replica publishes two fields (held 0); a garbled entry is skipped.
    await publish_old(a, {"w0": "2,500", "w1": "x,y"})
    with caplog.at_level(logging.WARNING, logger="kvrouter.gateway.load"):
        await b.sync()
    assert b.load("w0") == Load(4, 500, 5, running=2)
    assert b.load("w1") == Load()
    assert "replica old" in caplog.text
    t1.end()
    t1.end()  # idempotent
    assert a.load("w0") == Load(1, 0, 3, running=1)  # t2's blocks, the shared prefix too
    t2.end()
    assert "w0" not in a.local
    assert "w0" not in a.held
    # Ended before its first byte: the queued part goes, nothing was ever held.
    early = a.begin("w0", 700, (21, 22))
    early.end()
    assert "w0" not in a.local


async def test_replicas_share_the_attention_work_and_taken_blocks_of_what_they_queued(
    replicas: tuple[LoadTracker, LoadTracker],
) -> None:
    # A 32K-token prompt with 2K cached (its 128 cached blocks on DRAM, taken from the
    # free pool on admission) and a short one: what a worker's heartbeat calls
    # queued_prefill_context (new * (cached + new / 2)), which makes a long prompt in the
    # queue cost more than its linear share, and queued_taken_blocks. Both leave with the
    # first byte.
    a, b = replicas
    long = a.begin("w0", 30_720, prompt_tokens=32_768, admission=Load(queued_taken=128))
    short = a.begin("w0", 100, prompt_tokens=100)
    work = 30_720 * 2_048 + 30_720**2 // 2 + 100**2 // 2
    await a.sync()
    await b.sync()
    assert b.load("w0") == Load(2, 30_820, 0, work, 128)
    long.first_byte()
    await a.sync()
    await b.sync()
    assert b.load("w0") == Load(2, 100, 0, 100**2 // 2, 0, running=1)
    # Replicas of the versions before publish three or four fields.
    await publish_old(a, {"w0": "1,500,7", "w1": "1,10,0,50"})
    await b.sync()
    assert b.load("w0") == Load(3, 600, 7, 100**2 // 2, running=1)
    assert b.load("w1") == Load(1, 10, 0, 50, 0)
    short.end()
    long.end()
    assert "w0" not in a.local


async def test_replicas_share_the_loads_from_dram_and_ssd_of_what_they_queued(
    replicas: tuple[LoadTracker, LoadTracker],
) -> None:
    # A prompt whose 1,080 cached blocks sit on DRAM and 40 on SSD: the step that admits
    # it brings them up before computing anything, so a request queued behind it on that
    # worker waits for the loads. The other replica sees them until the first byte, and
    # the dispatcher takes them from the policy's scores.
    a, b = replicas
    scores = {"taken_blocks": 1_120.0, "load_dram_blocks": 1_080.0, "load_ssd_blocks": 40.0}
    ticket = a.begin("w0", 261, prompt_tokens=19_589, admission=admission_load(scores))
    await a.sync()
    await b.sync()
    seen = b.load("w0")
    assert (seen.queued_taken, seen.queued_dram, seen.queued_ssd) == (1_120, 1_080, 40)
    ticket.first_byte()
    await a.sync()
    await b.sync()
    assert b.load("w0") == Load(in_flight=1, running=1)  # decoding, nothing queued
    # Replicas of versions before publish five fields (no loads) or seven (no running).
    await publish_old(a, {"w1": "1,10,0,50,4", "w2": "1,10,0,50,4,2,1"})
    await b.sync()
    assert b.load("w1") == Load(1, 10, 0, 50, 4, 0, 0, 0)
    assert b.load("w2") == Load(1, 10, 0, 50, 4, 2, 1, 0)
    ticket.end()
    assert "w0" not in a.local


async def test_discovery_refuses_mismatched_workers_and_benches_failed_ones(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    ks = Keyspace()
    metrics = RouterMetrics(CollectorRegistry())
    for host, bs, model in (
        ("good", 16, "tiny"),
        ("odd-block", 32, "tiny"),
        ("other", 16, "llama"),
    ):
        await client.hset(ks.hosts, host, 1)
        view = WorkerView(
            host=host, url=f"http://{host}", model=model, block_size=bs, ts=time.time()
        )
        await client.set(ks.heartbeat(host), encode_view(view), px=5000)
    await client.hset(ks.hosts, "dead", 9)  # registered, heartbeat expired
    d = WorkerDirectory(metrics=metrics, block_size=16, models={"tiny"}, client=client)
    await d.refresh()
    assert [v.host for v in d.routable("tiny")] == ["good"]
    reg = metrics.registry
    assert (
        reg.get_sample_value(
            "kvrouter_worker_refused_total", {"worker": "odd-block", "reason": "block_size"}
        )
        == 1
    )
    assert (
        reg.get_sample_value(
            "kvrouter_worker_refused_total", {"worker": "other", "reason": "model"}
        )
        == 1
    )
    d.bench("good")
    await d.refresh()
    assert d.routable("tiny") == []
    fresh = WorkerView(
        host="good", url="http://good", model="tiny", block_size=16, ts=time.time() + 1
    )
    await client.set(ks.heartbeat("good"), encode_view(fresh), px=5000)
    await d.refresh()
    assert [v.host for v in d.routable("tiny")] == ["good"]
    await client.aclose()


async def test_each_new_heartbeat_is_dated_with_the_routers_counts_of_its_arrival(
    redis_url: str,
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    ks = Keyspace()
    load = LoadTracker()
    d = WorkerDirectory(
        metrics=RouterMetrics(CollectorRegistry()), block_size=16, models={"tiny"},
        client=client, grace_s=0.0, on_view=load.saw,
    )  # fmt: skip

    async def beat(ts: float) -> None:
        view = WorkerView(host="w", url="http://w", model="tiny", block_size=16, ts=ts)
        await client.hset(ks.hosts, "w", 1)
        await client.set(ks.heartbeat("w"), encode_view(view), px=5000)

    ticket = load.begin("w", 4096, keys=[1, 2, 3])
    t0 = time.time()
    await beat(t0)
    await d.refresh()
    first = d.views["w"]
    assert load.seen_at(first) == Load(1, 4096, 0)
    # The request got its first token; the same heartbeat keeps its date, a new one
    # gets the counts of its own arrival.
    ticket.first_byte()
    await d.refresh()
    assert load.seen_at(d.views["w"]) == Load(1, 4096, 0)
    await beat(t0 + 1)  # a worker clock ahead of ours: dated now
    await d.refresh()
    assert load.seen_at(d.views["w"]) == Load(1, 0, 3, running=1)
    assert load.seen_at(first) is None  # an older heartbeat is not dated by a newer one
    ticket.end()
    # The worker leaves: its date goes with it.
    await client.delete(ks.heartbeat("w"))
    await client.hdel(ks.hosts, "w")
    await d.refresh()
    assert "w" not in d.views
    assert load.seen == {}
    await client.aclose()


def test_a_heartbeat_is_dated_by_its_age_not_by_when_discovery_saw_it() -> None:
    # Discovery polls every 0.5 s, so a heartbeat arrives up to that much after it was
    # taken. Here it was taken at t = 10.0, while the request was still prefilling; the
    # request got its first token at 10.2 and discovery read the heartbeat at 10.4.
    clock = {"wall": 1_000.0, "mono": 0.0}

    def at(t: float) -> None:
        clock.update(wall=1_000.0 + t, mono=t)

    load = LoadTracker(wall=lambda: clock["wall"], mono=lambda: clock["mono"])
    at(9.5)
    ticket = load.begin("w", 4096, keys=[1, 2, 3])
    at(10.2)
    ticket.first_byte()
    at(10.4)
    load.saw("w", 1_010.0)
    view = WorkerView(host="w", model="tiny", block_size=16, ts=1_010.0)
    # What the heartbeat shows of the request is what the router counted at 10.0.
    assert load.seen_at(view) == Load(1, 4096, 0)
    # Older than the history kept (2 s): dated 2 s back. A heartbeat taken before
    # anything was routed to its worker saw nothing counted.
    at(13.0)
    load.saw("w", 1_010.5)
    assert load.seen_at(replace(view, ts=1_010.5)) == Load(1, 0, 3, running=1)
    fresh = LoadTracker(wall=lambda: clock["wall"], mono=lambda: clock["mono"])
    late = fresh.begin("v", 100)
    fresh.saw("v", 1_012.0)  # taken before anything was routed to "v"
    assert fresh.seen_at(replace(view, host="v", ts=1_012.0)) == Load()
    late.end()
    ticket.end()
    load.saw("w", None)
    assert (load.seen, load.history) == ({}, {})


async def test_a_wiped_registry_keeps_known_workers_for_a_grace_period(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    ks = Keyspace()
    view = WorkerView(host="w", url="http://w", model="tiny", block_size=16, ts=time.time())
    await client.hset(ks.hosts, "w", 1)
    await client.set(ks.heartbeat("w"), encode_view(view), px=5000)
    d = WorkerDirectory(
        metrics=RouterMetrics(CollectorRegistry()),
        block_size=16,
        models={"tiny"},
        client=client,
        grace_s=0.3,
    )
    await d.refresh()
    await client.flushall()  # what a Redis restart without persistence looks like
    await d.refresh()
    assert [v.host for v in d.routable("tiny")] == ["w"]
    await asyncio.sleep(0.35)
    await d.refresh()
    assert d.routable("tiny") == []
    await client.aclose()


async def test_workers_stay_routable_while_their_heartbeats_recover_from_a_redis_outage(
    redis_url: str,
) -> None:
    """Heartbeats cannot be renewed through a Redis outage, so they have all expired when
    it ends; the workers beat again right after. Known workers must stay routable through
    that moment (the chaos run saw 503 no_worker there), and go if they never come back."""
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    admin = aioredis.Redis.from_url(redis_url)
    ks = Keyspace()
    view = WorkerView(host="w", url="http://w", model="tiny", block_size=16, ts=time.time())
    await admin.hset(ks.hosts, "w", 1)
    await admin.set(ks.heartbeat("w"), encode_view(view), px=60_000)
    with TcpProxy(host, int(port)) as proxy:
        client = aioredis.Redis.from_url(
            f"redis://{proxy.address}", socket_timeout=0.5, socket_connect_timeout=0.5
        )
        d = WorkerDirectory(
            metrics=RouterMetrics(CollectorRegistry()), block_size=16, models={"tiny"},
            client=client, grace_s=0.5,
        )  # fmt: skip
        await d.refresh()
        assert [v.host for v in d.routable("tiny")] == ["w"]
        proxy.set_refusing(True)
        proxy.cut()
        await d.refresh()
        assert [d.redis_ok] == [False]
        await admin.delete(ks.heartbeat("w"))  # it expired during the outage
        proxy.heal()
        await d.refresh()
        assert [d.redis_ok] == [True]
        assert [v.host for v in d.routable("tiny")] == ["w"]
        await asyncio.sleep(0.55)
        await d.refresh()
        assert d.routable("tiny") == []  # it never beat again: gone
        await client.aclose()
    await admin.aclose()


def test_static_discovery_reads_the_workers_view(redis_url: str) -> None:
    port = free_port()
    with serve_app(create_worker_app(worker_settings("static-w", port, None)), port=port) as url:

        async def check() -> list[WorkerView]:
            async with httpx.AsyncClient() as http:
                d = WorkerDirectory(
                    metrics=RouterMetrics(CollectorRegistry()), block_size=16, models={"tiny"},
                    static_urls=[url], http=http,
                )  # fmt: skip
                await d.refresh()
                return d.routable("tiny")

        views = asyncio.run(check())
    assert [(v.host, v.url) for v in views] == [("static-w", url)]


@pytest.mark.parametrize("lower_is_better", [True, False])
def test_session_affinity_is_a_hint_the_scores_can_overrule(lower_is_better: bool) -> None:
    aff = SessionAffinity(slack=1.25, slack_s=0.0)
    near = {"a": {"total": 1.0}, "b": {"total": 1.2 if lower_is_better else 0.85}}
    far = {"a": {"total": 1.0}, "b": {"total": 3.0 if lower_is_better else 0.2}}
    aff.record("s1", "b", now=0.0)
    assert (
        aff.prefer("s1", Decision("a", "p", near, lower_is_better=lower_is_better), now=1.0) == "b"
    )
    assert (
        aff.prefer("s1", Decision("a", "p", far, lower_is_better=lower_is_better), now=1.0) == "a"
    )
    assert (
        aff.prefer("s2", Decision("a", "p", near, lower_is_better=lower_is_better), now=1.0) == "a"
    )
    assert (
        aff.prefer("s1", Decision("a", "p", near, lower_is_better=lower_is_better), now=1e9) == "a"
    )


async def test_a_burst_whose_lookups_overlap_sees_each_others_load(redis_url: str) -> None:
    """Requests decided while the others' index lookups are in flight must each see the
    load of those decided before them (the dispatcher's ticket, taken at once), so that a
    burst sharing one prefix spreads instead of piling onto the first one's worker."""
    metrics = RouterMetrics(CollectorRegistry())
    d = WorkerDirectory(metrics=metrics, block_size=16, models={"tiny"})
    for host in ("w0", "w1"):
        d.views[host] = WorkerView(
            host=host, url=f"http://{host}", model="tiny", block_size=16, ts=time.time()
        )
    load = LoadTracker()
    index = RedisIndex(redis_url)
    router = Router(
        models={"tiny": ModelTokens(load_tokenizer("tiny"), None)},
        directory=d, index=index, load=load, policy=build_policy("kv_ttft"),
        fallback=build_policy("least_load"), metrics=metrics, block_size=16,
        max_prompt_tokens=8192,
    )  # fmt: skip
    system = [7 + (i % 50) for i in range(2048)]

    async def one(i: int) -> str:
        body = CompletionRequest(model="tiny", prompt=[*system, 100 + i, 101, 102], max_tokens=4)
        routed = await router.route(body, f"r{i}")
        load.begin(routed.decision.worker, routed.uncached_tokens())  # what the dispatcher does
        return routed.decision.worker

    try:
        chosen = await asyncio.gather(*(one(i) for i in range(8)))
    finally:
        await index.close()
    assert set(chosen) == {"w0", "w1"}, chosen
    # Every worker got the whole prompt once and then only suffixes behind it.
    assert sorted(load.load(w).queued_tokens for w in ("w0", "w1"))[0] >= len(system)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("smollm2,tiny", ["smollm2", "tiny"]), ('["smollm2", "tiny"]', ["smollm2", "tiny"])],
)
def test_list_settings_come_from_the_environment_as_commas_or_json(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: list[str]
) -> None:
    """The README documents comma lists; the Helm chart renders JSON arrays: both work."""
    monkeypatch.setenv("KVROUTER_MODELS", raw)
    monkeypatch.setenv("KVROUTER_API_KEYS", raw)
    settings = RouterSettings()
    assert settings.models == expected
    assert [k.get_secret_value() for k in settings.api_keys] == expected
    monkeypatch.setenv("KVROUTER_MODELS", "[not json")
    with pytest.raises(ValueError, match="not a JSON array"):
        RouterSettings()
