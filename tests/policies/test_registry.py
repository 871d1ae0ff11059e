"""The registry, and what every registered policy promises on any input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.media import Medium
from indexer.views import PrefixMatch, WorkerView
from policies.base import NoWorkerError, Policy, RouteRequest
from policies.registry import (
    DEFAULT_POLICY,
    POLICIES,
    check_policy_names,
    make_policy,
    policy_names,
)
from tests.policies.support import match, request, tokens, view

EXPECTED = {
    "kv_ttft",
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "sglang_cache_aware",
    "llmd_precise",
    "dynamo_cost",
    "mooncake_conductor",
}


def test_names_list_the_default_first_and_every_policy_once() -> None:
    names = policy_names()

    assert names[0] == DEFAULT_POLICY == "kv_ttft"
    assert sorted(names) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_policy_satisfies_the_protocol_and_handles_one_worker(name: str) -> None:
    policy = make_policy(name, seed=3)

    decision = policy.choose(request(tokens(100, seed=1)), [view("only")], {})

    assert isinstance(policy, Policy)
    assert policy.name == name
    assert decision.policy == name
    assert decision.worker == "only"
    assert decision.ranked() == ["only"]
    with pytest.raises(NoWorkerError):
        policy.choose(request(tokens(100, seed=1)), [], {})


def test_unknown_names_and_options_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'; valid: kv_ttft, dynamo_cost"):
        make_policy("fastest")
    # Every command that takes policy names refuses them the same way, all at once.
    with pytest.raises(ValueError, match="unknown policy 'a', 'b'; valid: all, kv_ttft, "):
        check_policy_names(["a", "kv_ttft", "all", "b"], also=["all"])
    check_policy_names(policy_names())
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("round_robin", cache_threshold=0.3)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("sglang_cache_aware", cache_threshold=2.0)


def test_options_reach_the_policy() -> None:
    hot = view("hot", waiting=10, hbm_used=9_000)
    idle = view("idle")
    prompt = request(tokens(1600, seed=2))
    matches = {"hot": match("hot", hbm=100)}

    assert make_policy("llmd_precise").choose(prompt, [hot, idle], matches).worker == "idle"
    assert (
        make_policy("llmd_precise", prefix_weight=10.0).choose(prompt, [hot, idle], matches).worker
        == "hot"
    )
    assert set(POLICIES) == EXPECTED


@st.composite
def situations(draw: st.DrawFn) -> tuple[RouteRequest, list[WorkerView], dict[str, PrefixMatch]]:
    hosts = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True))
    workers = [
        view(
            h,
            running=draw(st.integers(0, 300)),
            waiting=draw(st.integers(0, 50)),
            in_flight=draw(st.integers(0, 400)),
            queued=draw(st.integers(0, 200_000)),
            hbm_used=draw(st.integers(0, 10_000)),
            ts=draw(st.floats(0, 100)),
            bandwidth=draw(
                st.dictionaries(st.sampled_from([Medium.DRAM, Medium.SSD]), st.floats(1e6, 1e11))
            ),
        )
        for h in hosts
    ]
    n = draw(st.integers(0, 3000))
    prompt = request(tokens(n, seed=draw(st.integers(0, 5))), now=draw(st.floats(0, 100)))
    blocks = len(prompt.block_keys)
    matches: dict[str, PrefixMatch] = {}
    for h in draw(st.lists(st.sampled_from("abcdefghxyz"), unique=True)):
        hbm = draw(st.integers(0, blocks))
        dram = draw(st.integers(0, blocks - hbm))
        ssd = draw(st.integers(0, blocks - hbm - dram))
        if hbm + dram + ssd:
            matches[h] = PrefixMatch(h, hbm + dram + ssd, (hbm, dram, ssd))
    return prompt, workers, matches


@pytest.mark.parametrize("name", sorted(EXPECTED))
@settings(max_examples=40, deadline=None)
@given(cases=st.lists(situations(), min_size=1, max_size=4))
def test_any_situation_gets_a_listed_worker_and_a_full_ranking(
    name: str, cases: list[tuple[RouteRequest, list[WorkerView], dict[str, PrefixMatch]]]
) -> None:
    policy = make_policy(name, seed=11)
    for prompt, workers, matches in cases:
        hosts = {w.host for w in workers}

        decision = policy.choose(prompt, workers, matches)

        assert decision.worker in hosts
        assert set(decision.scores) == hosts
        assert all("total" in terms for terms in decision.scores.values())
        assert sorted(decision.ranked()) == sorted(hosts)
        indexed = matches[decision.worker].blocks if decision.worker in matches else 0
        if decision.kv_source is not None:
            # matched_blocks counts the blocks pulled from the source: more than the
            # chosen worker holds, no more than the source holds of this prompt.
            held = min(matches[decision.kv_source].blocks, len(prompt.block_keys))
            assert indexed < decision.matched_blocks <= held
            if name != "kv_ttft":  # kv_ttft may pull less: what fits in HBM
                assert decision.matched_blocks == held
        elif name == "kv_ttft":  # its speculative entries can only widen the index's match
            assert decision.matched_blocks >= indexed
        else:
            assert decision.matched_blocks == indexed
        if decision.predicted_ttft_s is not None:
            assert decision.predicted_ttft_s >= 0
        assert decision.kv_source is None or decision.kv_source in hosts
