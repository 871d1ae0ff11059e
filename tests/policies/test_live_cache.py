"""The live cache: blocks reused on each worker lately, counted once, forgotten in time."""

from __future__ import annotations

import pytest

from policies.live_cache import LiveCache


def test_reused_blocks_stay_live_for_the_window_after_their_last_reuse() -> None:
    live = LiveCache(window_s=60.0)
    live.touch("w0", [1, 2, 3], now=0.0)
    live.touch("w0", [1, 2], now=30.0)  # a later request reuses the first two again

    assert live.count("w0", now=59.0) == 3
    assert live.count("w0", now=61.0) == 2  # block 3 was last reused at 0 s
    assert live.count("w0", now=91.0) == 0
    assert live.count("w1", now=0.0) == 0  # nothing was reused on w1


def test_blocks_shared_by_many_prefixes_count_once_per_worker() -> None:
    # A system prompt (blocks 1-2) under two sessions: four distinct blocks, not six.
    live = LiveCache()
    live.touch("w0", [1, 2, 10], now=0.0)
    live.touch("w0", [1, 2, 20], now=1.0)
    live.touch("w1", [1, 2], now=1.0)

    assert live.count("w0", now=2.0) == 4
    assert live.count("w1", now=2.0) == 2


def test_an_older_reuse_reported_late_does_not_shorten_a_blocks_life() -> None:
    live = LiveCache(window_s=10.0)
    live.touch("w0", [1], now=5.0)
    live.touch("w0", [1], now=2.0)

    assert live.count("w0", now=14.0) == 1


def test_a_restarted_worker_has_nothing_live() -> None:
    live = LiveCache()
    live.touch("w0", [1, 2, 3], now=0.0, epoch=1)

    assert live.count("w0", now=1.0, epoch=1) == 3
    assert live.count("w0", now=1.0, epoch=2) == 0
    live.touch("w0", [7], now=2.0, epoch=2)
    assert live.count("w0", now=3.0, epoch=2) == 1


def test_a_worker_that_left_is_forgotten_once_its_blocks_expire() -> None:
    live = LiveCache(window_s=10.0)
    live.touch("gone", list(range(1_000)), now=0.0, epoch=3)
    live.touch("w0", [1], now=5.0)

    live.expire(now=9.0)
    assert live.hosts() == {"gone", "w0"}
    live.expire(now=12.0)  # "gone" reused nothing since 0 s; w0 did at 5 s
    assert live.hosts() == {"w0"}
    assert live.count("w0", now=12.0) == 1
    # Back under the same name after a restart: a fresh start, not the old epoch's blocks.
    live.touch("gone", [5], now=13.0, epoch=4)
    assert live.count("gone", now=13.0, epoch=4) == 1


@pytest.mark.parametrize("window", [0.0, -1.0, float("nan")])
def test_a_window_that_is_not_positive_is_refused(window: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        LiveCache(window_s=window)
