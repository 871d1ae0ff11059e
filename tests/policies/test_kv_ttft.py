"""kv_ttft: the predicted-TTFT default policy, with the numbers worked out by hand."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from msgspec.structs import replace

from engine_worker.profiles import load_profile
from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView
from policies.base import Decision, NoWorkerError
from policies.cost_model import (
    DEFAULT_TRANSFER_BANDWIDTH,
    decode_batch,
    prefill_seconds,
    queue_seconds,
    step_residual_seconds,
)
from policies.kv_ttft import KvTtftPolicy
from tests.policies.support import (
    BLOCK,
    PROFILE,
    chunked_seconds,
    match,
    queue_wait,
    request,
    tokens,
    view,
)

KV = PROFILE.kv_bytes_per_token


def dram_load(blocks: int) -> float:
    return blocks * BLOCK * KV / PROFILE.load_bandwidth[Medium.DRAM]


@pytest.mark.parametrize("queued", [20_000, 200])
def test_dram_hit_on_idle_worker_against_hbm_hit_behind_a_queue(queued: int) -> None:
    prompt = tokens(4096, seed=1)
    blocks = len(prompt) // BLOCK
    # Both hold the whole prompt, so each computes only the last token.
    last_token = chunked_seconds(PROFILE, 1, cached=len(prompt) - 1)
    busy_hbm = queue_wait(PROFILE, queued) + last_token
    idle_dram = dram_load(blocks) + last_token
    expected = "busy-hbm" if busy_hbm < idle_dram else "idle-dram"

    decision = KvTtftPolicy().choose(
        request(prompt),
        [view("busy-hbm", queued=queued), view("idle-dram")],
        {"busy-hbm": match("busy-hbm", hbm=blocks), "idle-dram": match("idle-dram", dram=blocks)},
    )

    assert decision.worker == expected
    # 20K queued tokens (~0.46 s) outweigh a 0.5 GiB DRAM load (~11 ms); 200 do not (~9 ms).
    assert expected == ("idle-dram" if queued == 20_000 else "busy-hbm")
    assert decision.predicted_ttft_s == pytest.approx(min(busy_hbm, idle_dram))
    assert decision.scores["idle-dram"]["load_s"] == pytest.approx(dram_load(blocks))
    assert decision.scores["busy-hbm"]["wait_s"] == pytest.approx(queue_wait(PROFILE, queued))


@pytest.mark.parametrize("queued", [4_000, 20_000])
def test_hbm_hit_wins_over_cold_idle_worker_only_while_it_saves_more_than_it_waits(
    queued: int,
) -> None:
    prompt = tokens(8192, seed=2)
    blocks = len(prompt) // BLOCK
    warm = queue_wait(PROFILE, queued) + chunked_seconds(PROFILE, 1, cached=len(prompt) - 1)
    cold = chunked_seconds(PROFILE, len(prompt))
    expected = "warm" if warm < cold else "cold"

    decision = KvTtftPolicy().choose(
        request(prompt),
        [view("warm", queued=queued), view("cold")],
        {"warm": match("warm", blocks)},
    )

    assert decision.worker == expected
    assert expected == ("warm" if queued == 4_000 else "cold")
    assert decision.scores["cold"]["prefill_s"] == pytest.approx(cold)
    assert decision.matched_blocks == (blocks if expected == "warm" else 0)


def test_a_running_decode_batch_slows_both_the_queue_and_the_prefill() -> None:
    prompt = tokens(3000, seed=3)
    context = 1024
    policy = KvTtftPolicy(mean_decode_context=context)

    decision = policy.choose(
        request(prompt), [view("decoding", running=64, queued=5000), view("quiet", queued=5000)], {}
    )

    assert decision.worker == "quiet"
    p0, p1, p2, _ = PROFILE.prefill
    d0, d1, d2 = PROFILE.decode
    decode = d1 * 64 + d2 * 64 * context
    per_step = max(p0, d0) + decode
    # 8192 - 64 tokens of prefill fit beside the 64 decodes: 5000 queued take one step.
    wait = per_step + p1 * 5000 + p2 * 5000**2
    assert decision.scores["decoding"]["wait_s"] == pytest.approx(wait)
    assert decision.scores["decoding"]["prefill_s"] == pytest.approx(
        per_step + p1 * 3000 + p2 * 3000**2
    )
    assert decision.scores["quiet"]["prefill_s"] == pytest.approx(chunked_seconds(PROFILE, 3000))


def test_second_request_of_a_burst_sees_the_first_ones_prefix_until_the_ttl() -> None:
    system = tokens(1024, seed=4)
    first = system + tokens(100, seed=5)
    second = system + tokens(100, seed=6)
    policy = KvTtftPolicy(speculative_ttl_s=2.0)
    workers = [view("w")]

    policy.choose(request(first, now=10.0), workers, {})
    soon = policy.choose(request(second, now=10.5), workers, {})
    late = policy.choose(request(second, now=12.6), workers, {})

    assert soon.scores["w"]["cached_tokens"] == len(system)
    assert soon.scores["w"]["speculative_tokens"] == len(first)
    assert soon.matched_blocks == len(system) // BLOCK
    # 2.1 s after the second request was routed both entries have expired.
    assert late.scores["w"]["cached_tokens"] == 0
    assert late.scores["w"]["speculative_tokens"] == 0


def test_speculative_load_stops_counting_once_a_newer_view_shows_it() -> None:
    prompt = tokens(2000, seed=7)
    policy = KvTtftPolicy(catchup_s=0.05)
    policy.choose(request(prompt, now=5.0), [view("w", ts=4.9)], {})

    stale = policy.choose(request(tokens(50, seed=8), now=5.01), [view("w", ts=4.9)], {})
    fresh = policy.choose(request(tokens(50, seed=9), now=5.2), [view("w", ts=5.1)], {})

    assert stale.scores["w"]["speculative_tokens"] == 2000
    assert fresh.scores["w"]["speculative_tokens"] == 0


def test_prefill_routed_since_the_view_replaces_the_decode_step_a_request_waits_out() -> None:
    """A decoding worker whose view shows no queue costs a new request half a decode step
    (the step in progress). Once a prompt was routed there since that view, the step in
    progress is one of that prompt's chunks, which the queue counts whole: no half step
    on top (it was counted twice)."""
    policy = KvTtftPolicy(catchup_s=0.05)
    decoding = view("w", running=8, running_kv=8 * 1024, ts=4.9)
    short = tokens(50, seed=8)
    alone = policy.score(request(short, now=5.0), [decoding], {}).decision
    policy.choose(request(tokens(2000, seed=7), now=5.0), [decoding], {})
    behind = policy.choose(request(short, now=5.01), [decoding], {})

    assert alone.scores["w"]["queue_s"] == pytest.approx(
        step_residual_seconds(PROFILE, 0, 8, 8 * 1024)
    )
    assert behind.scores["w"]["speculative_tokens"] == 2000
    assert behind.scores["w"]["queue_s"] == pytest.approx(queue_seconds(PROFILE, 2000, 8, 8 * 1024))


def test_without_speculative_load_only_the_views_queue_counts() -> None:
    # The gateway passes views that already include what it routed; counting it again would
    # double the queue of the worker holding a burst's prefix.
    system = tokens(1024, seed=13)
    policy = KvTtftPolicy(speculative_load=False)
    policy.choose(request(system + tokens(64, seed=14), now=1.0), [view("w", ts=0.9)], {})

    later = policy.choose(request(system + tokens(64, seed=15), now=1.01), [view("w", ts=0.9)], {})

    assert later.scores["w"]["speculative_tokens"] == 0
    assert later.scores["w"]["wait_s"] == 0.0
    # The speculative prefix entry still applies: the index has not seen the first request yet.
    assert later.scores["w"]["cached_tokens"] == len(system)


def test_a_burst_sharing_one_system_prompt_spreads_over_idle_workers() -> None:
    system = tokens(4096, seed=10)
    burst = [request(system + tokens(64, seed=100 + i), now=i * 0.01) for i in range(16)]
    workers = [view(h) for h in ("w0", "w1", "w2", "w3")]

    policy = KvTtftPolicy()
    spread = Counter(policy.choose(r, workers, {}).worker for r in burst)
    # Without speculative state (and without the routing-rate externality and the homes'
    # balance, which also spread a burst) every request sees the same stale, idle picture.
    blind = KvTtftPolicy(speculative_ttl_s=1e-9, externality_weight=0.0, home_window_s=0)
    herd = Counter(blind.choose(r, workers, {}).worker for r in burst)

    assert len(spread) == 4
    assert max(spread.values()) <= 8
    assert herd == Counter({"w0": 16})


def test_ranked_lists_the_choice_then_the_others_by_predicted_ttft() -> None:
    workers = [view("slow", queued=30_000), view("fast"), view("mid", queued=9_000)]

    decision = KvTtftPolicy().choose(request(tokens(512, seed=11)), workers, {})

    assert decision.ranked() == ["fast", "mid", "slow"]
    totals = [decision.scores[h]["total"] for h in decision.ranked()]
    assert totals == sorted(totals)
    assert decision.predicted_ttft_s == decision.scores["fast"]["total"]


def test_equal_predictions_go_to_fewer_in_flight_then_host_name() -> None:
    prompt = request(tokens(256, seed=12))

    by_load = KvTtftPolicy().choose(prompt, [view("a", in_flight=3), view("b", in_flight=1)], {})
    by_name = KvTtftPolicy().choose(prompt, [view("b"), view("a")], {})

    assert by_load.worker == "b"
    assert by_name.worker == "a"


def test_measured_bandwidth_overrides_the_profile() -> None:
    prompt = tokens(1024, seed=13)
    blocks = len(prompt) // BLOCK
    slow_link = 1e9

    decision = KvTtftPolicy().choose(
        request(prompt),
        [view("w", bandwidth={Medium.SSD: slow_link})],
        {"w": match("w", ssd=blocks)},
    )

    assert decision.scores["w"]["load_s"] == pytest.approx(blocks * BLOCK * KV / slow_link)


def test_no_workers_and_missing_profiles_are_refused() -> None:
    policy = KvTtftPolicy()
    with pytest.raises(NoWorkerError):
        policy.choose(request(tokens(32, seed=14)), [], {})
    with pytest.raises(ValueError, match="no timing profile"):
        policy.choose(request(tokens(32, seed=14)), [view("bare", profile=None)], {})

    fallback = KvTtftPolicy(default_profile=PROFILE)
    assert fallback.choose(
        request(tokens(32, seed=14)), [view("bare", profile=None)], {}
    ).worker == ("bare")


def test_options_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl"):
        KvTtftPolicy(speculative_ttl_s=0)
    with pytest.raises(ValueError, match="mean_decode_context"):
        KvTtftPolicy(mean_decode_context=-1)
    with pytest.raises(ValueError, match="mean_output_tokens"):
        KvTtftPolicy(mean_output_tokens=-1)
    with pytest.raises(ValueError, match="residency_tie_s"):
        KvTtftPolicy(residency_tie_s=-0.1)
    with pytest.raises(ValueError, match="residency_tau_s"):
        KvTtftPolicy(residency_tau_s=0)
    with pytest.raises(ValueError, match="live_window_s"):
        KvTtftPolicy(live_window_s=-1)
    with pytest.raises(ValueError, match="home_window_s"):
        KvTtftPolicy(home_window_s=-1)
    with pytest.raises(ValueError, match="home_band"):
        KvTtftPolicy(home_band=-0.1)
    with pytest.raises(ValueError, match="home_band"):
        KvTtftPolicy(home_band_s=-0.001)


def test_under_load_a_turn_stays_with_its_history_instead_of_chasing_a_shorter_queue() -> None:
    history = tokens(3000, seed=20)
    prompt = history + tokens(200, seed=21)
    blocks = len(history) // BLOCK
    workers = [view("home", queued=4000), view("away", queued=0)]
    matches = {"home": match("home", hbm=blocks)}

    def route(policy: KvTtftPolicy) -> str:
        # Recent traffic: both workers were chosen 10 times per second for the last 10 s.
        for i in range(100):
            policy.routed.record("home", i * 0.1)
            policy.routed.record("away", i * 0.1 + 0.05)
        return policy.choose(request(prompt, now=10.0), workers, matches).worker

    greedy = KvTtftPolicy(externality_weight=0.0)
    aware = KvTtftPolicy()
    greedy_pick = route(greedy)
    aware_pick = route(aware)
    # The shorter queue wins the request's own TTFT ...
    assert greedy_pick == "away"
    # ... but recomputing 3000 tokens there delays everyone routed behind it; staying is
    # cheaper for the cluster once that externality is charged.
    assert aware_pick == "home"
    decision = aware.choose(request(prompt, now=10.01), workers, matches)
    assert decision.scores["away"]["externality_s"] > decision.scores["home"]["externality_s"]
    assert decision.predicted_ttft_s == decision.scores["home"]["ttft_s"]


def test_an_idle_worker_without_the_shared_prefix_is_not_locked_out() -> None:
    # Busy workers hold a shared system prompt; a fourth, idle one does not. Nothing is
    # routed to the idle one, so work placed there delays nobody: pure TTFT decides.
    system = tokens(1024, seed=22)
    prompt = system + tokens(64, seed=23)
    blocks = len(system) // BLOCK
    busy = [view(f"w{i}", queued=1500) for i in range(3)]
    idle = view("w3", queued=0)
    policy = KvTtftPolicy()
    for i in range(60):
        for w in ("w0", "w1", "w2"):
            policy.routed.record(w, 1.0 + i * 0.05)
    decision = policy.choose(
        request(prompt, now=4.0),
        [*busy, idle],
        {f"w{i}": match(f"w{i}", hbm=blocks) for i in range(3)},
    )
    assert decision.scores["w3"]["externality_s"] == 0.0
    assert decision.worker == "w3"


def test_a_worker_about_to_run_out_of_hbm_loses_its_prefix_advantage() -> None:
    # "full" holds the first 4K tokens of a 16K-token prompt, but its running requests hold
    # 9,600 of its 10,000 HBM blocks: the prompt's 750 new blocks do not fit, so it would
    # be preempted and wait for running requests to finish. "roomy" is idle and empty.
    prompt = tokens(16_384, seed=30)
    held = 4096 // BLOCK
    matches = {"full": match("full", hbm=held)}
    roomy = view("roomy")

    def full(active: int) -> WorkerView:
        return view("full", running=24, running_kv=150_000, mean_output=300.0, active=active)

    published = KvTtftPolicy().choose(request(prompt), [full(9_600), roomy], matches)
    # The same worker as an older heartbeat shows it (no active blocks published): the
    # memory cannot be seen, and the cached 4K tokens win, as they did before.
    blind = KvTtftPolicy().choose(request(prompt), [full(0), roomy], matches)
    assert blind.worker == "full"
    assert published.worker == "roomy"
    scores = published.scores["full"]
    # No prefill queued: its queue is only the rest of the decode step in progress.
    assert scores["queue_s"] == pytest.approx(PROFILE.decode_seconds(24, 150_000) / 2)
    assert scores["memory_wait_s"] > scores["queue_s"]
    assert scores["wait_s"] == scores["memory_wait_s"]
    assert published.scores["roomy"]["memory_wait_s"] == 0.0


def test_a_prefix_in_dram_counts_against_a_nearly_full_hbm() -> None:
    # "full" caches the 4K-token prefix of a 4,352-token prompt, and its running requests
    # hold 9,800 of its 10,000 HBM blocks. From HBM the prompt needs one new block and
    # fits; from DRAM its 256 prefix blocks must come up into HBM too, and they do not.
    prompt = tokens(4_352, seed=32)
    full = view("full", running=10, running_kv=150_000, mean_output=160.0, active=9_800)
    in_hbm = KvTtftPolicy().choose(request(prompt), [full], {"full": match("full", hbm=256)})
    in_dram = KvTtftPolicy().choose(request(prompt), [full], {"full": match("full", dram=256)})
    assert in_hbm.scores["full"]["memory_wait_s"] == 0.0
    assert in_dram.scores["full"]["memory_wait_s"] > 0.0


def test_a_cached_prefix_no_running_request_holds_uses_the_room_it_is_priced_on() -> None:
    # The groups replay at 1 s heartbeats (seed 3, t = 2.44 s): 2,311 of 2,560 blocks held
    # by 13 running requests, 106-token outputs. The prompt's 4K-token group prefix is in
    # HBM, but cached free (no running request holds it): to admit the request the worker
    # takes those 256 blocks out of its free queue, and 197 are free after the output to
    # come, so it waits (there it waited 350-560 ms, and the requests queued behind it).
    prompt = tokens(4_352, seed=33)
    w = view(
        "w", running=13, running_kv=57_000, mean_output=106.0, active=2_311, hbm_capacity=2_560
    )

    def wait(idle: int | None) -> float:
        m = PrefixMatch("w", 256, (256, 0, 0), idle_hbm=idle)
        return KvTtftPolicy().choose(request(prompt), [w], {"w": m}).scores["w"]["memory_wait_s"]

    assert wait(None) == 0.0  # not known: as before
    assert wait(0) == 0.0  # held by running requests: already counted as active
    assert wait(256) > 0.0


def test_a_follow_up_turn_keeps_the_idle_note_of_the_prefix_its_last_turn_left() -> None:
    # The agent replay (seed 1, t = 14.82 s): this policy had routed the previous step
    # here, so it knows the prefix without the index (speculation), and that knowledge
    # dropped the router's note that none of those HBM blocks is held: the step was
    # predicted 57 ms without a memory wait and waited ~400 ms for room. The same view as
    # above: the 4K-token prefix left by the last turn is cached free.
    prompt = tokens(4_352, seed=33)
    w = view(
        "w", running=13, running_kv=57_000, mean_output=106.0, active=2_311, hbm_capacity=2_560
    )
    policy = KvTtftPolicy()
    policy.choose(request(prompt[:4_096], rid="last"), [w], {})
    m = PrefixMatch("w", 256, (256, 0, 0), idle_hbm=256)
    scores = policy.choose(request(prompt, now=1.0), [w], {"w": m}).scores["w"]
    assert scores["cached_tokens"] == 4_096
    assert scores["memory_wait_s"] > 0.0


def test_a_queue_holding_one_very_long_prompt_is_longer_than_its_token_count_says() -> None:
    # "long" has one 100K-token prompt queued; "many" has 110K tokens of 1K-token prompts.
    # By tokens "long" is shorter; by time the 100K prompt's later chunks attend to
    # everything before them and it takes over three times as long.
    prompt = tokens(2_000, seed=31)
    long = view("long", queued=100_000, queued_context=100_000 * 100_000 // 2)
    many = view("many", queued=110_000, queued_context=110 * 1_000 * 1_000 // 2)
    decision = KvTtftPolicy().choose(request(prompt), [long, many], {})
    assert decision.worker == "many"
    assert decision.scores["long"]["queue_s"] == pytest.approx(chunked_seconds(PROFILE, 100_000))
    # Without the published context, the token count alone picks "long".
    plain = [view("long", queued=100_000), view("many", queued=110_000)]
    assert KvTtftPolicy().choose(request(prompt), plain, {}).worker == "long"


def test_a_prefix_on_a_worker_ending_its_prefill_step_beats_recomputing_it_elsewhere() -> None:
    # bench suite, groups seed 4 at 0.9, request 5: its group's 4,096-token prompt is on
    # "holder", 62 ms into prefilling the group's first request (one 93 ms step, 31 ms
    # left); "idle" holds nothing. Counted whole, the step made "holder" look 12 ms worse
    # than recomputing the prompt on "idle"; it is 50 ms better.
    prompt = tokens(4352, seed=41)
    first = 4352
    now = 1.0
    ends = now + 0.031
    busy = replace(
        view("holder", running=1, in_flight=1, queued=first, queued_context=first * first // 2),
        step_ends_ts=ends,
        step_prefill_tokens=first,
        step_prefill_context=first * first // 2,
    )
    matches = {"holder": match("holder", hbm=4096 // BLOCK)}
    decision = KvTtftPolicy().choose(request(prompt, now=now), [busy, view("idle")], matches)
    batch, kv = decode_batch(busy, KvTtftPolicy().mean_decode_context)
    rest = prefill_seconds(PROFILE, len(prompt) - 4096, 4096, batch, kv)
    assert decision.worker == "holder"
    assert decision.scores["holder"]["queue_s"] == pytest.approx(0.031)
    assert decision.predicted_ttft_s == pytest.approx(0.031 + rest)
    assert decision.scores["idle"]["ttft_s"] == pytest.approx(chunked_seconds(PROFILE, 4352))
    # Without the step in progress (a stale view, or an older worker), the whole step is
    # counted and the prompt is recomputed on "idle".
    stale = KvTtftPolicy().choose(request(prompt, now=ends + 0.001), [busy, view("idle")], matches)
    assert stale.worker == "idle"
    assert stale.scores["holder"]["queue_s"] == pytest.approx(
        queue_seconds(PROFILE, first, batch, kv, first * first // 2)
    )


def test_a_huge_prompt_cached_nowhere_is_not_pushed_onto_a_backlogged_worker() -> None:
    # A 64K-token prompt no worker holds costs the same compute anywhere. "backlog" has
    # 30K tokens queued and was rarely chosen lately (it was busy); "steady" is free and
    # gets 2 requests/s that would go anywhere.
    prompt = tokens(65_536, seed=32)
    workers = [view("backlog", queued=30_000), view("steady")]

    def route(policy: KvTtftPolicy) -> str:
        for i in range(100):
            policy.routed.record("steady", i * 0.5)
            if i % 10 == 0:
                policy.routed.record("backlog", i * 0.5)
        return policy.choose(request(prompt, now=50.0), workers, {}).worker

    # Charging the whole work x each worker's recent rate made the backlogged worker,
    # chosen least lately, look cheapest: the prompt then waited behind its queue.
    assert route(KvTtftPolicy(excess_work=False)) == "backlog"
    # Only the work beyond what any worker would spend delays others: none here, so the
    # request's own TTFT decides.
    policy = KvTtftPolicy()
    assert route(policy) == "steady"
    decision = policy.choose(request(prompt, now=50.01), workers, {})
    assert decision.scores["steady"]["externality_s"] == pytest.approx(0.0, abs=1e-9)


def test_a_slower_gpu_is_not_charged_its_slowness_as_harm_to_others() -> None:
    # A mixed fleet: an H100 with 120K tokens queued and a nearly idle A100, both taking
    # traffic. A 28K-token prompt cached nowhere takes ~1 s on the H100, ~3.2 s on the
    # A100, and its TTFT is lower on the A100. Routed in proportion to their speeds, the
    # A100's later requests are fewer than the H100's, so ~3.2 s of A100 time delays
    # them no more than ~1 s of H100 time would delay the H100's: only work beyond the
    # least any worker would spend, at the candidate's own speed, is charged.
    a100 = load_profile("llama3_8b_a100")
    prompt = tokens(28_000, seed=40)
    workers = [
        view("h100", queued=120_000, running=4, running_kv=80_000),
        view("a100", running=1, running_kv=10_000, profile=a100),
    ]

    def route(matches: dict[str, PrefixMatch]) -> Decision:
        policy = KvTtftPolicy()
        for i in range(40):
            policy.routed.record("h100", i * 0.25)
            policy.routed.record("a100", i * 0.5)
        return policy.choose(request(prompt, now=10.0), workers, matches)

    cold = route({})
    scores = cold.scores
    assert scores["a100"]["ttft_s"] < scores["h100"]["ttft_s"]
    assert scores["a100"]["work_s"] > 3 * scores["h100"]["work_s"]
    # Charged as excess over the H100's work, the A100 cost ~15 s of others' time and
    # the prompt went to the H100 to wait out its queue.
    assert scores["a100"]["externality_s"] == pytest.approx(0.0, abs=1e-9)
    assert cold.worker == "a100"
    # What the A100 would recompute of a prefix the H100 holds is still charged.
    held = route({"h100": match("h100", hbm=24_000 // BLOCK)})
    assert held.scores["a100"]["externality_s"] > 1.0
    assert held.worker == "h100"


def test_pooling_pulls_a_busy_peers_prefix_instead_of_waiting_or_recomputing() -> None:
    # "holder" has the first 16K tokens of the prompt in HBM but 40K tokens queued;
    # "idle" has nothing. Pulling 16K tokens of Llama-3-8B KV (2 GiB) at 12.5 GB/s takes
    # ~0.17 s, computing them ~1 s, waiting for the holder's queue ~1 s.
    prompt = tokens(16_384 + 256, seed=33)
    held = 16_384 // BLOCK
    workers = [view("holder", queued=40_000), view("idle")]
    matches = {"holder": match("holder", hbm=held)}
    plain = KvTtftPolicy().choose(request(prompt), workers, matches)
    assert plain.kv_source is None
    pooled = KvTtftPolicy(pooling=True).choose(request(prompt), workers, matches)
    assert (pooled.worker, pooled.kv_source) == ("idle", "holder")
    idle = pooled.scores["idle"]
    pull = 16_384 * PROFILE.kv_bytes_per_token / DEFAULT_TRANSFER_BANDWIDTH
    assert idle["pull_s"] == pytest.approx(pull)
    assert idle["pulled_blocks"] == held
    assert pooled.matched_blocks == held
    assert pooled.predicted_ttft_s is not None
    assert pooled.predicted_ttft_s < min(s["ttft_s"] for s in plain.scores.values())
    # A worker that measured a slow network pulls only when it still pays.
    slow = [view("holder", queued=40_000), replace(view("idle"), transfer_bandwidth=1e8)]
    assert KvTtftPolicy(pooling=True).choose(request(prompt), slow, matches).kv_source is None


def test_a_peers_ssd_copy_is_pulled_at_the_pace_that_ssd_reads() -> None:
    # The Mooncake conversation trace (docs/benchmarks.md, "the issue's own trace"):
    # a 47K-token history whose holder keeps it on SSD behind a 20K-token queue; an
    # idle worker would recompute it (~2.4 s). Read off the holder's SSD at 6 GB/s and
    # streamed, it lands in ~1.0 s (the network alone would take 0.5 s), and the idle
    # worker computes only the new tokens. SSD holders were once left out of pooling
    # ("slower than the network"): every such turn recomputed its whole history.
    prompt = tokens(47_104 + 256, seed=38)
    system, held = 32, 47_104 // BLOCK
    workers = [view("holder", queued=20_000), view("idle")]
    matches = {"holder": match("holder", hbm=system, ssd=held - system)}
    decision = KvTtftPolicy(pooling=True).choose(request(prompt), workers, matches)
    assert (decision.worker, decision.kv_source) == ("idle", "holder")
    idle = decision.scores["idle"]
    read = (held - system) * BLOCK * KV / PROFILE.load_bandwidth[Medium.SSD]
    network = 47_104 * KV / DEFAULT_TRANSFER_BANDWIDTH
    assert read > network
    assert idle["pull_s"] == pytest.approx(read)
    assert idle["pulled_blocks"] == held
    assert idle["ttft_s"] < chunked_seconds(PROFILE, len(prompt)) / 2
    # A holder outside the candidates (a decode worker while prefill workers are chosen)
    # is read at the candidate's own pace.
    alone = KvTtftPolicy(pooling=True).choose(request(prompt), [view("idle")], matches)
    assert alone.kv_source == "holder"
    assert alone.scores["idle"]["pull_s"] == pytest.approx(read)
    # A holder whose SSD reads at 1 GB/s (measured) would take ~6 s: recompute instead.
    slow = [
        replace(view("holder", queued=20_000), load_bandwidth={Medium.SSD: 1e9}),
        view("idle"),
    ]
    decision = KvTtftPolicy(pooling=True).choose(request(prompt), slow, matches)
    assert decision.kv_source is None
    assert decision.scores["idle"]["cached_tokens"] == 0


def _pool_onto_idle(policy: KvTtftPolicy, prompt: list[int]) -> None:
    """Route ``prompt`` while its prefix sits on a backlogged holder: it is pulled to "a"."""
    held = (len(prompt) - 256) // BLOCK
    workers = [view("holder", queued=40_000), view("a"), view("b", queued=2_000)]
    decision = policy.choose(request(prompt), workers, {"holder": match("holder", hbm=held)})
    assert (decision.worker, decision.kv_source) == ("a", "holder")


def test_a_long_prompt_is_kept_off_a_worker_whose_pulled_prefix_has_not_landed() -> None:
    # A 16K-token prefix is being pulled to "a" (~0.17 s). A 64K-token prompt cached
    # nowhere arrives just after: "a" shows only the pulled request's 256 new tokens,
    # "b" 2,000 queued tokens. On "a" it would start at once, and the pulled request,
    # queued when its blocks land, would wait the whole ~4 s prefill behind it.
    prompt = tokens(16_384 + 256, seed=34)
    long = tokens(65_536, seed=35)
    after = [view("holder", queued=40_000), view("a", queued=256), view("b", queued=2_000)]
    # A policy that never routed the pull sees only the shorter queue on "a".
    assert KvTtftPolicy(pooling=True).choose(request(long), after, {}).worker == "a"
    policy = KvTtftPolicy(pooling=True)
    _pool_onto_idle(policy, prompt)
    decision = policy.choose(request(long, now=0.01), after, {})
    assert decision.worker == "b"
    landing = decision.scores["a"]["landing_s"]
    assert 3.0 < landing <= decision.scores["a"]["work_s"]
    assert decision.scores["b"]["landing_s"] == 0.0
    # Once the pull has landed it no longer holds anything back.
    later = policy.choose(request(long, now=5.0), after, {})
    assert later.scores["a"]["landing_s"] == 0.0


def test_a_request_that_follows_a_pull_prices_its_own_pull_not_the_blocks_in_flight() -> None:
    # Routing a request speculatively marks its blocks as held where it went. Blocks
    # that are being pulled are not there yet: a second request for the same document
    # sent there before they land would find them missing and recompute 16K tokens.
    prompt = tokens(16_384 + 256, seed=36)
    held = (len(prompt) - 256) // BLOCK
    policy = KvTtftPolicy(pooling=True)
    _pool_onto_idle(policy, prompt)
    after = [view("holder", queued=40_000), view("a", queued=256), view("b", queued=2_000)]
    follower = policy.choose(
        request(prompt, now=0.01), after, {"holder": match("holder", hbm=held)}
    )
    assert follower.kv_source == "holder"
    assert follower.scores[follower.worker]["pulled_blocks"] == held
    # A prefix computed where it went is speculated as before: the next request finds it.
    local = KvTtftPolicy(pooling=True)
    workers = [view("a"), view("b", queued=2_000)]
    assert local.choose(request(prompt), workers, {}).worker == "a"
    again = local.choose(request(prompt, now=0.01), workers, {})
    assert (again.worker, again.kv_source, again.matched_blocks) == ("a", None, held + 16)


def test_a_pull_is_sized_to_the_hbm_room_its_blocks_would_survive_in() -> None:
    # The idle peer "a" has 10,000 HBM blocks, 9,500 held by 4 running requests that
    # will still grow by half their mean output (4 x 128 tokens: 32 blocks): the pulled
    # blocks land as cached blocks, and only the 468 that fit stay until the request
    # runs (a pull imports what fits; the rest are never used). Pricing the whole 16K
    # tokens made "a" look 1 s faster than it was: the agent trace's steps recomputed
    # their context there after paying for a pull.
    prompt = tokens(16_384 + 256, seed=37)
    held = 16_384 // BLOCK
    matches = {"holder": match("holder", hbm=held)}
    full = [view("holder", queued=40_000), view("a", running=4, active=9_500)]
    decision = KvTtftPolicy(pooling=True).choose(request(prompt), full, matches)
    room = 10_000 - 9_500 - 4 * 256 // 2 // BLOCK
    assert decision.scores["a"]["pulled_blocks"] == room
    assert decision.scores["a"]["cached_tokens"] == room * BLOCK
    # With room the whole prefix is priced, as before.
    roomy = [view("holder", queued=40_000), view("a", running=4, active=1_000)]
    decision = KvTtftPolicy(pooling=True).choose(request(prompt), roomy, matches)
    assert decision.scores["a"]["pulled_blocks"] == held
    # HBM overcommitted by admitted work: nothing to pull into.
    over = [view("holder", queued=40_000), view("a", running=4, active=9_990, queued=8_000)]
    decision = KvTtftPolicy(pooling=True).choose(request(prompt), over, matches)
    assert decision.scores["a"]["pulled_blocks"] == 0
    assert decision.kv_source is None


def test_a_turn_routed_behind_a_long_queue_stays_visible_until_its_blocks_exist() -> None:
    # The first turn waits ~3 s behind 120K queued tokens on "w"; its blocks reach the
    # index only after that. Its follow-up arrives 2.5 s later, past the 2 s TTL: it must
    # still see the history on "w" (and queue behind it for a full hit) instead of
    # recomputing 24K tokens on the idle "x".
    history = tokens(24_576, seed=38)
    follow = history + tokens(256, seed=39)
    policy = KvTtftPolicy(speculative_ttl_s=2.0)
    busy = [view("w", queued=120_000), view("x", queued=180_000)]
    first = policy.choose(request(history), busy, {})
    assert first.worker == "w"
    assert first.predicted_ttft_s is not None
    assert first.predicted_ttft_s > 2.5
    later = [view("w", queued=30_000, ts=2.5), view("x", ts=2.5)]
    decision = policy.choose(request(follow, now=2.5), later, {})
    assert decision.scores["w"]["cached_tokens"] == len(history)
    assert decision.worker == "w"
    # Once the prediction and the TTL have both passed, the entries are gone.
    assert decision.predicted_ttft_s is not None
    end = max(first.predicted_ttft_s, 2.5 + decision.predicted_ttft_s) + 2.0
    gone = policy.choose(request(follow, now=end + 0.01), later, {})
    assert gone.scores["w"]["cached_tokens"] == 0


def _cold_prompts(policy: KvTtftPolicy, workers: list[WorkerView], n: int) -> Counter[str]:
    """Where ``n`` prompts cached nowhere go, each after the last one's speculation ended."""
    placed: Counter[str] = Counter()
    for i in range(n):
        prompt = request(tokens(2048, seed=300 + i), now=10.0 * i)
        placed[policy.choose(prompt, workers, {}).worker] += 1
    return placed


def test_prompts_cached_nowhere_are_spread_over_equally_loaded_workers() -> None:
    # Four idle, identical workers and eight new system prompts arriving one at a time:
    # every prediction is equal, so the plain tie-break (host name) puts all eight on w0,
    # whose HBM then holds every prefix the later requests will come back for while the
    # other three hold none. The residency tie-break spreads them (the homes' balance,
    # on by default, is off here: it spreads them too, see the tests below).
    workers = [view(h) for h in ("w0", "w1", "w2", "w3")]

    spread = _cold_prompts(KvTtftPolicy(residency_tie_s=0.005, home_window_s=0), workers, 8)
    piled = _cold_prompts(KvTtftPolicy(home_window_s=0), workers, 8)

    assert spread == Counter({"w0": 2, "w1": 2, "w2": 2, "w3": 2})
    assert piled == Counter({"w0": 8})


def test_spreading_new_prefixes_never_costs_more_than_the_tie_band() -> None:
    # w1 has received nothing new, but its queue makes it clearly slower than w0 for a
    # prompt cached nowhere: balance is a tie-break, not a reason to wait.
    policy = KvTtftPolicy(residency_tie_s=0.005)
    workers = [view("w0"), view("w1", queued=4096)]
    _cold_prompts(policy, [view("w0")], 3)

    decision = policy.choose(request(tokens(2048, seed=400), now=40.0), workers, {})

    assert decision.scores["w1"]["total"] > decision.scores["w0"]["total"] + 0.005
    assert decision.worker == "w0"


def test_a_request_with_a_cached_prefix_is_not_moved_to_balance_new_ones() -> None:
    # Only prompts cached nowhere are balanced: one whose first block is on w0 stays
    # there even though w0 has received far more new blocks than w1 lately.
    policy = KvTtftPolicy(residency_tie_s=0.005, home_window_s=0)
    _cold_prompts(policy, [view("w0")], 3)
    prompt = tokens(2048, seed=500)
    workers = [view("w0"), view("w1")]

    decision = policy.choose(request(prompt, now=40.0), workers, {"w0": match("w0", hbm=1)})

    assert decision.scores["w0"]["total"] > decision.scores["w1"]["total"] - 0.005
    assert decision.worker == "w0"


def test_a_queued_request_bringing_up_its_prefix_holds_up_the_requests_behind_it() -> None:
    # The groups replay at 1 s heartbeats (seed 3, t = 25.48 s): 16 running requests leave
    # 233 of 2,560 HBM blocks free. One request is queued with 1 token to compute, but its
    # 4K-token prefix must come up from DRAM and out of the free queue (272 blocks): it
    # cannot be admitted until running requests finish, and first come first served, the
    # next request waits behind it. Predicted 22 ms there, it took 245 ms.
    prompt = tokens(4_352, seed=34)
    busy = view(
        "busy", running=16, waiting=1, in_flight=17, queued=1, running_kv=60_000,
        mean_output=120.0, active=2_327, hbm_capacity=2_560,
    )  # fmt: skip
    # "roomy" has half the prefix and room: 2K tokens more to compute.
    matches = {
        "busy": PrefixMatch("busy", 256, (256, 0, 0), idle_hbm=0),
        "roomy": PrefixMatch("roomy", 128, (128, 0, 0), idle_hbm=0),
    }
    roomy = view("roomy", hbm_capacity=2_560)

    def choose(taken: int) -> Decision:
        workers = [replace(busy, queued_taken_blocks=taken), roomy]
        return KvTtftPolicy().choose(request(prompt), workers, matches)

    unseen = choose(0)
    assert unseen.worker == "busy"
    assert unseen.scores["busy"]["memory_wait_s"] == 0.0
    seen = choose(272)
    assert seen.scores["busy"]["memory_wait_s"] > 0.0
    assert seen.worker == "roomy"
    # What a request takes is in its own scores, for the router to count until its first
    # byte: nothing where running requests hold its prefix, all of it where none does.
    assert seen.scores["roomy"]["taken_blocks"] == 0.0
    idle = {"roomy": PrefixMatch("roomy", 128, (128, 0, 0), idle_hbm=128)}
    assert (
        KvTtftPolicy().choose(request(prompt), [roomy], idle).scores["roomy"]["taken_blocks"]
        == 128.0
    )


def test_a_queue_that_loads_a_long_prefix_from_dram_is_slower_than_its_tokens_say() -> None:
    # "loading" has 261 tokens queued, but the request they belong to first brings its
    # 1,080 cached blocks (17,280 tokens, 2.3 GB) up from DRAM, ~45 ms at the profile's
    # 50 GB/s; "computing" has 1,500 tokens queued (~32 ms) and nothing to load. A cold
    # 512-token prompt waits less behind "computing" (an agent step replayed on the
    # suite's `agent` workload was predicted 40 ms and took 122 ms behind such a load).
    prompt = tokens(512, seed=41)
    loading = replace(
        view("loading", running=1, queued=261), queued_load_blocks={Medium.DRAM: 1_080}
    )
    computing = view("computing", running=1, queued=1_500)
    d = KvTtftPolicy().choose(request(prompt), [loading, computing], {})
    assert d.scores["loading"]["queue_s"] > dram_load(1_080) > d.scores["computing"]["queue_s"]
    assert d.worker == "computing"
    # Without the load (an older worker that does not publish it) the choice flips.
    unseen = replace(loading, queued_load_blocks={})
    assert KvTtftPolicy().choose(request(prompt), [unseen, computing], {}).worker == "loading"


def test_loads_beside_the_steps_delay_only_the_loads_queued_behind_them() -> None:
    # The workers of the test above, "loading" now bringing its blocks up beside its
    # steps (async_loads): the 1,080 blocks delay no computation, so the cold prompt
    # waits behind 261 queued tokens there, not 1,500.
    prompt = tokens(512, seed=41)
    loading = replace(
        view("loading", running=1, queued=261),
        queued_load_blocks={Medium.DRAM: 1_080},
        async_loads=True,
    )
    computing = view("computing", running=1, queued=1_500)
    d = KvTtftPolicy().choose(request(prompt), [loading, computing], {})
    assert d.scores["loading"]["queue_s"] < d.scores["computing"]["queue_s"] < dram_load(1_080)
    assert d.worker == "loading"
    # A prompt with its own prefix on DRAM there loads after those 1,080 blocks: its
    # first token comes no sooner than both loads, and its load is no work for others.
    long = tokens(4096, seed=42)
    held = {"loading": match("loading", dram=128)}
    s = KvTtftPolicy().choose(request(long), [loading, computing], held).scores["loading"]
    assert s["load_queue_s"] == pytest.approx(dram_load(1_080))
    assert s["ttft_s"] > dram_load(1_080) + dram_load(128)
    # Where loads stall the steps, the same prefix's load is work that delays others.
    stalled = replace(loading, async_loads=False)
    t = KvTtftPolicy().choose(request(long), [stalled, computing], held).scores["loading"]
    assert t["load_queue_s"] == 0.0
    assert t["work_s"] == pytest.approx(s["work_s"] + dram_load(128))


def test_a_prefix_loaded_beside_the_steps_is_computed_a_step_after_its_admission() -> None:
    # "dram" decodes 32 requests (10 ms steps) and holds 960 of the prompt's 1,024 tokens
    # on DRAM (a 2.5 ms load); "idle" holds nothing. The scheduler admits the request at
    # the end of the decode step in progress and starts the load, but the step planned
    # there runs without it: it is computed in the step after, a whole decode step later
    # however short the load. Priced as "half a step, the load, the prefill" (18.9 ms),
    # "dram" beat recomputing on "idle" (24.1 ms); the groups replay measured such
    # requests at 1.5x their prediction (median).
    prompt = tokens(1024, seed=7)
    dram = replace(view("dram", running=32, running_kv=64_000), async_loads=True)
    step = PROFILE.decode_seconds(32, 64_000)
    d = KvTtftPolicy().choose(
        request(prompt), [dram, view("idle")], {"dram": match("dram", dram=60)}
    )
    s = d.scores["dram"]
    assert s["load_s"] < step / 2
    assert s["ttft_s"] == pytest.approx(s["wait_s"] + step + s["prefill_s"])
    assert d.worker == "idle"
    # A load longer than a step lands during a later one and waits for it to end.
    slow = replace(dram, load_bandwidth={Medium.DRAM: 1e9})
    t = KvTtftPolicy().choose(request(prompt), [slow], {"dram": match("dram", dram=60)})
    u = t.scores["dram"]
    assert u["load_s"] > step
    assert u["ttft_s"] == pytest.approx(
        u["wait_s"] + step * math.ceil(u["load_s"] / step) + u["prefill_s"]
    )


def test_a_long_prefill_does_not_overtake_a_prefix_loading_beside_the_steps() -> None:
    # "doc" goes to "a", which holds its 16K-token prefix on DRAM: admitted at once, it
    # is computed once the load lands (~50 ms). A cold 8K-token prompt routed to "a" 5 ms
    # later would be admitted before that, and its chunks, scheduled first, would hold
    # "doc" back for most of its 200 ms prefill (the mixed replay, seed 3, saturated: a
    # request predicted 0.10 s waited 1.27 s so). "b" is a little slower for the prompt
    # (1K tokens queued) and delays no one.
    policy = KvTtftPolicy()
    a = replace(view("a", running=8, running_kv=16_000), async_loads=True)
    b = replace(view("b", running=8, running_kv=16_000, queued=1_024), async_loads=True)
    doc = request(tokens(16_448, seed=5), rid="doc")
    assert policy.choose(doc, [a, b], {"a": match("a", dram=1_024)}).worker == "a"
    loading = replace(
        a, waiting=1, in_flight=1, queued_prefill_tokens=64,
        queued_load_blocks={Medium.DRAM: 1_024},
    )  # fmt: skip
    d = policy.choose(request(tokens(8_192, seed=6), rid="cold", now=0.005), [loading, b], {})
    assert d.scores["a"]["ttft_s"] < d.scores["b"]["ttft_s"]
    assert d.scores["a"]["landing_s"] > d.scores["a"]["prefill_s"] / 2
    assert d.worker == "b"


def _live_groups(policy: KvTtftPolicy) -> list[list[int]]:
    """Three 4K-token group prompts, each reused on w0 (which holds it) at 0 s."""
    groups = [tokens(4096, seed=600 + i) for i in range(3)]
    for prompt in groups:
        held = {"w0": match("w0", hbm=len(prompt) // BLOCK)}
        assert policy.choose(request(prompt), [view("w0")], held).worker == "w0"
    return groups


def test_a_new_prompt_goes_where_it_evicts_no_live_cache() -> None:
    # Two idle workers of 800 HBM blocks each. Three 4K-token group prompts (256 blocks
    # each) were reused on w0 within the minute: 768 live blocks, 32 to spare. A new
    # group's 4K-token prompt would evict 224 of them on w0, and each of those groups'
    # next request would reload them from DRAM; w1's cache is dead. Without the live
    # cache the two predictions tie and the host name sends it to w0.
    cold = request(tokens(4096, seed=610), now=30.0)
    workers = [
        view("w0", hbm_capacity=800, dram_capacity=4_000),
        view("w1", hbm_capacity=800, dram_capacity=4_000),
    ]
    policy, blind = KvTtftPolicy(), KvTtftPolicy(live_window_s=0)
    _live_groups(policy)
    _live_groups(blind)

    decision = policy.choose(cold, workers, {})

    assert decision.scores["w0"]["live_blocks"] == 768
    assert decision.scores["w0"]["displace_s"] == pytest.approx(dram_load(224))
    assert decision.scores["w1"]["displace_s"] == 0.0
    assert decision.scores["w0"]["ttft_s"] == decision.scores["w1"]["ttft_s"]
    assert decision.worker == "w1"
    assert blind.choose(cold, workers, {}).worker == "w0"


def test_a_cache_nobody_came_back_for_within_the_window_is_dead() -> None:
    workers = [view("w0", hbm_capacity=800), view("w1", hbm_capacity=800)]
    policy = KvTtftPolicy(live_window_s=60.0)
    _live_groups(policy)

    decision = policy.choose(request(tokens(4096, seed=610), now=61.0), workers, {})

    assert decision.scores["w0"]["live_blocks"] == 0
    assert decision.worker == "w0"


def test_a_request_is_not_charged_for_evicting_its_own_prefix() -> None:
    # The same w0 as above: a group's next request reuses its 256 live blocks and adds
    # 100; the other two groups' 512 live blocks leave 288 spare, so it evicts nothing
    # (counted as someone else's, its own 256 would leave 32 and 68 would go).
    policy = KvTtftPolicy()
    groups = _live_groups(policy)
    follow = request(groups[0] + tokens(1_600, seed=620), now=30.0)
    workers = [view("w0", hbm_capacity=800), view("w1", hbm_capacity=800)]

    decision = policy.choose(follow, workers, {"w0": match("w0", hbm=256)})

    assert decision.scores["w0"]["displace_s"] == 0.0
    assert decision.worker == "w0"


def test_a_restarted_worker_has_no_live_cache_to_protect() -> None:
    policy = KvTtftPolicy()
    _live_groups(policy)
    restarted = replace(view("w0", hbm_capacity=800), epoch=1)

    decision = policy.choose(request(tokens(4096, seed=610), now=30.0), [restarted], {})

    assert decision.scores["w0"]["live_blocks"] == 0
    assert decision.scores["w0"]["displace_s"] == 0.0


def _homes_on(policy: KvTtftPolicy, host: str, n: int) -> None:
    """``n`` groups whose system prompts make their homes on ``host`` (0-20 s), each
    returned to by a question 2 s later."""
    for i in range(n):
        system = tokens(2048, seed=1_000 + i)
        assert policy.choose(request(system, now=10.0 * i), [view(host)], {}).worker == host
        question = request(system + tokens(64, seed=1_100 + i), now=10.0 * i + 2)
        held = {host: match(host, hbm=len(system) // BLOCK)}
        assert policy.choose(question, [view(host)], held).worker == host


def test_new_prompts_make_their_homes_where_fewer_homes_will_come_back() -> None:
    # Eight groups start one every 5 s, each with a new system prompt then, 2 s later,
    # a user's question under it, on four workers where w0's prediction for a new prompt
    # is always a little better (a decode batch runs on the others): by the score alone
    # w0 would be home to all eight groups and carry all their traffic. Within the
    # prediction's error band the homes go where the fewest homes come back.
    workers = [view("w0")] + [view(h, running=2, running_kv=10_000) for h in ("w1", "w2", "w3")]
    policy, blind = KvTtftPolicy(), KvTtftPolicy(home_window_s=0)
    placed: Counter[str] = Counter()
    by_score: Counter[str] = Counter()
    for i in range(8):  # each after the last one's speculation ended
        system = tokens(2048, seed=900 + i)
        for chosen, p in ((placed, policy), (by_score, blind)):
            home = p.choose(request(system, now=5.0 * i), workers, {}).worker
            chosen[home] += 1
            question = request(system + tokens(64, seed=950 + i), now=5.0 * i + 2)
            held = {home: match(home, hbm=len(system) // BLOCK)}
            assert p.choose(question, workers, held).worker == home

    assert policy.homes is not None
    assert policy.homes.returns == 8
    first = policy.choose(request(tokens(2048, seed=999), now=40.0), workers, {})
    gap = first.scores["w1"]["total"] - first.scores["w0"]["total"]
    assert 0 < gap < policy.homes.return_probability(now=40.0) * 0.005
    assert placed == Counter({"w0": 2, "w1": 2, "w2": 2, "w3": 2})
    assert by_score == Counter({"w0": 8})


def test_a_home_is_never_worth_more_than_the_prediction_error_band() -> None:
    # w1 has no home and w0 has three (returned to), but a 2K-token queue makes w1 slower for a new
    # 32K-token document by ~35 ms: within 20% of its ~0.6 s prediction, far beyond 20% of
    # w0's wait (none) + 5 ms. The prompt computes the same on both; only the wait could
    # be mispredicted, and it is not sent behind a longer queue for balance.
    policy = KvTtftPolicy()
    _homes_on(policy, "w0", 3)
    workers = [view("w0"), view("w1", queued=2048)]

    decision = policy.choose(request(tokens(32_768, seed=410), now=40.0), workers, {})

    w0, w1 = decision.scores["w0"], decision.scores["w1"]
    assert (w0["home_demand"], w1["home_demand"]) == (3.0, 0.0)
    assert w0["wait_s"] == 0.0
    assert w0["total"] + 0.005 < w1["total"] < 1.2 * w0["total"]
    assert decision.worker == "w0"
    # Where the best candidate's own wait is uncertain, the band widens with it: behind
    # a 40K-token queue on w0, w1 slower by the same ~35 ms gets the home.
    busy = [view("w0", queued=40_960), view("w1", queued=43_008)]
    later = policy.choose(request(tokens(32_768, seed=411), now=45.0), busy, {})
    assert later.scores["w1"]["total"] > later.scores["w0"]["total"]
    assert later.worker == "w1"


def test_a_prompt_a_worker_holds_half_of_goes_to_its_cache_not_to_the_fewest_homes() -> None:
    # As SGLang's cache threshold: a prompt one worker holds at least half of is that
    # worker's traffic, however many homes it has; one it holds less of is a new home.
    policy = KvTtftPolicy()
    _homes_on(policy, "w0", 3)
    prompt = tokens(2048, seed=510)  # 128 blocks
    workers = [view("w0"), view("w1")]

    half = policy.choose(request(prompt, now=30.0), workers, {"w0": match("w0", hbm=64)})
    less = policy.choose(
        request(tokens(2048, seed=511), now=45.0), workers, {"w0": match("w0", hbm=8)}
    )

    assert half.worker == "w0"
    assert less.scores["w0"]["total"] < less.scores["w1"]["total"]
    assert less.worker == "w1"


def test_when_new_prompts_never_come_back_the_score_decides_again() -> None:
    # One-off traffic (every prompt new, none ever returned to). The first new prompts
    # are taken as homes and spread; as they wait unreturned the learned return
    # probability falls, the band closes, and a worker a little better by the score
    # gets every new prompt, as without the homes.
    workers = [view("w0"), view("w1", running=2, running_kv=10_000)]
    policy = KvTtftPolicy(home_window_s=60.0)

    early = _cold_prompts(policy, workers, 2)  # 0 and 10 s: nothing known yet
    late: Counter[str] = Counter()
    for i in range(40):  # 100-490 s
        prompt = request(tokens(2048, seed=700 + i), now=100.0 + 10.0 * i)
        late[policy.choose(prompt, workers, {}).worker] += 1

    assert early == Counter({"w0": 1, "w1": 1})
    assert policy.homes is not None
    assert policy.homes.return_probability(now=490.0) < 0.05
    assert late == Counter({"w0": 40})


def test_a_session_that_comes_back_counts_as_a_home_on_the_worker_serving_it() -> None:
    # A session's first turn makes a home on w0; its second turn returns to it (the
    # first turn's blocks are its prefix) and is pulled to w1: the home follows it, and
    # a returned home counts whole whatever the return probability.
    policy = KvTtftPolicy()
    first = tokens(2048, seed=800)
    assert policy.choose(request(first), [view("w0")], {}).worker == "w0"

    second = request(first + tokens(256, seed=801), now=5.0)
    decision = policy.choose(second, [view("w1")], {})

    assert decision.worker == "w1"
    assert policy.homes is not None
    assert policy.homes.demand("w1", now=5.0) == 1.0
    assert policy.homes.demand("w0", now=5.0) == 0.0
    assert policy.homes.returns == 1


def test_homes_not_yet_returned_to_are_live_cache_too() -> None:
    # Two idle workers of 800 HBM blocks. w0 holds three group prompts (768 blocks) that
    # their groups came back for: live. w1 was just made home to three new group
    # prompts that nobody has come back for yet: by reuse alone its cache looks dead,
    # and a burst of new prompts would pile onto it (the homes' balance sees 3 homes
    # there, but w0's displacement put it outside the band). Homes waiting for their
    # first return are live with the return probability: both caches are priced
    # alike and the new prompt makes its home on w0, which has none.
    policy = KvTtftPolicy(home_window_s=600.0, speculative_ttl_s=0.5)
    _live_groups(policy)
    for i in range(3):
        placed = policy.choose(request(tokens(4096, seed=630 + i), now=20.0 + i), [view("w1")], {})
        assert placed.worker == "w1"
    workers = [
        view("w0", hbm_capacity=800, dram_capacity=4_000),
        view("w1", hbm_capacity=800, dram_capacity=4_000),
    ]

    decision = policy.choose(request(tokens(4096, seed=640), now=30.0), workers, {})

    assert policy.homes is not None
    p = policy.homes.return_probability(now=30.0)
    w0, w1 = decision.scores["w0"], decision.scores["w1"]
    assert w0["home_demand"] == 0.0
    assert w1["home_demand"] == pytest.approx(3 * p)
    assert w0["live_blocks"] == 768
    assert w1["live_blocks"] == round(768 * p)
    assert 0 < w1["displace_s"] <= w0["displace_s"]
    assert decision.worker == "w0"


def test_a_prompt_no_workers_hbm_can_hold_is_still_routed() -> None:
    # Either worker would preempt it for want of room, the emptier one for less long; the
    # worker then refuses it if it is beyond the model's context. No exception on the way.
    prompt = tokens(20_000, seed=33)
    workers = [view("small", hbm_capacity=1_024), view("smaller", hbm_capacity=512)]
    decision = KvTtftPolicy().choose(request(prompt, max_tokens=10**12), workers, {})
    assert decision.worker == "small"
    assert math.isfinite(decision.predicted_ttft_s or math.inf)


def test_a_short_queue_behind_a_full_hbm_waits_for_the_request_that_frees_it() -> None:
    # The agent replay (seed 1 at 0.7 of capacity, t = 4.04 s): an 8K-token step went to
    # "short" for its 11.8K-token queue and waited 1.32 s there, HBM full until the one
    # running request that could free room finished its prefill and 95 outputs (the
    # others' histories go back to their agents' queued next steps). "longer" has more
    # to prefill, and room.
    kv = 95_879
    short = view("short", running=4, waiting=4, in_flight=8, queued=11_787, active=5_472,
                 running_kv=kv, hbm_capacity=6_144, mean_output=36.0)  # fmt: skip
    short = replace(short, queued_taken_blocks=1_189)
    longer = view("longer", running=4, waiting=2, in_flight=6, queued=18_054, active=3_000,
                  running_kv=kv, hbm_capacity=6_144, mean_output=36.0)  # fmt: skip
    prompt = tokens(8_435, seed=31)
    blind = KvTtftPolicy().choose(request(prompt), [short, longer], {})
    releases = [(0, 22, 5), (0, 25, 4), (0, 28, 5), (10_397, 95, 1_790)]
    published = replace(short, kv_release=releases)
    seen = KvTtftPolicy().choose(request(prompt), [published, longer], {})
    assert blind.worker == "short"
    assert seen.worker == "longer"
    assert seen.scores["short"]["memory_wait_s"] > 1.3
    assert seen.scores["longer"]["memory_wait_s"] == 0.0
