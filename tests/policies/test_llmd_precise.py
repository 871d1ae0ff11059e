"""llmd_precise: tier-weighted longest prefix, queue and KV-usage scorers, weights 3/2/2."""

from __future__ import annotations

import pytest

from policies.base import NoWorkerError
from policies.llmd_precise import LlmdPrecisePolicy
from tests.policies.support import match, request, tokens, view

PROMPT = request(tokens(1600, seed=1))  # 100 blocks


def test_tier_weights_rank_hbm_over_dram_over_ssd() -> None:
    workers = [view("gpu"), view("cpu"), view("disk")]
    matches = {
        "gpu": match("gpu", hbm=100),
        "cpu": match("cpu", dram=100),
        "disk": match("disk", ssd=100),
    }

    decision = LlmdPrecisePolicy().choose(PROMPT, workers, matches)

    assert decision.worker == "gpu"
    # Raw scores 100, 80, 30, min-max normalized.
    assert decision.scores["gpu"]["prefix"] == 1.0
    assert decision.scores["cpu"]["prefix"] == pytest.approx((80 - 30) / (100 - 30))
    assert decision.scores["disk"]["prefix"] == 0.0
    assert decision.ranked() == ["gpu", "cpu", "disk"]
    assert decision.lower_is_better is False


def test_one_matching_pod_scores_one_and_the_rest_zero() -> None:
    decision = LlmdPrecisePolicy().choose(
        PROMPT, [view("a"), view("b")], {"b": match("b", hbm=3), "gone": match("gone", hbm=99)}
    )

    assert decision.worker == "b"
    assert (decision.scores["a"]["prefix"], decision.scores["b"]["prefix"]) == (0.0, 1.0)
    assert "gone" not in decision.scores


def test_queue_and_kv_usage_outweigh_the_prefix_with_default_weights() -> None:
    hot = view("hot", waiting=10, hbm_used=9_000)
    idle = view("idle", waiting=0, hbm_used=0)

    decision = LlmdPrecisePolicy().choose(PROMPT, [hot, idle], {"hot": match("hot", hbm=100)})

    hot_total = 3 * 1.0 + 2 * 0.0 + 2 * (1 - 0.9)
    idle_total = 3 * 0.0 + 2 * 1.0 + 2 * 1.0
    assert decision.worker == "idle"
    assert decision.scores["hot"]["total"] == pytest.approx(hot_total)
    assert decision.scores["idle"]["total"] == pytest.approx(idle_total)


def test_a_heavier_prefix_weight_turns_the_choice_around() -> None:
    hot = view("hot", waiting=10, hbm_used=9_000)
    idle = view("idle", waiting=0, hbm_used=0)

    decision = LlmdPrecisePolicy(prefix_weight=10.0).choose(
        PROMPT, [hot, idle], {"hot": match("hot", hbm=100)}
    )

    assert decision.worker == "hot"


def test_ties_are_broken_by_the_seeded_generator() -> None:
    workers = [view(h) for h in ("a", "b", "c", "d")]

    def run(seed: int) -> list[str]:
        policy = LlmdPrecisePolicy(seed=seed)
        return [policy.choose(request(tokens(32, seed=i)), workers, {}).worker for i in range(40)]

    assert run(1) == run(1)
    assert len(set(run(1))) > 1


def test_bad_weights_and_no_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="weights"):
        LlmdPrecisePolicy(queue_weight=-1.0)
    with pytest.raises(NoWorkerError):
        LlmdPrecisePolicy().choose(PROMPT, [], {})
