"""sglang_cache_aware: history-tree affinity above the threshold, balance thresholds, eviction."""

from __future__ import annotations

import pytest

from policies.base import NoWorkerError
from policies.history_tree import HistoryTree
from policies.sglang_cache_aware import SglangCacheAwarePolicy
from tests.policies.support import request, tokens, view

WORKERS = [view("a"), view("b"), view("c")]


def test_match_above_threshold_follows_history_below_it_goes_to_the_smallest_tree() -> None:
    policy = SglangCacheAwarePolicy()
    doc = tokens(1024, seed=1)
    first = policy.choose(request(doc, now=0.0), WORKERS, {})
    other = policy.choose(request(tokens(512, seed=2), now=0.1), WORKERS, {})
    # 25% of this prompt was routed before: below 0.5, so the emptiest history wins.
    quarter = policy.choose(request(doc[:256] + tokens(768, seed=3), now=0.2), WORKERS, {})
    # 75% of this one was: above 0.5, so it follows the history.
    most = policy.choose(request(doc[:768] + tokens(256, seed=4), now=0.3), WORKERS, {})

    assert (first.worker, other.worker, quarter.worker) == ("a", "b", "c")
    assert most.worker == "a"
    assert most.scores["a"]["matched_blocks"] == 48
    assert most.ranked()[0] == "a"


def test_imbalanced_load_overrides_cache_affinity() -> None:
    prompt = tokens(1024, seed=5)
    policy = SglangCacheAwarePolicy()
    policy.choose(request(prompt, now=0.0), WORKERS, {})

    within = [view("a", in_flight=40), view("b", in_flight=10), view("c", in_flight=12)]
    beyond = [view("a", in_flight=43), view("b", in_flight=10), view("c", in_flight=12)]

    # 40 - 10 = 30 is within balance_abs_threshold 32: the cache hit on "a" wins.
    assert policy.choose(request(prompt, now=1.0), within, {}).worker == "a"
    # 43 - 10 = 33 exceeds it (and 43 > 10 * 1.0001): the least loaded wins.
    assert policy.choose(request(prompt, now=2.0), beyond, {}).worker == "b"


def test_relative_threshold_must_also_be_exceeded() -> None:
    policy = SglangCacheAwarePolicy(balance_abs_threshold=5, balance_rel_threshold=2.0)
    prompt = tokens(1024, seed=6)
    policy.choose(request(prompt, now=0.0), [view("a"), view("b")], {})

    # 30 - 20 = 10 > 5 but 30 < 2 * 20: still balanced, the history wins.
    balanced = policy.choose(
        request(prompt, now=1.0), [view("a", in_flight=30), view("b", in_flight=20)], {}
    )
    skewed = policy.choose(
        request(prompt, now=2.0), [view("a", in_flight=41), view("b", in_flight=20)], {}
    )

    assert balanced.worker == "a"
    assert skewed.worker == "b"


def test_history_is_evicted_to_max_tree_size_after_the_interval() -> None:
    policy = SglangCacheAwarePolicy(max_tree_size=40, eviction_interval_s=10.0)
    only = [view("w")]
    prompts = [tokens(256, seed=100 + i) for i in range(6)]
    for i, prompt in enumerate(prompts):
        policy.choose(request(prompt, now=float(i)), only, {})
    assert policy.tree.size("w") == 6 * 16

    policy.choose(request(tokens(16, seed=99), now=20.0), only, {})

    # Cut back to 40 blocks, then the new one-block request is recorded.
    assert policy.tree.size("w") == 40 + 1
    newest, _ = policy.tree.match(request(prompts[-1]).block_keys, ["w"])
    oldest, _ = policy.tree.match(request(prompts[0]).block_keys, ["w"])
    assert newest == 16
    assert oldest == 0


def test_tree_eviction_removes_leaves_before_their_parents() -> None:
    tree = HistoryTree()
    trunk = list(range(1, 11))
    branch = [*trunk[:3], 104, 105, 106]
    tree.insert(trunk, "w", now=0.0)
    tree.insert(branch, "w", now=1.0)

    tree.evict(5)

    assert tree.size("w") == 5
    assert tree.match(trunk, ["w"]) == (3, ["w"])
    assert tree.match(branch, ["w"]) == (5, ["w"])


def test_tree_match_prefers_the_most_recent_holder_among_allowed_tenants() -> None:
    tree = HistoryTree()
    chain = [1, 2, 3]
    tree.insert(chain, "x", now=0.0)
    tree.insert(chain, "y", now=5.0)

    assert tree.match(chain, ["x", "y"]) == (3, ["y", "x"])
    assert tree.match(chain, ["x"]) == (3, ["x"])
    assert tree.match(chain, ["z"]) == (0, [])
    tree.remove_tenant("y")
    assert tree.match(chain, ["x", "y"]) == (3, ["x"])


def test_bad_options_and_no_workers_are_refused() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        SglangCacheAwarePolicy(cache_threshold=1.5)
    with pytest.raises(NoWorkerError):
        SglangCacheAwarePolicy().choose(request(tokens(16, seed=0)), [], {})
