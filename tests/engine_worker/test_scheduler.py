"""The scheduler's step: continuous batching, chunked prefill, prefix reuse, preemption."""

from __future__ import annotations

import pytest

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.request import FinishReason, Request, RequestStatus, SamplingParams
from engine_worker.runners.sim import SimRunner
from engine_worker.scheduler import (
    OutputLengths,
    RequestTooLargeError,
    Scheduler,
    SchedulerConfig,
    SchedulerPlan,
)
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.profile import TimingProfile
from tests.engine_worker.event_replay import EventReplay

B = 4
ROOT = root_parent("m")
PROFILE = TimingProfile(
    name="t",
    prefill=(1e-3, 1e-5, 0.0, 0.0),
    decode=(1e-3, 1e-5, 0.0),
    kv_bytes_per_token=1024,
    load_bandwidth={Medium.DRAM: 1e9, Medium.SSD: 1e8},
)


def make(
    hbm: int = 64, dram: int = 0, ssd: int = 0, async_loads: bool = False, **cfg: int
) -> tuple[Scheduler, SimRunner, BlockPool]:
    pool = BlockPool(TierCapacity(hbm=hbm, dram=dram, ssd=ssd))
    config = SchedulerConfig(
        max_num_seqs=cfg.get("max_num_seqs", 8),
        max_num_batched_tokens=cfg.get("budget", 64),
        max_model_len=cfg.get("max_model_len", 64),
        async_loads=async_loads,
    )
    return Scheduler(config, pool, B), SimRunner(PROFILE, B, vocab_size=1000), pool


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), ROOT, B)  # type: ignore[arg-type]


def run_to_end(s: Scheduler, r: SimRunner, max_steps: int = 1000) -> list[list[tuple[str, int]]]:
    """Step until idle; returns per step the (request id, new tokens) scheduled."""
    trace: list[list[tuple[str, int]]] = []
    for _ in range(max_steps):
        if not s.has_work():
            return trace
        plan = s.schedule()
        trace.append([(x.request.request_id, x.num_new) for x in plan.seqs])
        s.update(plan, r.execute(plan).sampled)
    raise AssertionError("scheduler did not drain")


def in_use(pool: BlockPool) -> int:
    return pool.capacity().hbm - pool.num_free()


def cache_on_dram(s: Scheduler, r: SimRunner, pool: BlockPool) -> None:
    """Cache the prompt ``range(24)`` (6 blocks), then push it out of HBM into DRAM
    with other traffic (on ``make(hbm=16, dram=32, max_model_len=32)``)."""
    s.add(req("a", list(range(24)), max_tokens=1))
    run_to_end(s, r)
    for i in range(3):
        s.add(req(f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 28)), max_tokens=1))
        run_to_end(s, r)
    keys = block_keys(list(range(24)), B, ROOT)
    assert [b.medium for b in pool.match_prefix(keys)] == [Medium.DRAM] * 6


def test_a_request_prefills_decodes_finishes_and_returns_its_blocks() -> None:
    s, r, pool = make()
    a = req("a", list(range(10)), max_tokens=5)
    s.add(a)
    trace = run_to_end(s, r)
    assert trace[0] == [("a", 10)]
    assert trace[1:] == [[("a", 1)]] * 4
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.LENGTH
    assert len(a.output_token_ids) == 5
    assert in_use(pool) == 0
    # Full blocks of prompt + output stay cached for the next request.
    keys = block_keys(a.prompt_token_ids + a.output_token_ids, B, ROOT)
    assert len(pool.match_prefix(keys)) == len(keys) == 3


def test_long_prompts_are_chunked_and_only_the_last_chunk_samples() -> None:
    s, r, _ = make(budget=8, max_model_len=64)
    a = req("a", list(range(21)), max_tokens=1)
    s.add(a)
    plans = []
    while s.has_work():
        plan = s.schedule()
        plans.append([(x.num_cached, x.num_new, x.want_logits) for x in plan.seqs])
        s.update(plan, r.execute(plan).sampled)
    assert plans == [[(0, 8, False)], [(8, 8, False)], [(16, 5, True)]]
    assert len(a.output_token_ids) == 1


def test_decodes_and_prefill_chunks_share_a_step_within_the_budget() -> None:
    s, r, _ = make(budget=8)
    s.add(req("a", list(range(4)), max_tokens=10))
    first = s.schedule()
    s.update(first, r.execute(first).sampled)
    s.add(req("b", list(range(100, 120)), max_tokens=2))
    plan = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in plan.seqs] == [("a", 1), ("b", 7)]
    assert plan.num_batched_tokens == 8


def test_a_shared_prefix_is_reused_and_reported_per_medium() -> None:
    s, r, _ = make()
    prefix = list(range(12))
    s.add(req("a", [*prefix, 50, 51], max_tokens=1))
    run_to_end(s, r)
    b = req("b", [*prefix, 60, 61, 62], max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert [(x.num_cached, x.num_new) for x in plan.seqs] == [(12, 3)]
    assert b.cached_by_medium() == {Medium.HBM: 12, Medium.DRAM: 0, Medium.SSD: 0}


def test_a_full_hit_still_computes_the_last_block() -> None:
    s, r, _ = make()
    prompt = list(range(16))
    s.add(req("a", prompt, max_tokens=1))
    run_to_end(s, r)
    s.add(req("b", prompt, max_tokens=1))
    plan = s.schedule()
    assert [(x.num_cached, x.num_new, x.want_logits) for x in plan.seqs] == [(12, 4, True)]


def test_prefix_caching_can_be_turned_off() -> None:
    pool = BlockPool(TierCapacity(hbm=64))
    s = Scheduler(SchedulerConfig(max_model_len=64, enable_prefix_caching=False), pool, B)
    r = SimRunner(PROFILE, B, vocab_size=1000)
    s.add(req("a", list(range(12)), max_tokens=1))
    run_to_end(s, r)
    s.add(req("b", list(range(12)), max_tokens=1))
    assert [x.num_cached for x in s.schedule().seqs] == [0]
    assert pool.take_events() == []


def test_demoted_prefix_is_promoted_from_dram_and_its_load_is_planned() -> None:
    s, r, pool = make(hbm=16, dram=32, max_model_len=32)
    cache_on_dram(s, r, pool)
    keys = block_keys(list(range(24)), B, ROOT)
    b = req("b", [*range(24), 7, 7], max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert plan.loaded_blocks == {Medium.DRAM: 6}
    assert b.cached_by_medium()[Medium.DRAM] == 24
    assert all(blk.medium is Medium.HBM for blk in b.block_table)
    s.update(plan, r.execute(plan).sampled)
    assert {blk.medium for blk in pool.match_prefix(keys)} == {Medium.HBM}


def test_preemption_by_recompute_when_hbm_runs_out_and_everyone_finishes() -> None:
    # 8 HBM blocks = 32 tokens; two requests that each grow to 7 blocks cannot both fit.
    s, r, pool = make(hbm=8, max_model_len=32)
    a = req("a", list(range(8)), max_tokens=20)
    b = req("b", list(range(100, 108)), max_tokens=20)
    s.add(a)
    s.add(b)
    preempted = []
    while s.has_work():
        plan = s.schedule()
        preempted += [p.request_id for p in plan.preempted]
        s.update(plan, r.execute(plan).sampled)
    assert preempted, "the workload must have forced a preemption"
    assert "b" in preempted  # the newest request yields first
    assert len(a.output_token_ids) == 20
    assert len(b.output_token_ids) == 20
    assert b.num_preemptions >= 1
    assert in_use(pool) == 0


def test_preempted_output_is_kept_and_recomputed() -> None:
    s, r, _ = make(hbm=8, max_model_len=32)
    a = req("a", list(range(8)), max_tokens=20)
    b = req("b", list(range(100, 108)), max_tokens=20)
    s.add(a)
    s.add(b)
    alone_s, alone_r, _ = make(hbm=8, max_model_len=32)
    b_alone = req("b", list(range(100, 108)), max_tokens=20)
    alone_s.add(b_alone)
    run_to_end(alone_s, alone_r)
    run_to_end(s, r)
    # Placeholder tokens depend on (request, position) only, so recompute changes nothing.
    assert b.output_token_ids == b_alone.output_token_ids


def test_max_num_seqs_caps_the_batch_and_waiting_requests_never_overtake() -> None:
    s, r, _ = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", list(range(i * 10, i * 10 + 5)), max_tokens=3))
    plan = s.schedule()
    assert [x.request.request_id for x in plan.seqs] == ["r0", "r1"]
    assert s.num_waiting == 2
    trace = run_to_end(s, r)
    first_seen: dict[str, int] = {}
    for step, seqs in enumerate(trace):
        for rid, _ in seqs:
            first_seen.setdefault(rid, step)
    assert first_seen["r2"] <= first_seen["r3"]


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    s, r, pool = make(max_num_seqs=1)
    s.add(req("a", list(range(9)), max_tokens=10))
    s.add(req("b", list(range(50, 59)), max_tokens=10))
    plan = s.schedule()
    s.update(plan, r.execute(plan).sampled)
    assert in_use(pool) > 0
    aborted = s.abort("a")
    assert aborted is not None
    assert aborted.finish_reason is FinishReason.ABORT
    assert in_use(pool) == 0
    assert s.abort("b") is not None
    assert s.abort("nope") is None
    assert not s.has_work()


def test_stop_tokens_and_eos_finish_with_stop() -> None:
    s, _, _ = make()
    eos = Request("b", list(range(5)), SamplingParams(max_tokens=50), ROOT, B, frozenset({999}))
    s.add(eos)
    out = s.update(s.schedule(), {"b": 999})
    assert out[0].finished
    assert eos.finish_reason is FinishReason.STOP
    ignoring = Request(
        "c", list(range(5)), SamplingParams(max_tokens=50, ignore_eos=True), ROOT, B,
        frozenset({999}),
    )  # fmt: skip
    s.add(ignoring)
    assert not s.update(s.schedule(), {"c": 999})[0].finished
    stop = req("d", list(range(5)), max_tokens=50, stop_token_ids=(7,))
    s.add(stop)
    plan = s.schedule()
    outs = s.update(plan, {"c": 1, "d": 7})
    assert [o.finish_reason for o in outs if o.request is stop] == [FinishReason.STOP]


def test_requests_that_can_never_fit_are_refused() -> None:
    s, _, _ = make(max_model_len=32)
    with pytest.raises(RequestTooLargeError, match="context length"):
        s.add(req("a", list(range(30)), max_tokens=5))
    with pytest.raises(RequestTooLargeError, match="empty"):
        s.add(req("b", [], max_tokens=5))
    s.add(req("c", [1], max_tokens=1))
    with pytest.raises(ValueError, match="duplicate"):
        s.add(req("c", [1], max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=1000), BlockPool(TierCapacity(hbm=4)), B)


def test_events_of_a_mixed_workload_replay_to_the_pool_content() -> None:
    s, r, pool = make(hbm=12, dram=8, ssd=8, max_model_len=40, max_num_seqs=3)
    replay = EventReplay()
    shared = list(range(16))
    for i in range(12):
        prompt = (
            [*shared, *range(100 * i, 100 * i + 4 + i)] if i % 2 else list(range(7 * i, 7 * i + 9))
        )
        s.add(req(f"r{i}", prompt, max_tokens=3 + i % 4))
        for _ in range(3):
            if s.has_work():
                plan = s.schedule()
                s.update(plan, r.execute(plan).sampled)
                replay.apply(pool.take_events())
                assert replay.matches(pool.snapshot())
    run_to_end(s, r)
    replay.apply(pool.take_events())
    assert replay.matches(pool.snapshot())
    assert in_use(pool) == 0


def test_queued_prefill_tokens_discount_the_prefix_a_waiting_request_will_hit() -> None:
    s, r, _ = make(max_num_seqs=1)
    shared = list(range(32))
    s.add(req("a", [*shared, 1, 2], max_tokens=1))
    run_to_end(s, r)
    s.add(req("busy", list(range(500, 510)), max_tokens=50))
    s.update(s.schedule(), {"busy": 1})  # "busy" runs; the next ones wait (max_num_seqs=1)
    s.add(req("hit", [*shared, 7, 7, 7], max_tokens=1))
    s.add(req("cold", list(range(900, 935)), max_tokens=1))
    # "hit" will reuse the 32 cached tokens: only its 3 new tokens are queued work.
    assert s.queued_prefill_tokens() == 3 + 35


def test_load_reports_the_cached_blocks_waiting_requests_take_from_the_free_pool() -> None:
    s, r, _ = make(max_num_seqs=1)
    shared = list(range(32))  # 8 blocks
    s.add(req("a", [*shared, 1, 2], max_tokens=1))
    run_to_end(s, r)  # its blocks stay cached, free: no running request holds them
    s.add(req("busy", list(range(500, 510)), max_tokens=50))
    s.update(s.schedule(), {"busy": 1})  # "busy" runs; the next ones wait (max_num_seqs=1)
    s.add(req("hit", [*shared, 7, 7, 7], max_tokens=1))
    # "hit" computes 3 tokens, but admitting it takes its 8 cached blocks out of the
    # free queue: HBM room a request queued behind it cannot have.
    assert s.load().queued_taken_blocks == len(shared) // B
    s.add(req("cold", list(range(900, 935)), max_tokens=1))
    assert s.load().queued_taken_blocks == len(shared) // B
    run_to_end(s, r)
    assert s.load().queued_taken_blocks == 0


def test_load_reports_the_lower_tier_blocks_queued_and_admitted_requests_bring_up() -> None:
    s, r, pool = make(hbm=16, dram=32, max_model_len=32, max_num_seqs=1)
    cache_on_dram(s, r, pool)
    s.add(req("busy", list(range(500, 510)), max_tokens=3))
    s.update(s.schedule(), {"busy": 1})  # "busy" runs; the next one waits (max_num_seqs=1)
    s.add(req("b", [*range(24), 7, 7], max_tokens=1))
    # Admitting "b" brings its 6 blocks up from DRAM before computing 2 tokens: whatever
    # queues behind it waits for that load, queued or in the step that admits it.
    assert s.load().queued_load_blocks == {Medium.DRAM: 6}
    while True:
        plan = s.schedule()
        if any(x.request.request_id == "b" for x in plan.seqs):
            break
        s.update(plan, r.execute(plan).sampled)
    assert plan.loaded_blocks == {Medium.DRAM: 6}
    assert s.load().queued_load_blocks == {Medium.DRAM: 6}
    s.update(plan, r.execute(plan).sampled)
    assert s.load().queued_load_blocks == {}
    assert {b.medium for b in pool.match_prefix(block_keys(list(range(24)), B, ROOT))} == {
        Medium.HBM
    }


def test_with_async_loads_a_dram_prefix_loads_beside_the_steps_and_nobody_waits() -> None:
    s, r, pool = make(hbm=16, dram=32, max_model_len=32, async_loads=True)
    cache_on_dram(s, r, pool)
    s.add(req("busy", list(range(500, 510)), max_tokens=8))
    s.update(s.schedule(), {"busy": 1})  # "busy" decodes from now on
    b = req("b", [*range(24), 7, 7], max_tokens=2)
    s.add(b)
    plan = s.schedule()
    # "b" is admitted to load its 6 DRAM blocks: it computes nothing in this step, and
    # the step, which "busy" decodes in, loads nothing (its time is the decode's alone).
    assert [x.request.request_id for x in plan.seqs] == ["busy"]
    assert [(q.request_id, media) for q, media in plan.loads] == [("b", {Medium.DRAM: 6})]
    assert plan.loaded_blocks == {}
    assert r.execute(plan).duration_s == PROFILE.step_seconds([], *plan.decode_batch())
    assert b.status is RequestStatus.LOADING
    assert all(blk.medium is Medium.HBM for blk in b.block_table)
    assert len(b.block_table) == 6
    load = s.load()
    assert (load.running, load.waiting, load.queued_load_blocks) == (1, 1, {Medium.DRAM: 6})
    assert load.queued_prefill_tokens == 2  # what it computes once loaded
    # However many steps pass, it computes nothing until its load is done.
    for _ in range(3):
        s.update(plan, r.execute(plan).sampled)
        plan = s.schedule()
        assert [x.request.request_id for x in plan.seqs] == ["busy"]
    s.update(plan, r.execute(plan).sampled)
    s.loaded("b")
    plan = s.schedule()
    seq = next(x for x in plan.seqs if x.request is b)
    assert (seq.num_cached, seq.num_new) == (24, 2)
    assert b.cached_by_medium()[Medium.DRAM] == 24
    assert s.load().queued_load_blocks == {}
    s.update(plan, r.execute(plan).sampled)
    run_to_end(s, r)
    assert b.finish_reason is FinishReason.LENGTH
    assert len(b.output_token_ids) == 2
    assert in_use(pool) == 0


def test_requests_loading_count_against_max_num_seqs() -> None:
    s, r, pool = make(hbm=16, dram=32, max_model_len=32, async_loads=True, max_num_seqs=1)
    cache_on_dram(s, r, pool)
    s.add(req("b", [*range(24), 7, 7], max_tokens=1))
    s.add(req("c", list(range(300, 304)), max_tokens=1))
    plan = s.schedule()
    # "b" loads; "c" would make two sequences once "b" runs: it waits.
    assert [q.request_id for q, _ in plan.loads] == ["b"]
    assert plan.seqs == []
    s.loaded("b")
    assert [x.request.request_id for x in s.schedule().seqs] == ["b"]


def test_a_request_aborted_while_loading_frees_its_blocks_and_its_load_is_ignored() -> None:
    s, r, pool = make(hbm=16, dram=32, max_model_len=32, async_loads=True)
    cache_on_dram(s, r, pool)
    s.add(req("b", [*range(24), 7, 7], max_tokens=2))
    plan = s.schedule()
    assert plan.empty
    assert len(plan.loads) == 1
    assert in_use(pool) == 6
    assert s.has_work()
    assert not s.can_schedule()
    aborted = s.abort("b")
    assert aborted is not None
    assert aborted.finish_reason is FinishReason.ABORT
    assert in_use(pool) == 0
    assert not s.has_work()
    s.loaded("b")  # the load it started lands after all: nothing happens
    assert not s.has_work()
    assert s.schedule().empty
    # Its blocks stay cached (in HBM now): the next request reuses them.
    c = req("c", [*range(24), 8], max_tokens=1)
    s.add(c)
    plan = s.schedule()
    assert not plan.loads
    assert c.cached_by_medium()[Medium.HBM] == 24


def test_a_prefix_a_running_request_holds_is_not_taken_again() -> None:
    s, _, _ = make(max_num_seqs=1)
    shared = list(range(32))
    s.add(req("holder", [*shared, 1, 2], max_tokens=20))
    s.update(s.schedule(), {"holder": 1})  # running: it references the 8 shared blocks
    s.add(req("hit", [*shared, 7, 7, 7], max_tokens=1))
    assert s.load().queued_taken_blocks == 0


def test_load_reports_chunked_prefill_work_running_context_and_active_memory() -> None:
    s, r, pool = make(hbm=64, budget=16, max_model_len=128)
    s.add(req("long", list(range(40)), max_tokens=3))
    s.add(req("short", list(range(100, 106)), max_tokens=3))
    load = s.load()
    # Nothing ran yet: both prompts are queued, each attending to itself (new^2 / 2).
    assert (load.running, load.waiting) == (0, 2)
    assert load.queued_prefill_tokens == 46
    assert load.queued_prefill_context == 40 * 40 // 2 + 6 * 6 // 2
    assert load.active_blocks == 0
    plan = s.schedule()
    s.update(plan, r.execute(plan).sampled)
    load = s.load()
    # The first 16-token chunk of "long" ran: its 24 tokens left attend to the 16 before
    # them and to each other; "short" still waits.
    assert load.running == 1
    assert load.queued_prefill_tokens == 24 + 6
    assert load.queued_prefill_context == 24 * 16 + 24 * 24 // 2 + 6 * 6 // 2
    assert load.running_kv_tokens == 40
    # Blocks are taken chunk by chunk: the 16 computed tokens hold 4 blocks so far.
    assert load.active_blocks == in_use(pool) == 16 // B
    run_to_end(s, r)
    load = s.load()
    # Finished: the blocks stay cached but are free for new requests, so none is active.
    assert (load.running, load.waiting, load.active_blocks, load.running_kv_tokens) == (0, 0, 0, 0)
    assert pool.usage()[Medium.HBM] > 0
    assert load.mean_output_tokens == pytest.approx(3.0)


def test_load_says_which_queued_tokens_the_step_in_progress_computes() -> None:
    s, r, _ = make(hbm=64, budget=16, max_model_len=128)
    s.add(req("long", list(range(40)), max_tokens=3))
    s.add(req("short", list(range(100, 106)), max_tokens=3))
    assert (s.load().step_prefill_tokens, s.load().step_prefill_context) == (0, 0)
    plan = s.schedule()
    load = s.load()
    # Planned, not folded in: "long"'s first 16-token chunk is still queued, and computing.
    assert load.queued_prefill_tokens == 46
    assert load.step_prefill_tokens == 16
    assert load.step_prefill_context == 16 * 16 // 2
    s.update(plan, r.execute(plan).sampled)
    assert s.load().step_prefill_tokens == 0
    # The next step: "long"'s second chunk (after 16 cached tokens), nothing else fits.
    plan = s.schedule()
    load = s.load()
    assert load.step_prefill_tokens == 16
    assert load.step_prefill_context == 16 * 16 + 16 * 16 // 2
    assert load.queued_prefill_tokens - load.step_prefill_tokens == 8 + 6
    fields = load.view_fields()
    assert (fields["step_prefill_tokens"], fields["step_prefill_context"]) == (16, 384)
    s.update(plan, r.execute(plan).sampled)
    # Third step: the last 8 of "long" and all of "short"; then only decodes, which the
    # queue never counted.
    plan = s.schedule()
    assert s.load().step_prefill_tokens == 8 + 6
    s.update(plan, r.execute(plan).sampled)
    plan = s.schedule()
    assert all(seq.is_decode for seq in plan.seqs)
    assert (s.load().queued_prefill_tokens, s.load().step_prefill_tokens) == (0, 0)


def test_mean_output_tracks_finished_requests_and_ignores_aborts() -> None:
    s, r, _ = make(max_model_len=128)
    assert s.load().mean_output_tokens == 0.0
    s.add(req("a", list(range(8)), max_tokens=10))
    run_to_end(s, r)
    assert s.load().mean_output_tokens == pytest.approx(10.0)
    s.add(req("b", list(range(20, 28)), max_tokens=30))
    run_to_end(s, r)
    # A moving average: the newest request moves it part of the way.
    mean = s.load().mean_output_tokens
    assert 10.0 < mean < 30.0
    s.add(req("gone", list(range(40, 48)), max_tokens=50))
    plan = s.schedule()
    s.update(plan, r.execute(plan).sampled)
    s.abort("gone")
    assert s.load().mean_output_tokens == pytest.approx(mean)


def test_queued_taken_blocks_counts_a_prefix_its_holder_released_while_it_waited() -> None:
    # An agent's next step queues while its previous step still decodes: its history is
    # held then (shared, nothing taken), and taken out of the free queue once that step
    # ends; HBM room a request queued behind it cannot have.
    s, r, _ = make(max_num_seqs=1)
    history = list(range(32))  # 8 blocks
    s.add(req("step1", history, max_tokens=2))
    s.update(s.schedule(), {"step1": 1})
    s.add(req("step2", [*history, 9, 9, 9], max_tokens=1))
    assert s.load().queued_taken_blocks == 0
    s.update(s.schedule(), {"step1": 1})  # step1 finishes; step2 has not been admitted
    assert [q.request_id for q in s.waiting] == ["step2"]
    assert s.load().queued_taken_blocks == len(history) // B
    run_to_end(s, r)
    assert s.load().queued_taken_blocks == 0


def test_output_lengths_expect_the_mean_residual_of_recent_finished_requests() -> None:
    lengths = OutputLengths(size=4)
    assert lengths.residual(0) is None  # nothing finished yet
    for n in (10, 20, 30, 40):
        lengths.add(n)
    assert lengths.residual(0) == 25.0
    # Past the shorter ones, a request is expected to go on as the longer ones did.
    assert lengths.residual(15) == 15.0
    assert lengths.residual(39) == 1.0
    assert lengths.residual(40) is None
    lengths.add(100)  # the oldest (10) leaves the window
    assert lengths.residual(0) == 47.5


def test_load_says_when_running_requests_should_finish_and_what_each_frees() -> None:
    s, r, _ = make(hbm=64, budget=16, max_model_len=128, max_num_seqs=2)
    shared = list(range(16))  # 4 blocks both prompts hold
    s.add(req("a", [*shared, 1, 2, 3, 4, 5], max_tokens=5))
    s.add(req("b", [*shared, *range(100, 124)], max_tokens=3))
    s.update(*_step(s, r))  # a's first 16 tokens
    s.update(*_step(s, r))  # a's last 5; b admitted on its 4 cached blocks, 11 computed
    s.add(req("c", [*shared, 1, 2, 3, 4, 7, 7], max_tokens=1))  # waits (max_num_seqs=2)
    a, b = s.running
    assert (a.request_id, len(a.output_token_ids), b.num_computed_tokens) == ("a", 1, 27)
    # Nothing finished yet, so each is expected to run to its max_tokens. "a" decodes
    # (no prefill ahead of it) and holds 7 blocks at its end (22 tokens + 4 to come):
    # the 4 shared ones stay held by "b", and "c" waits to reuse the fifth, which only
    # "a" holds: a frees 2. "b" finishes after its last 13 prompt tokens and 3 outputs,
    # and frees all but the 4 shared blocks.
    assert s.load().kv_release == [(0, 4, 7 - 5), (13, 3, -(-(40 + 3) // B) - 4)]
    run_to_end(s, r)
    assert s.load().kv_release == []


def test_kv_release_expects_the_output_recent_requests_generated() -> None:
    s, r, _ = make(hbm=64, budget=16, max_model_len=128)
    for i, n in enumerate((2, 3, 4, 6)):
        s.add(req(f"done{i}", [50 + i] * 6, max_tokens=n))
    run_to_end(s, r)
    s.add(req("x", [1, 2, 3], max_tokens=20))
    s.update(*_step(s, r))
    # One token out; the finished ones went on for 1, 2, 3 and 5 tokens more: 2.75, not
    # the 19 its max_tokens allows. At its end it holds 4 + 3 tokens: 2 blocks.
    assert s.load().kv_release == [(0, 3, 2)]


def _step(s: Scheduler, r: SimRunner) -> tuple[SchedulerPlan, dict[str, int]]:
    plan = s.schedule()
    return plan, r.execute(plan).sampled
