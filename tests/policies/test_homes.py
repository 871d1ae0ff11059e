"""Homes: where prompts nobody held were placed, which came back, and how likely that is."""

from __future__ import annotations

import pytest

from policies.homes import HomeDemand


def test_a_request_with_the_homes_key_at_its_position_returns_to_it() -> None:
    homes = HomeDemand(window_s=60.0)
    first = [1, 2, 3, 4]  # a system prompt every worker held (1-2), then new blocks
    homes.place("w0", first, 2, now=0.0)

    assert homes.observe([1, 2, 9], now=1.0) == []  # shares the system prompt only
    assert homes.observe([3, 1, 2], now=1.0) == []  # the key, at another position
    assert homes.returns == 0
    assert homes.observe([*first, 5, 6], now=2.0) == [3]
    assert homes.observe([*first, 7], now=3.0) == [3]
    assert homes.returns == 1  # a home is returned to once, however often it is used
    assert homes.demand("w0", now=3.0) == 1.0


def test_homes_nobody_came_back_to_expire_as_misses_and_teach_the_return_rate() -> None:
    homes = HomeDemand(window_s=60.0, prior_returns=1.0)
    for i, host in enumerate(("w0", "w1", "w2")):
        homes.place(host, [100 + i, 200 + i], 1, now=0.0)
    assert homes.return_probability(now=0.0) == 1.0  # nothing known: taken to come back
    assert homes.demand("w0", now=0.0) == 1.0

    assert homes.observe([101, 201, 7], now=10.0) == [201]
    # Two homes waited 10 s of 60 without a return: a third of a miss between them.
    assert homes.return_probability(now=10.0) == pytest.approx(2 / (2 + 1 / 3))
    homes.observe([], now=61.0)  # w0's and w2's homes expire unused; w1's was used at 10 s

    assert (homes.returns, homes.misses, len(homes)) == (1, 2, 1)
    assert homes.return_probability(now=61.0) == pytest.approx(2 / 4)
    demands = [homes.demand(h, now=61.0) for h in ("w0", "w1", "w2")]
    assert demands == [0.0, 1.0, 0.0]
    homes.place("w3", [300, 400], 1, now=61.0)
    assert homes.demand("w3", now=61.0) == pytest.approx(0.5)  # pending, weighed by the rate

    homes.observe([], now=70.0)  # w1's home, last used at 10 s, goes: not a miss
    assert (homes.returns, homes.misses, len(homes)) == (1, 2, 1)
    assert homes.demand("w1", now=70.0) == 0.0


def test_one_off_prompts_teach_the_return_rate_within_seconds() -> None:
    # Ten new documents a second, none ever returned to: waiting homes count as partial
    # misses, so the probability falls long before the first one expires.
    homes = HomeDemand(window_s=60.0)
    for i in range(100):
        homes.place("w0", [i], 0, now=i / 10)
        homes.observe([10_000 + i], now=i / 10)

    assert homes.misses == 0
    assert homes.return_probability(now=10.0) < 0.11
    assert homes.return_probability(now=12.0) < 0.1


def test_a_home_follows_the_worker_its_returns_were_sent_to() -> None:
    homes = HomeDemand()
    homes.place("w0", [1, 2], 0, now=0.0)

    homes.follow(homes.observe([1, 2, 3], now=1.0), "w1")

    assert homes.demand("w0", now=1.0) == 0.0
    assert homes.demand("w1", now=1.0) == 1.0


def test_positions_past_the_prompt_and_known_homes_are_not_placed_again() -> None:
    homes = HomeDemand()
    homes.place("w0", [1, 2], 2, now=0.0)
    homes.place("w0", [1, 2], -1, now=0.0)
    assert len(homes) == 0

    homes.place("w0", [1, 2], 1, now=0.0)
    homes.place("w1", [1, 2], 1, now=1.0)  # the same block is already w0's home
    assert len(homes) == 1
    assert homes.demand("w1", now=1.0) == 0.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        HomeDemand(window_s=0)
    with pytest.raises(ValueError, match="prior_returns"):
        HomeDemand(prior_returns=-1)


def test_homes_waiting_for_a_return_hold_their_blocks_until_it_comes_or_they_expire() -> None:
    homes = HomeDemand(window_s=60.0)
    homes.place("w0", list(range(10)), 2, now=0.0)  # blocks 2-9 were new: 8 blocks
    homes.place("w1", list(range(100, 105)), 0, now=0.0)

    assert homes.return_probability(now=0.0) == 1.0
    assert homes.pending_blocks("w0", now=0.0) == 8.0
    assert homes.pending_blocks("w1", now=0.0) == 5.0
    # Weighed by the probability that they come back, which falls as they wait.
    p = homes.return_probability(now=30.0)
    assert 0 < p < 1
    assert homes.pending_blocks("w0", now=30.0) == pytest.approx(8 * p)
    # A home moved before its first return takes its blocks along.
    homes.follow([100], "w0")
    assert homes.pending_blocks("w0", now=0.0) == 13.0
    assert homes.pending_blocks("w1", now=0.0) == 0.0
    # Returned to: its blocks are the reusing request's (the live cache's), not pending.
    assert homes.observe(list(range(12)), now=10.0) == [2]
    assert homes.pending_blocks("w0", now=10.0) == pytest.approx(5 * homes.return_probability(10.0))
    # Expired without a return: nothing held any more.
    homes.expire(now=61.0)
    assert homes.pending_blocks("w0", now=61.0) == 0.0
