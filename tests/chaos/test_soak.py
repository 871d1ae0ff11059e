"""Soak: steady load for ``KVROUTER_SOAK_S`` seconds; nothing may accumulate.

Two phases of the same load: a warm-up (10% of the run) and the run
itself. After each the load stops and, once every counter reads zero, a
sample is taken at rest, so that start and end compare like with like
(no request in flight, no client connection open):

* every process (Redis, indexer, workers, gateways): RSS (``VmRSS``) and
  open file descriptors;
* Redis: ``used_memory``, ``DBSIZE``, keys by kind, event stream lengths;
* load counters (workers' views and leases, gateways' in-flight gauges,
  the replicas' load leases in Redis), also read once under load.

Goals: counters back to zero; no process holds more than
:data:`FD_ALLOWANCE` more descriptors; no Redis key outside the index
appears that was not there at the start; the index holds no more keys than
the blocks the workers hold explain (:func:`index_key_bound`); RSS grows by
at most 5% (asserted in runs of 300 s or more, reported always: a short run
measures allocator warm-up more than leaks).

Keys that legitimately vary: the index's bucket hashes come and go with
the blocks the workers cache (bounded by the tiers' capacity: small tiers
here, so caches fill and evict early); ``{p}:load:r:*`` exist only while a
replica has requests in flight (none at rest); a worker's control stream
``{p}:ctl:{host}`` appears with the indexer's first snapshot request to it
(a gap, a quiet tail) and its event stream with its first batch: one each
per worker, capped in length. Event streams grow up to the publishers'
approximate ``MAXLEN`` (100k entries): their lengths are reported.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from indexer.index.layout import IndexLayout
from tests.chaos.conftest import ChaosSettings, chaos_settings
from tests.chaos.fleet import KEYSPACE, Fleet, FleetSpec, process_figures
from tests.chaos.load import LoadGenerator, LoadReport, LoadShape, Outcome

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(chaos_settings().soak_s * 1.2 + 300)]

#: Small tiers so that caches fill and evict within the warm-up.
SOAK_SPEC = FleetSpec(hbm_blocks=512, dram_blocks=256)
#: Descriptors a process may gain: connection pools (gateway -> worker keep-alive, Redis
#: clients) grow to the highest concurrency seen, which a longer run's peaks raise by a few.
FD_ALLOWANCE = 8
RSS_GOAL = 0.05
COUNTERS_CAP_S = 10.0


@pytest.fixture(scope="module")
def soak_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The chaos fleet with small KV tiers."""
    with Fleet(tmp_path_factory.mktemp("soak"), SOAK_SPEC) as running:
        yield running


def index_key_bound(fleet: Fleet, layout: IndexLayout | None = None) -> tuple[int, int]:
    """Most index keys the workers' blocks can explain, and the blocks they hold.

    One forward bucket per distinct block at most, one reverse bucket per
    (host, block) up to ``2**host_bits`` per host, one counter hash per
    group, and a few singletons (layout, cursors, ownership).
    """
    layout = layout or IndexLayout()
    held = []
    for w in fleet.workers:
        counts = fleet.worker_view(w).get("kv_used_blocks", {})
        held.append(sum(int(n) for n in counts.values()))
    bound = sum(held) + sum(min(h, 1 << layout.host_bits) for h in held) + layout.groups + 8
    return bound, sum(held)


def phase(fleet: Fleet, shape: LoadShape, seconds: float) -> tuple[LoadReport, dict[str, Any]]:
    """Load for ``seconds``; returns the report and the counters read halfway, under load."""
    scrape = [*fleet.gateway_urls, *(w.url for w in fleet.workers), fleet.indexer.url]
    with LoadGenerator(fleet.gateway_urls, shape, scrape=scrape) as load:
        time.sleep(seconds / 2)
        under_load = fleet.counters().as_dict()
        time.sleep(seconds / 2)
        report = load.stop()
    return report, under_load


def sample(fleet: Fleet) -> dict[str, Any]:
    """Figures at rest: counters (waited to zero), processes, Redis, the index bound."""
    zero_s, counters = fleet.wait_counters_zero(COUNTERS_CAP_S)
    bound, blocks = index_key_bound(fleet)
    return {
        "counters_zero_s": None if zero_s is None else round(zero_s, 2),
        "counters_nonzero": counters.nonzero(),
        "processes": {name: process_figures(pid) for name, pid in fleet.pids().items()},
        "redis": fleet.redis_figures(),
        "index_key_bound": bound,
        "blocks_held": blocks,
        "index": fleet.index_state().detail or "exact",
    }


def test_soak(soak_fleet: Fleet, chaos: ChaosSettings) -> None:
    """Steady load for the soak duration: no leak of memory, descriptors, keys or counters."""
    fleet = soak_fleet
    fleet.ensure()
    warmup_s = max(2.0, chaos.soak_s * 0.1)
    warm, _ = phase(fleet, LoadShape(rate=chaos.rate, seed=100), warmup_s)
    start = sample(fleet)
    run, under_load = phase(fleet, LoadShape(rate=chaos.rate, seed=101), chaos.soak_s - warmup_s)
    end = sample(fleet)

    growth = {
        name: {
            "rss_kb": [start["processes"][name]["rss_kb"], fig["rss_kb"]],
            "rss_growth": round(fig["rss_kb"] / start["processes"][name]["rss_kb"] - 1.0, 4),
            "fds": [start["processes"][name]["fds"], fig["fds"]],
        }
        for name, fig in end["processes"].items()
        if name in start["processes"]
    }
    figures = {
        "scenario": "soak",
        "mode": chaos.mode,
        "soak_s": chaos.soak_s,
        "warmup_s": warmup_s,
        "rate": chaos.rate,
        "warmup_load": warm.figures(),
        "load": run.figures(),
        "processes": growth,
        "counters_under_load": under_load,
        "start": start,
        "end": end,
    }
    chaos.write("soak", figures)
    worst = max(growth.items(), key=lambda kv: kv[1]["rss_growth"])
    r0, r1 = start["redis"], end["redis"]
    print(
        f"[chaos] soak {chaos.soak_s:.0f}s: {len(run.results)} requests, "
        f"ok {run.count(Outcome.OK)}; worst RSS growth {worst[0]} {worst[1]['rss_growth']:+.1%};"
        f" redis keys {r0['dbsize']} -> {r1['dbsize']} (index bound {end['index_key_bound']}),"
        f" used_memory {r0['used_memory']} -> {r1['used_memory']};"
        f" counters_zero_s {end['counters_zero_s']}"
    )

    failures = []
    for o in (Outcome.FAILED_BEFORE_STREAM, Outcome.GATEWAY_GONE, Outcome.CUT_CLEAN,
              Outcome.CUT_UNCLEAN, Outcome.INCOMPLETE):  # fmt: skip
        if run.count(o):
            failures.append(f"{run.count(o)} {o} without any fault: {run.figures()['examples']}")
    if end["counters_zero_s"] is None:
        failures.append(f"counters not zero after the load: {end['counters_nonzero']}")
    if end["index"] != "exact":
        failures.append(f"index not exact at the end: {end['index']}")
    for name, g in growth.items():
        if g["fds"][1] > g["fds"][0] + FD_ALLOWANCE:
            failures.append(f"{name}: open fds {g['fds'][0]} -> {g['fds'][1]}")
        if chaos.soak_s >= 300 and g["rss_growth"] > RSS_GOAL:
            failures.append(f"{name}: RSS {g['rss_kb'][0]} -> {g['rss_kb'][1]} kB "
                            f"({g['rss_growth']:+.1%}, goal +{RSS_GOAL:.0%})")  # fmt: skip
    per_host = {KEYSPACE.control(w.name) for w in fleet.workers} | {
        KEYSPACE.events(w.name) for w in fleet.workers
    }
    new_keys = sorted(set(r1["non_index_keys"]) - set(r0["non_index_keys"]) - per_host)
    if new_keys:
        failures.append(f"Redis keys outside the index appeared: {new_keys[:10]}")
    index_keys = r1["keys_by_kind"].get("index", 0)
    if index_keys > end["index_key_bound"]:
        failures.append(f"{index_keys} index keys for {end['blocks_held']} blocks held "
                        f"(bound {end['index_key_bound']})")  # fmt: skip
    assert not failures, "soak: " + "; ".join(failures)
