"""Speculative state: the binary-searched prefix stays exact whatever the routing history."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.keys import block_keys
from policies.speculation import Speculation
from tests.policies.support import BLOCK, ROOT, match, view

# Prompts made of 1-4 "sentences" from a small vocabulary share many prefixes.
SENTENCES = [[s * 100 + i for i in range(BLOCK)] for s in range(4)]


def chain(parts: list[int]) -> list[int]:
    return block_keys([t for p in parts for t in SENTENCES[p]], BLOCK, ROOT)


def leading_members(spec: Speculation, host: str, keys: list[int]) -> int:
    """The held prefix found one key at a time (a one-key probe is a membership test)."""
    n = 0
    while n < len(keys) and spec.prefix_blocks(host, [keys[n]]) == 1:
        n += 1
    return n


ops = st.lists(
    st.tuples(
        st.sampled_from(["h1", "h2"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=4),
        st.floats(0, 10),
        st.floats(0, 5),
    ),
    min_size=1,
    max_size=30,
)
probes = st.lists(st.integers(0, 3), min_size=1, max_size=4)


History = list[tuple[str, list[int], float, float]]


def replay(history: History) -> Speculation:
    """Record each (host, prompt, time, predicted wait): entries last wait + 2 s."""
    spec = Speculation(ttl_s=2.0)
    for host, parts, now, pending in history:
        spec.expire(now)
        spec.record(host, chain(parts), new_tokens=BLOCK, now=now, pending_s=pending)
    return spec


@settings(max_examples=150, deadline=None)
@given(history=ops, probe=probes)
def test_binary_search_agrees_with_a_key_by_key_walk_even_if_the_clock_steps_back(
    history: History, probe: list[int]
) -> None:
    spec = replay(history)
    keys = chain(probe)

    for host in ("h1", "h2"):
        assert spec.prefix_blocks(host, keys) == leading_members(spec, host, keys)


@settings(max_examples=150, deadline=None)
@given(history=ops, probe=probes)
def test_with_a_steady_clock_exactly_the_unexpired_chains_are_held(
    history: History, probe: list[int]
) -> None:
    # Entries last different times (each request's predicted wait plus the TTL), so one
    # routed later may expire earlier: still exactly the live ones are held.
    history = sorted(history, key=lambda op: op[2])
    now = history[-1][2]
    spec = replay(history)
    keys = chain(probe)

    for host in ("h1", "h2"):
        alive = {
            key
            for h, parts, when, pending in history
            if h == host and when + pending + 2.0 > now
            for key in chain(parts)
        }
        expected = 0
        while expected < len(keys) and keys[expected] in alive:
            expected += 1
        assert spec.prefix_blocks(host, keys) == expected


def test_merge_counts_the_speculative_prefix_on_hbm_and_keeps_slow_tails() -> None:
    spec = Speculation()
    keys = chain([0, 1, 2, 3])
    spec.record("w", keys[:2], new_tokens=32, now=0.0)

    merged = spec.merge("w", keys, match("w", hbm=1, dram=1, ssd=2))

    assert merged == match("w", hbm=2, dram=0, ssd=2)
    assert spec.merge("w", keys, None) == match("w", hbm=2)
    assert spec.merge("other", keys, None) is None


def test_pending_load_counts_until_a_newer_view_or_the_ttl() -> None:
    spec = Speculation(ttl_s=2.0, catchup_s=0.1)
    spec.record("w", [], new_tokens=500, now=1.0)
    spec.record("w", [], new_tokens=300, now=1.5)

    assert spec.pending(view("w", ts=0.9), now=1.6) == (800, 2)
    assert spec.pending(view("w", ts=1.2), now=1.6) == (300, 1)
    spec.expire(3.6)
    assert spec.pending(view("w", ts=0.0), now=3.6) == (0, 0)
