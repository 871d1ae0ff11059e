"""Block keys follow DESIGN.md's contract, checked against independent golden vectors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.keys import BlockKeyError, block_keys, hash_block, num_full_blocks, root_parent

GOLDEN = json.loads((Path(__file__).parent.parent / "data" / "block_keys.json").read_text())
CASES: list[dict[str, Any]] = GOLDEN["cases"]

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_sizes = st.integers(min_value=1, max_value=32)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['model']}-{i}" for i, c in enumerate(CASES)])
def test_golden_vectors(case: dict[str, Any]) -> None:
    root = root_parent(case["model"], case["lora_name"], case["cache_salt"])
    assert root == case["root_parent"]
    assert block_keys(case["token_ids"], case["block_size"], root) == case["keys"]


def test_golden_covers_salts_loras_and_extreme_tokens() -> None:
    assert any(c["lora_name"] for c in CASES)
    assert any(c["cache_salt"] for c in CASES)
    assert any(2**32 - 1 in c["token_ids"] for c in CASES)


@given(tokens, block_sizes)
def test_partial_blocks_get_no_key(ids: list[int], bs: int) -> None:
    keys = block_keys(ids, bs, root_parent("m"))
    assert len(keys) == len(ids) // bs == num_full_blocks(len(ids), bs)


@given(tokens, tokens, block_sizes)
def test_equal_prefixes_give_equal_keys(prefix: list[int], tail: list[int], bs: int) -> None:
    root = root_parent("m")
    a = block_keys(prefix + tail, bs, root)
    b = block_keys(prefix, bs, root)
    assert a[: len(b)] == b


@given(tokens.filter(lambda t: len(t) >= 1), block_sizes, st.data())
def test_a_token_change_changes_its_block_and_every_later_one(
    ids: list[int], bs: int, data: st.DataObject
) -> None:
    root = root_parent("m")
    keys = block_keys(ids, bs, root)
    pos = data.draw(st.integers(min_value=0, max_value=len(ids) - 1))
    changed = list(ids)
    changed[pos] = (changed[pos] + 1) % 2**32
    new = block_keys(changed, bs, root)
    first = pos // bs
    assert new[:first] == keys[:first]
    for old_key, new_key in zip(keys[first:], new[first:], strict=True):
        assert old_key != new_key


@given(tokens, block_sizes, st.data())
def test_chain_can_be_extended_from_any_block(ids: list[int], bs: int, data: st.DataObject) -> None:
    root = root_parent("m")
    keys = block_keys(ids, bs, root)
    split = data.draw(st.integers(min_value=0, max_value=len(keys)))
    parent = keys[split - 1] if split else root
    assert keys[:split] + block_keys(ids[split * bs :], bs, parent) == keys
    if keys:
        assert hash_block(root, ids[:bs]) == keys[0]


def test_model_lora_and_salt_separate_caches() -> None:
    ids = list(range(32))
    roots = {root_parent("a"), root_parent("b"), root_parent("a", "l"), root_parent("a", "", "s")}
    assert len(roots) == 4
    assert len({block_keys(ids, 16, r)[0] for r in roots}) == 4


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["x"]])
def test_tokens_out_of_u32_range_are_refused(bad: list[Any]) -> None:
    with pytest.raises(BlockKeyError):
        block_keys([0] * 15 + bad, 16, root_parent("m"))


@pytest.mark.parametrize("bs", [0, -4])
def test_bad_block_size_is_refused(bs: int) -> None:
    with pytest.raises(BlockKeyError):
        block_keys([1, 2, 3], bs, root_parent("m"))


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_bad_parent_is_refused(parent: int) -> None:
    with pytest.raises(BlockKeyError):
        block_keys([0] * 16, 16, parent)
