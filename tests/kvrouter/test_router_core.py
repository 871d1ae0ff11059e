"""The simulator and the gateway route through one core: same inputs, same decisions."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import pytest
from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from engine_worker.protocol import CompletionRequest
from indexer.events import BlockStored, Event, EventBatch
from indexer.index.memory import MemoryIndex
from indexer.keys import root_parent
from indexer.media import MEDIA, Medium
from indexer.views import PrefixMatch, Role, WorkerView
from kvrouter.bench.simulator import SimConfig, simulate
from kvrouter.bench.trace import PromptFactory, TraceRecord
from kvrouter.bench.workloads import ChatWorkload, generate
from kvrouter.gateway.affinity import SessionAffinity
from kvrouter.gateway.app import _load_models
from kvrouter.gateway.discovery import WorkerDirectory
from kvrouter.gateway.load import HeldBlocks, Load, LoadTracker
from kvrouter.gateway.metrics import RouterMetrics
from kvrouter.gateway.pd import PdPlanner
from kvrouter.gateway.routing import Router
from kvrouter.policy_factory import build_policy
from kvrouter.router_core import RouterCore, annotate_idle, overlay
from policies.base import Decision, PlacingPolicy, Policy, RouteRequest
from policies.cost_model import prefill_context
from policies.kv_ttft import KvTtftPolicy
from tests.policies.support import BLOCK, PROFILE, match, request, tokens, view

MODEL = "tiny"
#: Sessions cross prefixes in the trace below, so affinity overrules it now and then.
POLICY = "llmd_precise"


@dataclass
class _Seen:
    """What the simulator's policy was given and answered, one routing."""

    request: RouteRequest
    workers: list[WorkerView]
    matches: dict[str, PrefixMatch]
    decision: Decision


class _Recording:
    """A real policy that also keeps what it was asked (to replay it through the gateway)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[_Seen] = []

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matches: Mapping[str, PrefixMatch],
    ) -> Decision:
        decision = self.inner.choose(request, workers, matches)
        self.seen.append(_Seen(request, list(workers), dict(matches), decision))
        return decision


def _index_answering(keys: tuple[int, ...], matches: dict[str, PrefixMatch]) -> MemoryIndex:
    """A real in-memory index whose answer for ``keys`` is ``matches``."""
    index = MemoryIndex()
    for host, m in matches.items():
        events: list[Event] = []
        at = 0
        for medium, n in zip(MEDIA, m.per_medium, strict=True):
            if n:
                events.append(BlockStored(list(keys[at : at + n]), None, medium))
                at += n
        index.apply_sync(EventBatch(host, 1, 1, 0.0, events))
    assert index.match_sync(list(keys)) == matches
    return index


def test_a_trace_routes_the_same_through_the_simulator_and_the_gateway() -> None:
    # Chat sessions (affinity), heartbeats staler than the trace's gaps (the overlay).
    chat = ChatWorkload(sessions=6, turns=3, system_tokens=256, user_tokens=96, answer_tokens=16)
    trace = [
        msgspec.structs.replace(r, session_id=f"s{i % 2}") for i, r in enumerate(generate(chat))
    ]
    config = SimConfig(
        workers=4, model=MODEL, hbm_blocks=200, dram_blocks=100, ssd_blocks=0,
        view_interval_s=0.5, vocab_size=4096,
    )  # fmt: skip
    recording = _Recording(build_policy(POLICY))
    result = simulate(trace, recording, config)
    assert len(recording.seen) == len(trace)

    factory = PromptFactory(config.block_size, _root(), vocab_size=config.vocab_size)
    metrics = RouterMetrics(CollectorRegistry())
    directory = WorkerDirectory(metrics=metrics, block_size=config.block_size, models={MODEL})
    router = Router(
        models=_load_models([MODEL]), directory=directory, index=MemoryIndex(),
        load=LoadTracker(), policy=build_policy(POLICY),
        fallback=build_policy("least_load"), metrics=metrics, block_size=config.block_size,
        max_prompt_tokens=10**6, affinity=SessionAffinity(),
    )  # fmt: skip
    by_index = {int(s.request.request_id[1:]): s for s in recording.seen}
    workers = {r.index: r.worker for r in result.records}

    async def replay() -> None:
        for i, seen in sorted(by_index.items(), key=lambda kv: kv[1].request.now):
            rec = trace[i]
            ids = factory.tokens(rec)
            # The gateway is given what the simulator's router knew: the views it routed
            # on (the overlay is idempotent) and an index answering the same matches.
            directory.views = {v.host: v for v in seen.workers}
            # (Without the router's ``idle_hbm`` annotation, which comes from the held keys
            # of its running requests; llmd_precise does not read it.)
            answer = {h: replace(m, idle_hbm=None) for h, m in seen.matches.items()}
            router.index = _index_answering(seen.request.block_keys, answer)
            body = CompletionRequest(model=MODEL, prompt=ids, max_tokens=rec.output_length)
            routed = await router.route(body, seen.request.request_id, rec.session_id, ids=ids)
            assert routed.request.block_keys == seen.request.block_keys
            assert routed.decision.scores == seen.decision.scores
            assert routed.worker == workers[i], f"request {i}"
            router.core.served(rec.session_id, routed.worker)

    asyncio.run(replay())
    # Affinity mattered somewhere: the policy's own choice was overruled at least once
    # (else the test would not show that both sides apply it).
    overruled = [i for i, s in by_index.items() if s.decision.worker != workers[i]]
    assert overruled


def _root() -> int:
    return root_parent(MODEL)


def test_session_affinity_keeps_each_session_on_its_worker_in_the_simulator() -> None:
    # Two sessions start together (so on two workers); their later turns arrive on an
    # idle cluster, where the policy alone sends everything to its first idle worker.
    starts = [TraceRecord(0.0, 64, 8, [0]), TraceRecord(1.0, 64, 8, [1])]
    later = [TraceRecord(10_000.0 * (k + 1), 64, 8, [k + 2]) for k in range(6)]
    trace = [*starts, *later]
    sessions = ["a", "b", *("a" if k % 2 == 0 else "b" for k in range(6))]
    tagged = [
        msgspec.structs.replace(r, session_id=s) for r, s in zip(trace, sessions, strict=True)
    ]
    config = SimConfig(workers=4, model=MODEL, hbm_blocks=100, dram_blocks=0, ssd_blocks=0)
    plain = simulate(trace, build_policy("least_load"), config).records
    kept = simulate(tagged, build_policy("least_load"), config).records
    assert {r.worker for r in plain[2:]} == {plain[0].worker}
    for session in ("a", "b"):
        served = {r.worker for r, s in zip(kept, sessions, strict=True) if s == session}
        assert len(served) == 1
    assert kept[0].worker != kept[1].worker


def test_the_overlay_shows_the_hbm_a_burst_has_filled_since_the_last_heartbeat() -> None:
    # "busy" and "roomy" both sent their last heartbeat idle and empty. Since then the
    # router sent "busy" 12 requests whose prompts (9,375 distinct blocks of its 10,000)
    # are prefilled and decoding. A 16K-token prompt whose first 4K tokens "busy" caches
    # would not fit beside them and their output: it would be preempted and wait.
    prompt = tokens(16_384, seed=31)
    heartbeats = [view("busy", mean_output=300.0), view("roomy", mean_output=300.0)]
    matches = {"busy": match("busy", hbm=4096 // BLOCK)}
    counts = {"busy": Load(in_flight=12, queued_tokens=0, held_blocks=9_375)}

    def load_of(host: str) -> Load:
        return counts.get(host, Load())

    laid = {v.host: v for v in overlay(heartbeats, load_of)}
    assert laid["busy"].kv_active_blocks == 9_375
    assert laid["busy"].in_flight == 12
    assert laid["roomy"] == heartbeats[1]
    # A heartbeat showing more than the router counts (another replica's requests) stays.
    fuller = replace(heartbeats[0], kv_active_blocks=9_800)
    assert overlay([fuller], load_of)[0].kv_active_blocks == 9_800

    # Without the held blocks (what the overlay laid before) the cached 4K tokens win.
    # (A fresh policy each time: kv_ttft remembers where it sent a prompt.)
    blind = RouterCore(KvTtftPolicy()).decide(
        request(prompt), heartbeats, lambda h: Load(load_of(h).in_flight), matches
    )
    assert blind.worker == "busy"
    seen = RouterCore(KvTtftPolicy()).decide(request(prompt), heartbeats, load_of, matches)
    assert seen.worker == "roomy"
    assert seen.decision.scores["busy"]["memory_wait_s"] > 0.0
    assert seen.decision.scores["roomy"]["memory_wait_s"] == 0.0


def test_the_overlay_drops_what_ended_since_the_heartbeat_and_keeps_what_it_did_not_send() -> None:
    # "cached" holds a 4K-token prefix. Its last heartbeat was taken while the router's
    # one request there was still prefilling (4,352 tokens queued, counted by the
    # router then too); that request has since got its first token. "cold" is idle.
    prompt = tokens(4_352, seed=32)
    heartbeat = view("cached", in_flight=1, running=1, queued=4_352, mean_output=200.0)
    views = [heartbeat, view("cold", mean_output=200.0)]
    matches = {"cached": match("cached", hbm=4096 // BLOCK)}
    then = {"cached": Load(in_flight=1, queued_tokens=4_352)}
    now = {"cached": Load(in_flight=1, held_blocks=272)}

    def load_of(host: str) -> Load:
        return now.get(host, Load())

    def seen_of(v: WorkerView) -> Load | None:
        return then.get(v.host, Load())

    # Larger-of-the-two keeps the drained queue for the rest of the interval.
    stale = overlay(views, load_of)[0]
    assert stale.queued_prefill_tokens == 4_352
    laid = overlay(views, load_of, seen_of)[0]
    assert (laid.queued_prefill_tokens, laid.in_flight, laid.kv_active_blocks) == (0, 1, 272)
    # What the heartbeat shows beyond the router's count then (another router's
    # requests) stays, on top of the router's count now.
    busier = replace(heartbeat, queued_prefill_tokens=6_000, in_flight=3, kv_active_blocks=500)
    foreign = overlay([busier], load_of, seen_of)[0]
    assert (foreign.queued_prefill_tokens, foreign.in_flight) == (6_000 - 4_352, 1 + 2)
    assert foreign.kv_active_blocks == 272 + 500

    # The stale queue sends the request to prefill 4K tokens again on "cold"; with the
    # heartbeat dated it reuses the prefix.
    blind = RouterCore(KvTtftPolicy()).decide(request(prompt), views, load_of, matches)
    assert blind.worker == "cold"
    dated = RouterCore(KvTtftPolicy()).decide(
        request(prompt), views, load_of, matches, seen_of=seen_of
    )
    assert dated.worker == "cached"
    # Nothing queued there: only the rest of the decode step in progress (its one
    # request, at the policy's mean decode context).
    queue = dated.decision.scores["cached"]["queue_s"]
    assert queue == pytest.approx(PROFILE.decode_seconds(1, 2048) / 2)


def test_the_overlay_carries_the_attention_work_of_the_prompts_routed_since_the_heartbeat() -> None:
    # Both heartbeats are empty. Since then the router queued one 60K-token prompt on
    # "long" and thirty 2K-token prompts on "short": the same tokens, but the long one
    # pays attention over its own growing context chunk after chunk.
    views = [view("long"), view("short")]
    counts = {
        "long": Load(1, 61_440, 0, prefill_context(61_440, 61_440)),
        "short": Load(30, 61_440, 0, 30 * prefill_context(2_048, 2_048), queued_taken=64),
    }

    def load_of(host: str) -> Load:
        return counts[host]

    for seen_of in (None, lambda v: Load()):
        laid = {v.host: v for v in overlay(views, load_of, seen_of)}
        assert laid["long"].queued_prefill_context == 61_440**2 // 2
        assert laid["short"].queued_prefill_context == 30 * 2_048**2 // 2
        assert (laid["short"].queued_taken_blocks, laid["long"].queued_taken_blocks) == (64, 0)
    # kv_ttft then sees the long queue as the slower one (tokens alone tie them).
    prompt = tokens(1_024, seed=33)
    out = RouterCore(KvTtftPolicy()).decide(request(prompt), views, load_of, {})
    scores = out.decision.scores
    assert scores["long"]["queue_s"] > 1.5 * scores["short"]["queue_s"]
    assert out.worker == "short"


def test_the_overlay_lays_the_loads_from_dram_and_ssd_of_what_the_router_queued() -> None:
    # The heartbeat was taken while the router's request on "w" waited to bring 1,080
    # blocks up from DRAM; it has had its first byte since, and the router has queued
    # another that loads 40 from SSD. Dated, the stale DRAM load goes at once; undated,
    # each medium shows the larger of the two figures.
    heartbeat = replace(view("w", running=1, queued=261), queued_load_blocks={Medium.DRAM: 1_080})
    then = Load(in_flight=1, queued_tokens=261, queued_taken=1_080, queued_dram=1_080)
    now = Load(in_flight=2, queued_tokens=300, queued_taken=40, queued_ssd=40)
    dated = overlay([heartbeat], lambda _: now, lambda _: then)[0]
    assert dated.queued_load_blocks == {Medium.SSD: 40}
    undated = overlay([heartbeat], lambda _: now)[0]
    assert undated.queued_load_blocks == {Medium.DRAM: 1_080, Medium.SSD: 40}
    # Nothing counted and nothing shown: no figure appears.
    assert overlay([view("idle")], lambda _: Load(in_flight=1))[0].queued_load_blocks == {}


def test_the_simulators_held_counts_follow_each_request_from_first_token_to_end() -> None:
    # A burst of long prompts inside one heartbeat interval: later arrivals see the KV the
    # earlier ones hold (the heartbeat at t=0 showed every worker empty); the replay then
    # checks that every count returned to zero (it raises otherwise).
    trace = [TraceRecord(50.0 * i, 2048, 64, [1000 + i]) for i in range(12)]
    config = SimConfig(
        workers=2, model=MODEL, hbm_blocks=1024, dram_blocks=0, ssd_blocks=0,
        view_interval_s=10.0, vocab_size=4096,
    )  # fmt: skip
    recording = _Recording(build_policy("kv_ttft"))
    result = simulate(trace, recording, config)
    assert all(r.finish_s is not None for r in result.records)
    late = recording.seen[-1].workers
    assert all(v.ts == 0.0 for v in late), "the burst must fit in one heartbeat interval"
    assert sum(v.kv_active_blocks for v in late) >= 2048 // config.block_size


def test_matched_hbm_blocks_no_running_request_holds_are_marked_idle() -> None:
    # w0 matches 4 blocks (3 in HBM, the last in DRAM); the router's running requests on
    # w0 hold key 11 only. Held blocks are in HBM, so of the other three matched blocks
    # one is the DRAM one and two are cached free HBM blocks.
    keys = (11, 12, 13, 14, 15)
    held = HeldBlocks()
    held.hold((11, 99))
    matches = {
        "w0": PrefixMatch("w0", 4, (3, 1, 0)),
        "w1": PrefixMatch("w1", 2, (2, 0, 0)),
        "w2": PrefixMatch("w2", 1, (0, 1, 0)),
    }
    marked = annotate_idle(matches, keys, {"w0": held}.get)
    assert marked["w0"] == PrefixMatch("w0", 4, (3, 1, 0), idle_hbm=2)
    assert marked["w1"].idle_hbm == 2  # nothing of ours runs there: all of it is free
    assert marked["w2"].idle_hbm is None  # nothing in HBM to mark
    held.release((11, 99))
    assert 11 not in held
    assert annotate_idle(matches, keys, {"w0": held}.get)["w0"].idle_hbm == 3
    # A longer chain: running requests hold its first 3 and first 5 blocks (a chain's
    # holder holds every block before the ones it holds); 8 matched, all in HBM.
    chain = tuple(range(100, 112))
    held.hold(chain[:3])
    held.hold(chain[:5])
    long = {"w0": PrefixMatch("w0", 8, (8, 0, 0))}
    assert annotate_idle(long, chain, {"w0": held}.get)["w0"].idle_hbm == 3


def test_kv_ttft_remembers_the_worker_the_planner_moved_a_request_to() -> None:
    # A prefill-only worker ``p`` and a decode-only ``d``, both idle. The policy sees
    # ``p`` only (decode-only workers are not its candidates); the PD planner runs the
    # cold prompt whole on the idle decoder instead (a split would add the transfer).
    # The same prompt comes again before the index shows d's blocks: the policy must
    # not think ``p`` computed it (its speculative prefix), or it predicts a cached
    # prefill on ``p`` that ``p`` recomputes in full, and the planner splits on it.
    p = replace(view("p"), role=Role.PREFILL)
    d = replace(view("d"), role=Role.DECODE)
    policy = build_policy("kv_ttft")
    assert isinstance(policy, PlacingPolicy)
    core = RouterCore(policy, planner=PdPlanner("auto", PROFILE))
    prompt = tokens(1024, seed=7)
    first = core.decide(request(prompt, now=0.0, rid="a"), [p, d], None, {})
    assert first.decision.worker == "p"
    assert first.plan is not None
    assert (first.plan.disaggregate, first.plan.prefill) == (False, "d")
    again = core.decide(request(prompt, now=0.01, rid="b"), [p, d], None, {})
    assert again.decision.scores["p"]["cached_tokens"] == 0
    assert again.decision.predicted_ttft_s == first.decision.predicted_ttft_s
    assert again.plan is not None
    assert (again.plan.disaggregate, again.plan.prefill) == (False, "d")
    # Used alone, the policy records its own choice, as before.
    alone = build_policy("kv_ttft")
    alone.choose(request(prompt, now=0.0, rid="a"), [p], {})
    assert (
        alone.choose(request(prompt, now=0.01, rid="b"), [p], {}).scores["p"]["cached_tokens"] > 0
    )


def test_the_overlay_drops_decodes_that_ended_since_the_heartbeat() -> None:
    # The heartbeat was taken while the router's 8 requests decoded there (16K tokens of
    # KV); all have finished since. Every prefill chunk on it would be priced beside a
    # batch of 8 for up to a heartbeat interval; laid over, the batch is gone.
    heartbeat = view("w", in_flight=8, running=8, running_kv=8 * 2_048)
    then = Load(in_flight=8, running=8)

    def seen_of(v: WorkerView) -> Load | None:
        return then

    idle = overlay([heartbeat], lambda host: Load(), seen_of)[0]
    assert (idle.in_flight, idle.running, idle.running_kv_tokens) == (0, 0, 0)
    # Decodes the router did not send (another replica's: 2 beyond its 8) stay, their
    # KV a mean share of the heartbeat's.
    shared = replace(heartbeat, running=10, running_kv_tokens=10 * 2_048)
    laid = overlay([shared], lambda host: Load(running=1), seen_of)[0]
    assert (laid.running, laid.running_kv_tokens) == (1 + 2, 3 * 2_048)
    # What kv_ttft predicts there: as on an idle worker, not beside a batch of 8.
    prompt = request(tokens(2_048, seed=5))

    def core() -> RouterCore:  # a fresh policy each time: no speculative entries
        return RouterCore(KvTtftPolicy())

    stale = core().decide(prompt, [heartbeat], None, {}).decision.predicted_ttft_s
    dated = core().decide(prompt, [heartbeat], lambda h: Load(), {}, seen_of=seen_of)
    fresh = core().decide(prompt, [view("w")], None, {})
    alone = fresh.decision.predicted_ttft_s
    assert alone is not None
    assert dated.decision.predicted_ttft_s == alone
    assert stale is not None
    assert stale > alone
