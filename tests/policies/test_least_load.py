"""least_load: fewest in flight, then fewest queued tokens, then host name."""

from __future__ import annotations

import pytest

from policies.base import NoWorkerError
from policies.least_load import LeastLoadPolicy
from tests.policies.support import match, request, tokens, view

PROMPT = request(tokens(64, seed=0))


def test_fewest_in_flight_wins_even_against_a_cache_hit() -> None:
    decision = LeastLoadPolicy().choose(
        PROMPT, [view("hot", in_flight=5), view("cold", in_flight=2)], {"hot": match("hot", 4)}
    )

    assert decision.worker == "cold"
    assert decision.matched_blocks == 0


def test_ties_go_to_the_shorter_queue_then_the_host_name() -> None:
    policy = LeastLoadPolicy()

    by_queue = policy.choose(
        PROMPT, [view("a", in_flight=2, queued=900), view("b", in_flight=2, queued=100)], {}
    )
    by_name = policy.choose(PROMPT, [view("b", in_flight=2), view("a", in_flight=2)], {})

    assert by_queue.worker == "b"
    assert by_name.worker == "a"


def test_ranked_orders_by_in_flight_then_queue() -> None:
    workers = [
        view("a", in_flight=3),
        view("b", in_flight=1, queued=5000),
        view("c", in_flight=1, queued=10),
        view("d", in_flight=0),
    ]

    assert LeastLoadPolicy().choose(PROMPT, workers, {}).ranked() == ["d", "c", "b", "a"]


def test_no_workers_is_refused() -> None:
    with pytest.raises(NoWorkerError):
        LeastLoadPolicy().choose(PROMPT, [], {})
