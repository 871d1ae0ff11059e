"""power_of_two: two random candidates, the less loaded wins."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.base import NoWorkerError
from policies.power_of_two import PowerOfTwoPolicy
from tests.policies.support import request, tokens, view

WORKERS = [view("idle", in_flight=0), view("some", in_flight=4), view("busy", in_flight=9)]


def picks(seed: int, n: int = 200) -> list[str]:
    policy = PowerOfTwoPolicy(seed=seed)
    return [policy.choose(request(tokens(16, seed=i)), WORKERS, {}).worker for i in range(n)]


def test_the_most_loaded_worker_never_wins_and_the_others_do() -> None:
    counts = Counter(picks(1))

    assert "busy" not in counts
    # "some" wins only when the pair is (some, busy): one draw in three.
    assert counts["idle"] > counts["some"] > 0


def test_choices_are_reproducible_from_the_seed() -> None:
    assert picks(4) == picks(4)
    assert picks(4) != picks(5)


def test_a_single_worker_is_always_chosen() -> None:
    decision = PowerOfTwoPolicy().choose(request(tokens(16, seed=0)), [view("only")], {})

    assert decision.worker == "only"
    assert decision.scores["only"]["sampled"] == 1.0


def test_no_workers_is_refused() -> None:
    with pytest.raises(NoWorkerError):
        PowerOfTwoPolicy().choose(request(tokens(16, seed=0)), [], {})
