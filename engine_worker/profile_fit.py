"""Fitting a timing profile to the step times a worker measures.

The worker times every engine step and feeds (batch shape, seconds) to a
:class:`ProfileFitter`, which refits the coefficients of
:meth:`indexer.profile.TimingProfile.step_seconds` every so often; the worker
publishes the result in its heartbeat so that the router predicts with what
this worker actually does, not with a datasheet.

The step model is linear in its coefficients except for its base, which is
``p0`` for a prefill-only step, ``d0`` for a decode-only step and
``max(p0, d0)`` for a mixed one. The fit solves the three linear cases
(``p0 >= d0``, ``d0 >= p0``, ``p0 == d0``) and keeps the best one whose answer
respects its own assumption, which is the exact optimum of the piecewise
problem. Each case is a non-negative least-squares problem (Lawson & Hanson,
*Solving Least Squares Problems*, 1974, ch. 23) on relative errors, so that
a 5 ms decode step weighs as much as a 500 ms prefill, with columns scaled to
unit size for conditioning.

Few or degenerate samples do not make a wild profile: with fewer than
``min_samples`` samples, or when the samples cannot tell the coefficients
apart (rank-deficient design), the fit returns the prior profile with all its
time coefficients scaled by ``sum(measured) / sum(prior's prediction)``. A
coefficient that no sample exercises (no decode steps at all, say) keeps the
prior's value under the same scale.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine_worker.profiles import default_profile
from indexer.media import Medium
from indexer.profile import TimingProfile

__all__ = ["ProfileFitter", "StepSample", "fit_profile"]

_FArray = npt.NDArray[np.float64]
# Coefficient order in the design matrix: p0, p1, p2, p3, d0, d1, d2.
_P0, _D0 = 0, 4
_MODES = ("shared", "prefill_base", "decode_base")


@dataclass(slots=True)
class StepSample:
    """One measured engine step.

    Attributes:
        chunks: Prefill chunks of the step as (new tokens, cached tokens before them).
        decode_batch: Sequences that decoded one token in the step.
        decode_kv_tokens: KV tokens those sequences attended to, summed.
        seconds: Measured wall time of the step.

    Raises:
        ValueError: On negative counts, a step with no work, or ``seconds`` that
            is not a finite positive number.
    """

    chunks: list[tuple[int, int]]
    decode_batch: int
    decode_kv_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the sample (again: the dataclass is mutable); raise ValueError if bad."""
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)):
            raise ValueError(f"step seconds must be a finite number, got {self.seconds!r}")
        if self.seconds <= 0:
            raise ValueError(f"step seconds must be positive, got {self.seconds}")
        if self.decode_batch < 0 or self.decode_kv_tokens < 0:
            raise ValueError("decode_batch and decode_kv_tokens must be >= 0")
        if any(new < 0 or cached < 0 for new, cached in self.chunks):
            raise ValueError(f"prefill chunks must have counts >= 0, got {self.chunks}")
        if self.decode_batch == 0 and not any(new > 0 for new, _ in self.chunks):
            raise ValueError("a step sample must prefill or decode something")

    def features(self) -> list[float]:
        """Design row: [has_prefill, sum n, sum n^2, sum n*c, has_decode, b, k]."""
        live = [(n, c) for n, c in self.chunks if n > 0]
        return [
            1.0 if live else 0.0,
            float(sum(n for n, _ in live)),
            float(sum(n * n for n, _ in live)),
            float(sum(n * c for n, c in live)),
            1.0 if self.decode_batch > 0 else 0.0,
            float(self.decode_batch),
            float(self.decode_kv_tokens),
        ]


def _nnls(a: _FArray, b: _FArray) -> _FArray:
    """Lawson-Hanson active-set solution of min ||a x - b|| subject to x >= 0."""
    _, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(a.shape) * max(float(np.abs(a).sum(axis=0).max()), 1.0)
    budget = 3 * n + 10
    grad = a.T @ (b - a @ x)
    while budget > 0 and (~passive).any() and float(grad[~passive].max()) > tol:
        passive[int(np.argmax(np.where(passive, -np.inf, grad)))] = True
        while budget > 0:
            budget -= 1
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if bool((z[passive] > tol).all()):
                x = z
                break
            blocked = passive & (z <= tol)
            gap = np.maximum(x[blocked] - z[blocked], np.finfo(float).tiny)
            step = float(np.clip(np.min(x[blocked] / gap), 0.0, 1.0))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        grad = a.T @ (b - a @ x)
    return x


def _design(feats: _FArray, mode: str) -> _FArray:
    """The 7-column design matrix of one base-case ``mode`` (see the module docstring)."""
    d = feats.copy()
    has_p, has_d = feats[:, _P0], feats[:, _D0]
    if mode == "prefill_base":
        d[:, _D0] = has_d * (1.0 - has_p)
    elif mode == "decode_base":
        d[:, _P0] = has_p * (1.0 - has_d)
    else:
        d[:, _P0] = np.maximum(has_p, has_d)
        d[:, _D0] = 0.0
    return d


def _solve(design: _FArray, y: _FArray) -> tuple[_FArray, float]:
    """NNLS on relative errors with unit-scaled columns; (coefficients, weighted SSR)."""
    rows = design / y[:, None]
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nnls(rows / scale, np.ones_like(y)) / scale
    resid = rows @ coef - 1.0
    return coef, float(resid @ resid)


def _coefficients(profile: TimingProfile) -> _FArray:
    return np.array([*profile.prefill, *profile.decode], dtype=float)


def fit_profile(
    samples: Sequence[StepSample],
    *,
    name: str,
    kv_bytes_per_token: int,
    load_bandwidth: Mapping[Medium, float],
    max_num_batched_tokens: int,
    min_samples: int = 16,
    prior: TimingProfile | None = None,
) -> TimingProfile:
    """Fit the step-time coefficients of a profile to measured steps.

    Args:
        samples: Measured steps.
        name: Name of the fitted profile.
        kv_bytes_per_token: The worker's KV bytes per token (not fitted).
        load_bandwidth: The worker's load bandwidth per medium (measured elsewhere).
        max_num_batched_tokens: The worker's step token budget.
        min_samples: Below this many samples the fit falls back to the scaled prior.
        prior: Profile to fall back on; the packaged default profile if None.

    Returns:
        A profile whose ``source`` says how it was obtained.

    Raises:
        ValueError: A sample is invalid (see :class:`StepSample`) or an argument is
            out of range.
    """
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    for sample in samples:
        sample.validate()
    base = prior if prior is not None else default_profile()
    prior_coef = _coefficients(base)
    measured = sum(s.seconds for s in samples)
    predicted = sum(
        base.step_seconds(s.chunks, s.decode_batch, s.decode_kv_tokens) for s in samples
    )
    scale = measured / predicted if measured > 0 and predicted > 0 else 1.0

    def build(coef: Iterable[float], source: str) -> TimingProfile:
        c = [max(float(v), 0.0) for v in coef]
        return TimingProfile(
            name=name,
            prefill=(c[0], c[1], c[2], c[3]),
            decode=(c[4], c[5], c[6]),
            kv_bytes_per_token=kv_bytes_per_token,
            load_bandwidth=dict(load_bandwidth),
            max_num_batched_tokens=max_num_batched_tokens,
            source=source,
        )

    def fallback(why: str) -> TimingProfile:
        return build(
            prior_coef * scale,
            f"prior {base.name!r} scaled x{scale:.4g} ({why}; {len(samples)} step samples)",
        )

    if len(samples) < min_samples:
        return fallback(f"fewer than {min_samples} samples")
    feats = np.array([s.features() for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    best: tuple[float, _FArray, str] | None = None
    for mode in _MODES:
        design = _design(feats, mode)
        supported = np.abs(design).max(axis=0) > 0
        cols = design[:, supported]
        if np.linalg.matrix_rank(cols / np.abs(cols).max(axis=0)) < cols.shape[1]:
            continue
        coef = np.zeros(7)
        coef[supported], ssr = _solve(cols, y)
        coef[~supported] = prior_coef[~supported] * scale
        if mode == "shared":
            coef[_D0] = coef[_P0]
        violated = (mode == "prefill_base" and coef[_P0] < coef[_D0]) or (
            mode == "decode_base" and coef[_D0] < coef[_P0]
        )
        if violated:
            continue
        if best is None or ssr < best[0] * (1 - 1e-9):
            best = (ssr, coef, mode)
    if best is None:
        return fallback("samples cannot separate the coefficients")
    ssr, coef, mode = best
    rms = math.sqrt(ssr / len(samples))
    return build(
        coef,
        f"least-squares fit ({mode}) of {len(samples)} step samples, "
        f"rms relative error {rms:.2%}; unexercised terms from prior {base.name!r} x{scale:.4g}",
    )


class ProfileFitter:
    """Keeps the last ``capacity`` step samples and refits every ``refit_every`` samples.

    Pure bookkeeping (no clock, no I/O, not thread-safe): the worker calls
    :meth:`add` from its step loop and publishes :attr:`profile`.
    """

    def __init__(
        self,
        *,
        name: str,
        kv_bytes_per_token: int,
        load_bandwidth: Mapping[Medium, float],
        max_num_batched_tokens: int,
        capacity: int = 2048,
        refit_every: int = 128,
        min_samples: int = 32,
        prior: TimingProfile | None = None,
    ) -> None:
        if capacity < 1 or refit_every < 1:
            raise ValueError("capacity and refit_every must be >= 1")
        self._samples: deque[StepSample] = deque(maxlen=capacity)
        self._since_fit = 0
        self._refit_every = refit_every
        self._name = name
        self._kv_bytes_per_token = kv_bytes_per_token
        self._load_bandwidth = dict(load_bandwidth)
        self._max_num_batched_tokens = max_num_batched_tokens
        self._min_samples = min_samples
        self._prior = prior
        self.profile: TimingProfile = self.refit()

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: StepSample) -> TimingProfile | None:
        """Record one step; return the new profile when this sample triggered a refit.

        Raises:
            ValueError: The sample is invalid; nothing is recorded.
        """
        sample.validate()
        self._samples.append(sample)
        self._since_fit += 1
        if self._since_fit < self._refit_every:
            return None
        return self.refit()

    def refit(self) -> TimingProfile:
        """Fit the samples held now, make it the current :attr:`profile`, and return it."""
        self.profile = fit_profile(
            list(self._samples),
            name=self._name,
            kv_bytes_per_token=self._kv_bytes_per_token,
            load_bandwidth=self._load_bandwidth,
            max_num_batched_tokens=self._max_num_batched_tokens,
            min_samples=self._min_samples,
            prior=self._prior,
        )
        self._since_fit = 0
        return self.profile
