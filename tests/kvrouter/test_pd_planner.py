"""The gateway's prefill/decode plan: which decoder, and whether splitting pays."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from indexer.media import Medium
from indexer.views import Role, WorkerView
from kvrouter.gateway.load import Load
from kvrouter.gateway.pd import DEFAULT_TRANSFER_BANDWIDTH, PdPlanner
from kvrouter.policy_factory import build_policy
from kvrouter.router_core import RouterCore, prefill_tokens
from policies.cost_model import prefill_seconds, step_residual_seconds
from tests.policies.support import BLOCK, PROFILE, match, request, tokens, view


def planner(mode: str = "auto") -> PdPlanner:
    return PdPlanner(mode, PROFILE)  # type: ignore[arg-type]


def prefill_view(host: str = "p") -> WorkerView:
    return replace(view(host), role=Role.PREFILL)


def decode_view(
    host: str = "d", *, in_flight: int = 0, running: int = 0, running_kv: int = 0
) -> WorkerView:
    busy = view(host, in_flight=in_flight, running=running, running_kv=running_kv)
    return replace(busy, role=Role.DECODE)


def test_the_decoder_is_the_least_loaded_then_the_one_holding_more_of_the_prompt() -> None:
    workers = [prefill_view(), decode_view("d1", in_flight=3), decode_view("d2"), decode_view("d3")]
    plan = planner("always").plan(workers, "p", 0.1, 4096, BLOCK, {"d3": match("d3", hbm=100)})
    assert (plan.disaggregate, plan.decode) == (True, "d3")
    assert planner("never").plan(workers, "p", 0.1, 4096, BLOCK, {}).disaggregate is False
    alone = planner("always").plan([prefill_view()], "p", 0.1, 4096, BLOCK, {})
    assert (alone.disaggregate, alone.reason) == (False, "no_decode_worker")


def test_auto_splits_when_local_prefill_would_stall_a_busy_decoder() -> None:
    prompt = 16_384
    split_ttft = PROFILE.prefill_seconds(prompt)
    transfer = prompt * PROFILE.kv_bytes_per_token / DEFAULT_TRANSFER_BANDWIDTH
    # An idle decoder: computing locally costs its own prefill, no stall; splitting adds
    # the transfer on top of the same prefill, so it stays local.
    idle = planner().plan([prefill_view(), decode_view()], "p", split_ttft, prompt, BLOCK, {})
    assert (idle.disaggregate, idle.reason, idle.prefill) == (False, "cheaper_local", "d")
    assert idle.predicted["split_transfer"] > 0
    # 64 sequences decoding there: each would wait out the 16K-token prefill.
    busy = decode_view(running=64, running_kv=64 * 2048)
    plan = planner().plan([prefill_view(), busy], "p", split_ttft, prompt, BLOCK, {})
    assert (plan.disaggregate, plan.reason, plan.decode) == (True, "cheaper_split", "d")
    # Each of them waits out what the prompt's chunks add to the steps carrying them
    # (those steps would decode the 64 anyway).
    kv = 64 * 2048
    chunk = PROFILE.max_num_batched_tokens - 64
    added = sum(
        PROFILE.step_seconds([(min(chunk, prompt - done), done)], 64, kv)
        - PROFILE.decode_seconds(64, kv)
        for done in range(0, prompt, chunk)
    )
    assert plan.predicted["decode_local_decode_stall"] == pytest.approx(64 * added)
    assert plan.predicted["split_transfer"] == transfer
    assert plan.header()["mode"] == "disaggregated"


def test_on_an_idle_fleet_a_tie_keeps_the_request_on_the_policys_choice() -> None:
    """The policy chose a worker that prefills and decodes; an idle decode-only worker
    would serve the request in exactly the same time. The plan keeps the policy's choice:
    moving it would put prefill work, and then the prompt's cached prefix that draws
    its followers, on a worker kept for decoding, for nothing."""
    prompt = 4096
    ttft = PROFILE.prefill_seconds(prompt)
    workers = [view("mixed"), decode_view("d")]
    plan = planner().plan(workers, "mixed", ttft, prompt, BLOCK, {})
    assert plan.predicted["decode_local_ttft"] == pytest.approx(
        plan.predicted["prefill_local_ttft"]
    )
    assert (plan.disaggregate, plan.reason, plan.prefill) == (False, "cheaper_local", "mixed")
    # Where the decoder is strictly cheaper (it holds the prompt), it still takes it.
    held = planner().plan(workers, "mixed", ttft, prompt, BLOCK, {"d": match("d", hbm=200)})
    assert (held.disaggregate, held.prefill) == (False, "d")


def test_through_the_router_core_the_plan_sees_what_the_router_sent_since_the_heartbeat() -> None:
    # Two idle decoders by their heartbeats; the router has since sent three requests
    # to d1 (its own count). The planner, handed the core's overlaid views, takes d2.
    core = RouterCore(build_policy("least_load"), planner=planner("always"))
    workers = [prefill_view(), decode_view("d1"), decode_view("d2")]
    tracked = {"d1": Load(in_flight=3)}

    def load_of(host: str) -> Load:
        return tracked.get(host, Load())

    req = request(tokens(4096, seed=1))
    stale = core.decide(req, workers, None, {}).plan
    laid = core.decide(req, workers, load_of, {}).plan
    assert stale is not None
    assert laid is not None
    assert (stale.decode, laid.decode) == ("d1", "d2")


def test_a_short_remainder_stays_on_the_decoding_worker_that_holds_the_prefix() -> None:
    # The same 256-token prompt again: the policy's choice ("both" role, decoding 4
    # requests) holds all of it but the last token; the decoder is idle and cold.
    # Prefilling one token beside the 4 decodes adds its own few microseconds to their
    # step, not a whole prefill step each (which had sent the request to recompute
    # all 256 tokens on the cold decoder, with no cache hit, at twice the TTFT).
    prompt = 256
    both = replace(view("b", running=4, running_kv=4 * 512), role=Role.BOTH)
    workers = [both, decode_view("d")]
    held = {"b": match("b", hbm=prompt // BLOCK)}
    # What kv_ttft predicts there: the rest of the decode step in progress, then the
    # last token beside the 4 decodes.
    ttft = step_residual_seconds(PROFILE, 0, 4, 4 * 512)
    ttft += prefill_seconds(PROFILE, 1, prompt - 1, 4, 4 * 512)
    plan = planner().plan(workers, "b", ttft, prompt, BLOCK, held)
    assert (plan.disaggregate, plan.prefill, plan.reason) == (False, "b", "cheaper_local")
    stall = plan.predicted["prefill_local_decode_stall"]
    assert 0 < stall < PROFILE.prefill[0] / 10
    # Its TTFT is what the policy predicted (the step in progress, then one token); the
    # cold decoder would compute all 256 tokens.
    assert plan.predicted["prefill_local_ttft"] == pytest.approx(ttft)
    assert plan.predicted["decode_local_ttft"] == pytest.approx(PROFILE.prefill_seconds(prompt))
    assert plan.predicted["prefill_local_ttft"] < plan.predicted["decode_local_ttft"]


def test_with_pooling_the_decoder_pulls_the_prefix_a_busy_worker_holds() -> None:
    # The policy's choice ("both") holds the whole 8K-token prompt but has 64K tokens of
    # prefill queued; the decoder is idle and cold. Colocating on the decoder wins either
    # way; with pooling it pulls the prefix instead of computing it, and the plan says so.
    prompt = 8192
    both = replace(view("b", queued=65_536, queued_context=65_536), role=Role.BOTH)
    workers = [both, decode_view("d")]
    held = {"b": match("b", hbm=prompt // BLOCK)}
    ttft = PROFILE.prefill_seconds(65_536) + PROFILE.prefill_seconds(1, prompt - 1)
    alone = planner().plan(workers, "b", ttft, prompt, BLOCK, held)
    pooled = PdPlanner("auto", PROFILE, pooling=True).plan(workers, "b", ttft, prompt, BLOCK, held)
    assert (alone.disaggregate, alone.prefill, alone.kv_source, alone.matched_blocks) == (
        False, "d", None, 0,
    )  # fmt: skip
    assert (pooled.disaggregate, pooled.prefill, pooled.kv_source) == (False, "d", "b")
    assert pooled.matched_blocks == prompt // BLOCK
    assert pooled.header()["kv_source"] == "b"
    # The pull at the default transfer bandwidth, then one token to prefill: far below
    # computing 8K tokens.
    pull = prompt * PROFILE.kv_bytes_per_token / DEFAULT_TRANSFER_BANDWIDTH
    assert pooled.predicted["decode_local_pull"] == pytest.approx(pull)
    assert pooled.predicted["decode_local_ttft"] < alone.predicted["decode_local_ttft"] / 2
    # A decoder whose HBM has room for 100 blocks pulls no more than those.
    tight = replace(decode_view("d"), kv_capacity_blocks={Medium.HBM: 100})
    capped = PdPlanner("auto", PROFILE, pooling=True, mean_output_tokens=0).plan(
        [both, tight], "b", ttft, prompt, BLOCK, held
    )
    assert (capped.prefill, capped.kv_source, capped.matched_blocks) == ("d", "b", 100)


def test_the_router_counts_what_the_worker_the_plan_moved_a_request_to_prefills() -> None:
    # The plan colocates on the decode-only worker, which the policy never scored: the
    # router's queued count there is what it computes (all of it, or all but what it
    # pulls), not nothing, or the next request sees that worker idle.
    prompt = 8192
    both = replace(view("b", queued=65_536, queued_context=65_536), role=Role.BOTH)
    held = {"b": match("b", hbm=prompt // BLOCK)}
    req = request(tokens(prompt, seed=3))
    for pooling, todo in ((False, prompt), (True, 1)):
        core = RouterCore(
            build_policy("kv_ttft"), planner=PdPlanner("auto", PROFILE, pooling=pooling)
        )
        out = core.decide(req, [both, decode_view("d")], None, held)
        assert out.plan is not None
        assert (out.decision.worker, out.plan.prefill) == ("b", "d")
        counts = prefill_tokens(out.decision, out.plan, prompt, BLOCK)
        assert counts["d"] == todo
        assert counts["b"] == 1


def test_a_decoder_ending_a_prefill_step_is_priced_for_what_is_left_of_it() -> None:
    # The decoder is 80 ms into a 4K-token prefill step that ends 10 ms from now: a
    # colocated request waits those 10 ms, not the whole step, as kv_ttft prices it.
    prompt = 2_048
    queued = 4_096
    busy = replace(
        decode_view(), queued_prefill_tokens=queued, step_ends_ts=50.01,
        step_prefill_tokens=queued,
    )  # fmt: skip
    mid = planner().plan([prefill_view(), busy], "p", 0.05, prompt, BLOCK, {}, now=50.0)
    assert mid.predicted["decode_local_ttft"] == pytest.approx(
        0.01 + PROFILE.prefill_seconds(prompt)
    )
    # A view older than its step: the queue is counted whole.
    stale = planner().plan([prefill_view(), busy], "p", 0.05, prompt, BLOCK, {}, now=50.02)
    assert stale.predicted["decode_local_ttft"] == pytest.approx(
        PROFILE.prefill_seconds(queued) + PROFILE.prefill_seconds(prompt)
    )
