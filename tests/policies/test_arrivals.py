"""Routing rates per host decay with time and start at zero."""

from __future__ import annotations

import math

import pytest

from policies.arrivals import RouteRates


def test_a_steady_stream_converges_to_its_rate_and_decays_when_it_stops() -> None:
    rates = RouteRates(tau_s=2.0)
    assert rates.rate("w", 0.0) == 0.0
    for i in range(400):  # 10 requests per second for 40 s
        rates.record("w", i * 0.1)
    assert rates.rate("w", 39.9) == pytest.approx(10.0, rel=0.05)
    # Two time constants of silence later, e^-2 of it is left.
    assert rates.rate("w", 43.9) == pytest.approx(rates.rate("w", 39.9) * math.exp(-2), rel=1e-6)
    assert rates.rate("other", 39.9) == 0.0


def test_out_of_order_timestamps_never_raise_the_rate() -> None:
    rates = RouteRates(tau_s=1.0)
    rates.record("w", 10.0)
    before = rates.rate("w", 10.0)
    assert rates.rate("w", 9.0) == pytest.approx(before)
