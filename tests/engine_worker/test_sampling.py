"""Sampling honours temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine_worker.request import SamplingParams
from engine_worker.sampling import Sampler, penalize

LOGITS = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])


def draws(params: SamplingParams, n: int = 300, seed: int = 0) -> set[int]:
    s = Sampler(seed=seed)
    return {s.sample(LOGITS, [params], [f"r{i}"])[0] for i in range(n)}


def test_greedy_is_argmax() -> None:
    assert draws(SamplingParams(temperature=0.0), n=5) == {1}


def test_temperature_samples_beyond_the_argmax() -> None:
    assert len(draws(SamplingParams(temperature=1.0))) >= 3


def test_top_k_keeps_only_the_k_best() -> None:
    assert draws(SamplingParams(temperature=1.5, top_k=2)) == {1, 2}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # Token 1 holds ~0.47 of the mass, so a 0.5 nucleus needs token 2 too, and no more.
    got = draws(SamplingParams(temperature=1.0, top_p=0.5))
    assert got <= {1, 2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.01)) == {1}


def test_a_seeded_request_is_reproducible_whatever_shares_its_batch() -> None:
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=8)
    a = Sampler(seed=1)
    b = Sampler(seed=2)
    seq_a = [a.sample(LOGITS, [p], ["x"])[0] for _ in range(20)]
    seq_b = []
    for _ in range(20):
        both = b.sample(torch.cat([LOGITS, LOGITS]), [SamplingParams(), p], ["other", "x"])
        seq_b.append(both[1])
    assert seq_a == seq_b


def test_rows_and_params_must_agree() -> None:
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler().sample(LOGITS, [], [])


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature: float) -> None:
    # Found live: temperature 1e-300 made the scores infinite, the softmax NaN, and
    # torch.multinomial raised in the engine loop, which died for every request.
    assert SamplingParams(temperature=temperature).greedy
    assert draws(SamplingParams(temperature=temperature), n=20) == {1}
    assert not SamplingParams(temperature=1e-4).greedy


def test_a_row_whose_logits_are_not_finite_does_not_stop_the_batch() -> None:
    broken = torch.tensor([[0.0, float("nan"), 1.0, -1.0, 0.5]])
    s = Sampler(seed=0)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    for _ in range(20):
        out = s.sample(torch.cat([broken, LOGITS]), params, ["broken", "fine"])
        assert out[1] == 1  # the other request goes on
        assert 0 <= out[0] < broken.shape[1]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_a_seed_beyond_64_bits_is_refused_before_it_reaches_a_generator(seed: int) -> None:
    # Found live: seed 2**70 overflowed torch's manual_seed inside the engine loop.
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=seed)
    for ok in (2**63 - 1, -(2**63), 0):
        assert draws(SamplingParams(temperature=1.0, seed=ok), n=3)


def test_frequency_and_presence_penalties_follow_openais_definition() -> None:
    # logit -= frequency * count + presence * (count > 0), on the output's tokens only.
    row = LOGITS[0].clone()
    p = SamplingParams(temperature=0.0, frequency_penalty=0.1, presence_penalty=0.2)
    penalize(row, p, prompt=torch.tensor([2]), output=[1, 1, 4])
    assert row.tolist() == pytest.approx([0.0, 3.0 - 0.2 - 0.2, 2.9, -1.0, 1.0 - 0.1 - 0.2])
    # Greedy sampling reads the penalized logits: token 1 lost its lead to token 2.
    s = Sampler()
    assert s.sample(LOGITS, [p], ["r"], [([2, 2, 2], [1, 1, 4])]) == [2]
    assert s.sample(LOGITS, [SamplingParams(temperature=0.0)], ["r"]) == [1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    row = LOGITS[0].clone()
    penalize(row, SamplingParams(repetition_penalty=2.0), prompt=torch.tensor([2]), output=[3])
    # Through the sampler, the prompt's ids are read once per request, not every step.
    s = Sampler()
    rp = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert s.sample(LOGITS, [rp], ["r"], [([1, 2, 2], [])]) == [4]  # 3 -> 0.75, 2.9 -> 0.725
    assert s._prompts["r"].tolist() == [1, 2]
    s.forget("r")
    assert "r" not in s._prompts
    assert row.tolist() == pytest.approx([0.0, 3.0, 1.45, -2.0, 1.0])


def test_logit_bias_adds_to_the_named_tokens() -> None:
    p = SamplingParams(temperature=0.0, logit_bias=((4, 100.0), (1, -100.0)))
    assert Sampler().sample(LOGITS, [p], ["r"], [([], [])]) == [4]
    banned = SamplingParams(temperature=1.0, logit_bias=((0, -100.0),))
    s = Sampler(seed=3)
    got = {s.sample(LOGITS, [banned], [f"r{i}"], [([], [])])[0] for i in range(300)}
    assert 0 not in got
    assert len(got) >= 3


def test_penalties_need_the_rows_tokens_and_sane_values() -> None:
    with pytest.raises(ValueError, match="token ids"):
        Sampler().sample(LOGITS, [SamplingParams(presence_penalty=1.0)], ["r"])
    for bad in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 101.0),)},
    ):
        with pytest.raises(ValueError, match=r"penalty|logit_bias"):
            SamplingParams(**bad)


def test_min_p_drops_tokens_less_likely_than_a_fraction_of_the_likeliest() -> None:
    # Probabilities at temperature 1: token 1 ~0.47, 2 ~0.43, 4 ~0.06, 0 ~0.02, 3 ~0.01.
    assert draws(SamplingParams(temperature=1.0, min_p=0.5)) == {1, 2}
    assert len(draws(SamplingParams(temperature=1.0, min_p=0.0))) >= 3
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
