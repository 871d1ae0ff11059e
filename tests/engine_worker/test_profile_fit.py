"""Fitting a timing profile to measured step times."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from engine_worker.profile_fit import ProfileFitter, StepSample, _nnls, fit_profile
from engine_worker.profiles import default_profile
from indexer.media import Medium
from indexer.profile import TimingProfile

BANDWIDTH = {Medium.DRAM: 4e10}


def truth(p0: float, d0: float) -> TimingProfile:
    return TimingProfile(
        name="truth",
        prefill=(p0, 2.0e-5, 8.0e-10, 1.5e-9),
        decode=(d0, 8.0e-6, 5.0e-8),
        kv_bytes_per_token=131072,
        max_num_batched_tokens=8192,
    )


def steps(profile: TimingProfile, n: int, seed: int, noise: float) -> list[StepSample]:
    """Mixed, prefill-only and decode-only steps, timed by ``profile`` with noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.random()
        chunks = []
        if kind < 0.7:
            chunks = [
                (rng.randint(1, 4096), rng.randint(0, 16_000)) for _ in range(rng.randint(1, 3))
            ]
        batch = rng.randint(1, 200) if kind > 0.35 else 0
        kv = batch * rng.randint(100, 6000)
        seconds = profile.step_seconds(chunks, batch, kv) * (1 + rng.gauss(0, noise))
        out.append(StepSample(chunks, batch, kv, seconds))
    return out


def fit(samples: list[StepSample], **kwargs: object) -> TimingProfile:
    return fit_profile(
        samples,
        name="fitted",
        kv_bytes_per_token=131072,
        load_bandwidth=BANDWIDTH,
        max_num_batched_tokens=8192,
        **kwargs,  # type: ignore[arg-type]
    )


def worst_error(
    fitted: TimingProfile, reference: TimingProfile, samples: list[StepSample]
) -> float:
    return max(
        abs(
            fitted.step_seconds(s.chunks, s.decode_batch, s.decode_kv_tokens)
            / reference.step_seconds(s.chunks, s.decode_batch, s.decode_kv_tokens)
            - 1
        )
        for s in samples
    )


@pytest.mark.parametrize(("p0", "d0"), [(0.012, 0.004), (0.003, 0.009), (0.006, 0.006)])
def test_noisy_samples_recover_the_profiles_predictions(p0: float, d0: float) -> None:
    real = truth(p0, d0)

    fitted = fit(steps(real, 600, seed=1, noise=0.02))

    held_out = steps(real, 300, seed=2, noise=0.0)
    assert worst_error(fitted, real, held_out) < 0.04
    assert fitted.kv_bytes_per_token == 131072
    assert fitted.load_bandwidth == BANDWIDTH
    assert "least-squares" in fitted.source


def test_coefficients_stay_non_negative_where_plain_least_squares_goes_negative() -> None:
    # No attention to cached context at all (p3 = 0) and only fresh chunks: noise alone
    # decides the sign of an unconstrained p3.
    real = TimingProfile(
        name="flat",
        prefill=(0.004, 2.0e-5, 0.0, 0.0),
        decode=(0.004, 1.0e-5, 0.0),
        kv_bytes_per_token=1,
    )
    rng = random.Random(3)
    samples = []
    for _ in range(200):
        n = rng.randint(1, 2000)
        cached = rng.choice([0, 0, 0, 16])
        seconds = real.step_seconds([(n, cached)], 0, 0) * (1 + rng.gauss(0, 0.05))
        samples.append(StepSample([(n, cached)], 0, 0, seconds))
    x = np.array([[1, n, n * n, n * c] for s in samples for n, c in s.chunks], dtype=float)
    y = np.array([s.seconds for s in samples])
    plain = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0]
    assert (plain < 0).any()

    fitted = fit(samples)

    assert min(fitted.prefill) >= 0
    assert min(fitted.decode) >= 0
    assert worst_error(fitted, real, samples) < 0.1


def test_too_few_samples_fall_back_to_the_prior_scaled_to_the_measurements() -> None:
    prior = default_profile()
    slower = steps(prior, 5, seed=4, noise=0.0)
    for s in slower:
        s.seconds *= 1.5

    fitted = fit(slower)

    for s in slower:
        assert fitted.step_seconds(s.chunks, s.decode_batch, s.decode_kv_tokens) == pytest.approx(
            s.seconds
        )
    assert fitted.prefill[1] == pytest.approx(prior.prefill[1] * 1.5)
    assert "fewer than 16 samples" in fitted.source


def test_samples_that_cannot_separate_the_coefficients_fall_back_too() -> None:
    prior = default_profile()
    same_shape = [StepSample([(1000, 0)], 0, 0, 0.05) for _ in range(40)]

    fitted = fit(same_shape)

    assert fitted.prefill_seconds(1000) == pytest.approx(0.05)
    assert fitted.prefill[2] / fitted.prefill[1] == pytest.approx(
        prior.prefill[2] / prior.prefill[1]
    )
    assert "cannot separate" in fitted.source


def test_terms_no_sample_exercises_come_from_the_prior() -> None:
    prior = default_profile()
    prefill_only = [s for s in steps(prior, 400, seed=5, noise=0.0) if s.decode_batch == 0]

    fitted = fit(prefill_only)

    assert fitted.decode[1:] == pytest.approx(prior.decode[1:], rel=0.05)
    assert fitted.prefill == pytest.approx(prior.prefill, rel=0.02)


@pytest.mark.parametrize(
    ("seconds", "chunks", "batch"),
    [
        (-0.01, [(10, 0)], 0),
        (math.nan, [(10, 0)], 0),
        (math.inf, [(10, 0)], 0),
        (0.0, [(10, 0)], 0),
        (0.01, [(-1, 0)], 0),
        (0.01, [], 0),
        (0.01, [], -2),
    ],
)
def test_bad_samples_are_refused(seconds: float, chunks: list[tuple[int, int]], batch: int) -> None:
    with pytest.raises(ValueError, match=r"step|chunks|decode"):
        StepSample(chunks, batch, 0, seconds)


def test_a_sample_corrupted_after_creation_is_refused_by_the_fit() -> None:
    samples = steps(default_profile(), 30, seed=6, noise=0.0)
    samples[7].seconds = math.nan

    with pytest.raises(ValueError, match="finite"):
        fit(samples)


def test_fitter_refits_every_n_samples_from_a_bounded_window() -> None:
    fitter = ProfileFitter(
        name="w0",
        kv_bytes_per_token=131072,
        load_bandwidth=BANDWIDTH,
        max_num_batched_tokens=8192,
        capacity=300,
        refit_every=100,
        min_samples=50,
    )
    fast, slow = truth(0.005, 0.005), truth(0.01, 0.01)
    new_profiles = [fitter.add(s) for s in steps(fast, 300, seed=7, noise=0.01)]

    assert [i for i, p in enumerate(new_profiles) if p is not None] == [99, 199, 299]
    assert worst_error(fitter.profile, fast, steps(fast, 50, seed=8, noise=0.0)) < 0.03

    # The worker slows down (say, a co-tenant): once the window holds only new steps,
    # the profile follows.
    for s in steps(slow, 300, seed=9, noise=0.01):
        fitter.add(s)
    assert len(fitter) == 300
    assert worst_error(fitter.profile, slow, steps(slow, 50, seed=10, noise=0.0)) < 0.03


def test_fitter_refuses_a_bad_sample_without_recording_it() -> None:
    fitter = ProfileFitter(
        name="w0", kv_bytes_per_token=1, load_bandwidth={}, max_num_batched_tokens=8192
    )
    sample = StepSample([(10, 0)], 0, 0, 0.01)
    sample.seconds = -1.0

    with pytest.raises(ValueError, match="positive"):
        fitter.add(sample)
    assert len(fitter) == 0


def test_the_non_negative_solver_meets_the_optimality_conditions() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.normal(size=(30, 6))
        b = rng.normal(size=30)

        x = _nnls(a, b)

        gradient = a.T @ (b - a @ x)
        assert (x >= 0).all()
        # Karush-Kuhn-Tucker: no descent along free coordinates, none into the bound.
        assert np.abs(gradient[x > 0]).max(initial=0.0) < 1e-9
        assert gradient[x == 0].max(initial=-1.0) < 1e-9
