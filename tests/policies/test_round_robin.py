"""round_robin: cycles through the workers whatever order they are listed in."""

from __future__ import annotations

import random

import pytest

from policies.base import NoWorkerError
from policies.round_robin import RoundRobinPolicy
from tests.policies.support import match, request, tokens, view


def test_cycles_in_host_order_whatever_the_list_order() -> None:
    policy = RoundRobinPolicy()
    workers = [view("c"), view("a"), view("b")]
    shuffler = random.Random(1)
    chosen = []
    for i in range(7):
        shuffler.shuffle(workers)
        chosen.append(policy.choose(request(tokens(32, seed=i)), workers, {}).worker)

    assert chosen == ["a", "b", "c", "a", "b", "c", "a"]


def test_ranked_gives_the_next_turns_in_order_and_reports_the_match() -> None:
    policy = RoundRobinPolicy()
    workers = [view("a"), view("b"), view("c")]
    policy.choose(request(tokens(32, seed=0)), workers, {})

    decision = policy.choose(request(tokens(32, seed=1)), workers, {"b": match("b", hbm=2)})

    assert decision.ranked() == ["b", "c", "a"]
    assert decision.matched_blocks == 2


def test_no_workers_is_refused() -> None:
    with pytest.raises(NoWorkerError):
        RoundRobinPolicy().choose(request(tokens(32, seed=0)), [], {})
