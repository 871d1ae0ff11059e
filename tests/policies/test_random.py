"""random: uniform, and reproducible from its seed."""

from __future__ import annotations

from collections import Counter

import pytest

from policies.base import NoWorkerError
from policies.random_choice import RandomPolicy
from tests.policies.support import request, tokens, view

WORKERS = [view(h) for h in ("a", "b", "c", "d")]


def picks(seed: int, n: int = 400) -> list[str]:
    policy = RandomPolicy(seed=seed)
    return [policy.choose(request(tokens(16, seed=i)), WORKERS, {}).worker for i in range(n)]


def test_same_seed_same_choices_other_seed_other_choices() -> None:
    assert picks(7) == picks(7)
    assert picks(7) != picks(8)


def test_every_worker_gets_a_fair_share() -> None:
    counts = Counter(picks(3))

    assert set(counts) == {"a", "b", "c", "d"}
    # 400 draws, expected 100 each; 60 is more than 4 standard deviations (8.7) away.
    assert min(counts.values()) > 60


def test_the_list_order_does_not_change_the_choice() -> None:
    forward = RandomPolicy(seed=5).choose(request(tokens(16, seed=0)), WORKERS, {})
    backward = RandomPolicy(seed=5).choose(request(tokens(16, seed=0)), WORKERS[::-1], {})

    assert forward.worker == backward.worker
    assert forward.ranked()[0] == forward.worker


def test_no_workers_is_refused() -> None:
    with pytest.raises(NoWorkerError):
        RandomPolicy().choose(request(tokens(16, seed=0)), [], {})
