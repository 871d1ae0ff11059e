"""A live PD replay (2 prefill + 2 decode sim workers behind the gateway) agrees with the
offline simulator on the same slice: every request split, and the same hit rate."""

from __future__ import annotations

import pytest

from kvrouter.bench.sim_vs_live import PD_TIERS, Cluster, Comparison, compare, pd_slice

pytestmark = pytest.mark.slow

#: Hit rates may differ by this much (absolute): close routing calls between the two
#: prefill workers fall differently live (real HTTP hops keep a prefill leg in flight
#: longer), which moves hits between HBM and DRAM more than it changes their sum.
HIT_TOLERANCE = 0.05


def test_pd_always_live_agrees_with_the_simulator() -> None:
    trace = pd_slice(seed=3, sessions=8, session_rate=1.0)
    cluster = Cluster(
        workers=0, prefill_workers=2, decode_workers=2, pd="always", tiers=tuple(PD_TIERS.items())
    )
    c = compare(trace, cluster, seed=3)
    assert c.errors == 0
    assert c.live.completed == c.offline.completed == len(trace)
    # always with both pools up: every request is split, live and offline.
    assert Comparison.split(c.live_records) == Comparison.split(c.offline_records) == (
        len(trace), 0,
    )  # fmt: skip
    assert c.gateway_pd == {"requests:disaggregated": float(len(trace))}
    for records in (c.live_records, c.offline_records):
        assert {r.prefill_worker for r in records} <= {"p0", "p1"}
        assert {r.worker for r in records} <= {"d0", "d1"}
    # Later turns and the shared system prompt hit the prefill workers' caches.
    assert c.offline.hit_rate > 0.4
    assert abs(c.live.hit_rate - c.offline.hit_rate) <= HIT_TOLERANCE, (
        c.live.hit_rate, c.offline.hit_rate,
    )  # fmt: skip
    # Decoding runs at the profile's pace on both sides (live adds only its relay).
    assert c.live.tpot_p50_s == pytest.approx(c.offline.tpot_p50_s, rel=0.5)
