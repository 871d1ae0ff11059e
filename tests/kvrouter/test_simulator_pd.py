"""The offline simulator's prefill/decode roles, KV transfer time and pooled prefixes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest

from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView
from kvrouter.bench import simulator
from kvrouter.bench.report import RequestRecord, goodput_rps, summarize
from kvrouter.bench.simulator import SimConfig, SimResult, simulate
from kvrouter.bench.trace import TraceRecord
from kvrouter.bench.workloads import GroupsWorkload, generate
from kvrouter.gateway.pd import PdPlan, PdPlanner
from kvrouter.policy_factory import build_policy
from policies.base import Decision, RouteRequest

GROUPS = GroupsWorkload(
    groups=3, users=4, system_tokens=2048, question_tokens=256, output_tokens=64, requests=36,
    rate=4.0,
)  # fmt: skip
BASE = SimConfig(workers=1, hbm_blocks=2000, dram_blocks=0, ssd_blocks=0, max_num_seqs=32)


def run(
    trace: list[TraceRecord], config: SimConfig, policy: str = "kv_ttft", pooling: bool = True
) -> SimResult:
    return simulate(trace, build_policy(policy, seed=0, pooling=pooling), config)


def test_always_prefills_on_prefill_workers_and_decodes_on_decode_workers() -> None:
    trace = generate(GROUPS, seed=1)
    config = dataclasses.replace(BASE, workers=0, prefill_workers=1, decode_workers=1, pd="always")
    result = run(trace, config)
    assert {r.worker for r in result.records} == {"d0"}
    assert result.busy_s["p0"] > 0
    assert result.busy_s["d0"] > 0
    assert all(r.finish_s is not None for r in result.records)
    assert all(
        r.output_tokens == t.output_length for r, t in zip(result.records, trace, strict=True)
    )
    # No block left referenced, and the index saw the decoder's imported blocks.
    assert set(result.in_use_blocks.values()) == {0}
    assert result.index_entries == result.cached_blocks
    # The hit rate is the prefill side's: the shared system prompts are reused there.
    assert summarize("pd", result.records, result.busy_s).hit_rate > 0.5


def test_the_transfer_time_is_part_of_the_ttft() -> None:
    # Distinct prompts, far apart: each hands all of its full blocks to the decoder.
    trace = [TraceRecord(2000.0 * i, 3000, 16, list(range(10 * i, 10 * i + 6))) for i in range(6)]
    fast = dataclasses.replace(
        BASE, workers=0, prefill_workers=1, decode_workers=1, pd="always", transfer_bandwidth=1e13
    )
    slow = dataclasses.replace(fast, transfer_bandwidth=1e9)
    quick, late = run(trace, fast), run(trace, slow)
    profile = BASE.effective_profile()
    for a, b, rec in zip(quick.records, late.records, trace, strict=True):
        assert a.ttft_s is not None
        assert b.ttft_s is not None
        # Every full block of the prompt crosses the network after the prefill.
        moved = (rec.input_length // 16) * 16 * profile.kv_bytes_per_token
        assert b.ttft_s - a.ttft_s == pytest.approx(moved / 1e9 - moved / 1e13, rel=0.05)


def test_decode_alone_on_its_workers_keeps_the_time_per_token_steady() -> None:
    # Long prompts arriving while others decode: colocated, each prefill chunk lengthens
    # the decode steps it shares; with PD the decoders never run a long prefill.
    workload = GroupsWorkload(
        groups=20, users=2, system_tokens=8192, question_tokens=2048, output_tokens=128,
        requests=40, rate=3.0,
    )  # fmt: skip
    trace = generate(workload, seed=3)
    big = dataclasses.replace(BASE, hbm_blocks=8000)
    # Pooling off on both sides: it changes which prefills run, not where decode runs.
    colocated = run(trace, dataclasses.replace(big, workers=2), pooling=False)
    pd = dataclasses.replace(big, workers=0, prefill_workers=1, decode_workers=1, pd="always")
    split = run(trace, pd, pooling=False)
    tpot = summarize("c", colocated.records, colocated.busy_s).tpot_p90_s
    pd_tpot = summarize("pd", split.records, split.busy_s).tpot_p90_s
    assert pd_tpot < 0.8 * tpot


class PoolToSecond:
    """Routes the first request to w0 and every later one to w1, naming w0 as KV source."""

    name = "pool_to_second"

    def __init__(self) -> None:
        self.seen = 0

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:  # fmt: skip
        self.seen += 1
        if self.seen == 1:
            return Decision(worker="w0", policy=self.name)
        held = matches["w0"].blocks if "w0" in matches else 0
        return Decision(worker="w1", policy=self.name, matched_blocks=held, kv_source="w0")


def test_a_pooled_prefix_is_pulled_from_the_peer_before_the_request_runs() -> None:
    prompt = TraceRecord(0.0, 4096, 8, list(range(8)))
    again = TraceRecord(2000.0, 4096 + 512, 8, [*range(8), 99])
    config = dataclasses.replace(BASE, workers=2, transfer_bandwidth=1e9)
    result = simulate([prompt, again], PoolToSecond(), config)
    first, second = result.records
    assert (first.worker, second.worker) == ("w0", "w1")
    # The second request found the first's 4,096 tokens in w1's HBM: pulled, not computed.
    assert second.cached_tokens[0] == 4096
    moved = 4096 * config.effective_profile().kv_bytes_per_token
    assert second.ttft_s is not None
    assert second.ttft_s > moved / 1e9
    assert set(result.in_use_blocks.values()) == {0}
    assert result.index_entries == result.cached_blocks


class Scripted:
    """Routes the n-th request to ``hosts[n]``, pulling from ``sources[n]`` when set."""

    name = "scripted"

    def __init__(self, hosts: Sequence[str], sources: Sequence[str | None]) -> None:
        self.hosts, self.sources, self.seen = hosts, sources, 0

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:  # fmt: skip
        host, source = self.hosts[self.seen], self.sources[self.seen]
        self.seen += 1
        held = matches[source].blocks if source is not None and source in matches else 0
        return Decision(worker=host, policy=self.name, matched_blocks=held, kv_source=source)


def test_a_prefix_pulled_off_a_peers_ssd_arrives_no_faster_than_that_ssd_reads() -> None:
    # w0 computes a 4,096-token prompt, then another that pushes the first out of its
    # 300-block HBM onto SSD; w1 then pulls the first prompt's blocks from w0. The network
    # is nearly free, so the pull takes what w0's SSD needs to read 0.5 GB (~90 ms at the
    # H100 profile's 6 GB/s), not the ~0.5 ms the network alone would.
    first = TraceRecord(0.0, 4096, 8, list(range(8)))
    other = TraceRecord(1000.0, 4096, 8, list(range(100, 108)))
    again = TraceRecord(3000.0, 4096 + 512, 8, [*range(8), 99])
    config = dataclasses.replace(
        BASE, workers=2, hbm_blocks=300, ssd_blocks=2000, transfer_bandwidth=1e12
    )
    policy = Scripted(["w0", "w0", "w1"], [None, None, "w0"])
    result = simulate([first, other, again], policy, config)
    pulled = result.records[2]
    assert pulled.worker == "w1"
    assert pulled.cached_tokens[0] == 4096
    profile = config.effective_profile()
    ssd_read = profile.load_seconds(4096, Medium.SSD)
    assert ssd_read > 0.05
    assert pulled.ttft_s is not None
    assert pulled.ttft_s >= ssd_read
    # The same pull from w0's HBM (nothing pushed it out) is bound by the network only.
    roomy = dataclasses.replace(config, hbm_blocks=2000)
    fast = simulate([first, other, again], Scripted(["w0", "w0", "w1"], [None, None, "w0"]), roomy)
    assert fast.records[2].cached_tokens[0] == 4096
    assert fast.records[2].ttft_s is not None
    assert fast.records[2].ttft_s < ssd_read / 2
    assert set(result.in_use_blocks.values()) == {0}


class PoolAndWatch(PoolToSecond):
    """PoolToSecond that keeps the views each request was routed on."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list[dict[str, WorkerView]] = []

    def choose(
        self, request: RouteRequest, workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:  # fmt: skip
        self.views.append({w.host: w for w in workers})
        return super().choose(request, workers, matches)


def test_a_request_waiting_for_its_pull_counts_as_load_on_its_worker() -> None:
    # As the gateway counts a request when it dispatches it, before the worker pulls,
    # the replay shows a request whose prefix is in flight to w1 in w1's load.
    prompt = TraceRecord(0.0, 4096, 8, list(range(8)))
    again = TraceRecord(2000.0, 4096 + 512, 8, [*range(8), 99])
    during = TraceRecord(2010.0, 64, 8, [500])  # the 0.5 GB pull takes ~0.5 s
    config = dataclasses.replace(BASE, workers=2, transfer_bandwidth=1e9)
    policy = PoolAndWatch()
    result = simulate([prompt, again, during], policy, config)
    seen = policy.views[2]["w1"]
    assert seen.in_flight == 1
    assert seen.queued_prefill_tokens >= 512
    assert result.records[1].cached_tokens[0] == 4096
    assert set(result.in_use_blocks.values()) == {0}


def test_goodput_counts_requests_within_both_slos() -> None:
    records = [
        RequestRecord(0, "w", 0.0, 10, first_token_s=0.1, finish_s=1.1, output_tokens=11),
        RequestRecord(1, "w", 0.0, 10, first_token_s=0.5, finish_s=1.5, output_tokens=11),
        RequestRecord(2, "w", 1.0, 10, first_token_s=1.1, finish_s=4.1, output_tokens=11),
        RequestRecord(3, "w", 1.0, 10, first_token_s=1.2, finish_s=1.2, output_tokens=1),
    ]
    # TTFT <= 0.2 s and TPOT <= 0.1 s: requests 0 and 3 (one token: no TPOT); 4.1 s long.
    assert goodput_rps(records, 0.2, 0.1) == pytest.approx(2 / 4.1)
    assert goodput_rps([], 0.2, 0.1) == 0.0


def test_the_worker_a_colocated_plan_moves_a_request_to_pulls_what_the_plan_priced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The policy runs everything on w0 (the only worker taking whole requests); a scripted
    # plan moves the third request onto the decode worker d0, pulling w0's copy of the
    # 4,096-token prefix, as the gateway asks d0 to. The replay pulls it and counts what
    # d0 still prefills.
    class MoveThird(PdPlanner):
        def plan(
            self, workers: Sequence[WorkerView], prefill: str, prefill_ttft_s: float | None,
            num_tokens: int, block_size: int, matches: Mapping[str, PrefixMatch],
            now: float = 0.0,
        ) -> PdPlan:  # fmt: skip
            if num_tokens != 4096 + 512:
                return PdPlan(False, prefill, None, "cheaper_local")
            held = matches["w0"].blocks
            return PdPlan(False, "d0", None, "cheaper_local", {}, held, "w0")

    monkeypatch.setattr(simulator, "PdPlanner", MoveThird)
    trace = [
        TraceRecord(0.0, 4096, 8, list(range(8))),
        TraceRecord(1000.0, 64, 8, [500]),
        TraceRecord(2000.0, 4096 + 512, 8, [*range(8), 99]),
    ]
    config = dataclasses.replace(
        BASE, workers=1, decode_workers=1, pd="auto", transfer_bandwidth=1e9
    )
    result = run(trace, config)
    moved = result.records[2]
    assert (moved.worker, moved.prefill_worker) == ("d0", None)
    assert moved.cached_tokens[0] == 4096  # pulled, not computed
    assert moved.ttft_s is not None
    assert moved.ttft_s > 4096 * config.effective_profile().kv_bytes_per_token / 1e9
    assert set(result.in_use_blocks.values()) == {0}
    assert result.index_entries == result.cached_blocks
