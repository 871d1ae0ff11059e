"""dynamo_cost: overlap credit by tier against prefill and decode load, in blocks."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.base import NoWorkerError
from policies.dynamo_cost import DynamoCostPolicy
from tests.policies.support import match, request, tokens, view

PROMPT = request(tokens(1024, seed=1))  # 64 blocks


def test_host_and_disk_hits_earn_less_credit_than_device_hits() -> None:
    workers = [view("hbm"), view("dram"), view("ssd")]
    matches = {
        "hbm": match("hbm", hbm=64),
        "dram": match("dram", dram=64),
        "ssd": match("ssd", ssd=64),
    }

    decision = DynamoCostPolicy().choose(PROMPT, workers, matches)

    # Credits 64, 0.75*64 = 48, 0.25*64 = 16 against 64 prompt blocks; decode adds 64.
    totals = {h: decision.scores[h]["total"] for h in ("hbm", "dram", "ssd")}
    assert totals == pytest.approx({"hbm": 64.0, "dram": 80.0, "ssd": 112.0})
    assert decision.ranked() == ["hbm", "dram", "ssd"]


def test_decode_load_outweighs_a_full_hit_on_a_busy_worker() -> None:
    busy_hit = view("busy", in_flight=3)
    cold = view("cold")

    decision = DynamoCostPolicy().choose(PROMPT, [busy_hit, cold], {"busy": match("busy", hbm=64)})

    # busy: prefill max(0, 64 - 64) = 0, decode (3 + 1) * 64; cold: prefill 64 + decode 64.
    assert decision.scores["busy"]["total"] == pytest.approx(256.0)
    assert decision.scores["cold"]["total"] == pytest.approx(128.0)
    assert decision.worker == "cold"


def test_queued_prefill_counts_against_the_credit() -> None:
    decision = DynamoCostPolicy().choose(
        PROMPT, [view("hit", queued=2048), view("cold")], {"hit": match("hit", hbm=64)}
    )

    # hit: (2048 + 1024) / 16 - 64 = 128 prefill blocks + 64 decode; cold: 64 + 64.
    assert decision.scores["hit"]["prefill_blocks"] == pytest.approx(128.0)
    assert decision.worker == "cold"


def test_temperature_samples_costlier_workers_sometimes_and_reproducibly() -> None:
    workers = [view("hit"), view("cold")]
    matches = {"hit": match("hit", hbm=64)}

    def run(temperature: float, seed: int) -> list[str]:
        policy = DynamoCostPolicy(temperature=temperature, seed=seed)
        return [policy.choose(PROMPT, workers, matches).worker for _ in range(300)]

    greedy = Counter(run(0.0, 1))
    warm = Counter(run(1.0, 1))

    assert greedy == Counter({"hit": 300})
    # p(cold) = e^-1 / (1 + e^-1) = 0.27: about 80 of 300.
    assert 40 < warm["cold"] < 120
    assert run(1.0, 1) == run(1.0, 1)


def test_bad_options_and_no_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        DynamoCostPolicy(temperature=-0.1)
    with pytest.raises(NoWorkerError):
        DynamoCostPolicy().choose(PROMPT, [], {})
