"""The intrusive LRU free queue: order, O(1) removal from anywhere, and misuse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_worker.block_pool import Block
from engine_worker.free_queue import FreeBlockQueue, FreeQueueError
from indexer.media import Medium


def blocks(n: int) -> list[Block]:
    return [Block(i, Medium.HBM) for i in range(n)]


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_popleft_returns_blocks_in_append_order() -> None:
    bs = blocks(4)
    queue = FreeBlockQueue(bs)
    assert len(queue) == 4
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert len(queue) == 0
    assert queue.head() is None


def test_appendleft_puts_a_block_first() -> None:
    bs = blocks(3)
    queue = FreeBlockQueue(bs[:2])
    queue.appendleft(bs[2])
    assert ids(queue) == [2, 0, 1]
    assert queue.head() is bs[2]


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_remove_from_head_middle_or_tail_keeps_the_rest_in_order(victim: int) -> None:
    bs = blocks(5)
    queue = FreeBlockQueue(bs)
    queue.remove(bs[victim])
    assert ids(queue) == [i for i in range(5) if i != victim]
    assert len(queue) == 4
    assert bs[victim] not in queue
    assert bs[victim].prev_free is None
    assert bs[victim].next_free is None
    queue.append(bs[victim])
    assert ids(queue)[-1] == victim


def test_single_block_is_a_member_and_can_be_removed() -> None:
    (b,) = blocks(1)
    queue = FreeBlockQueue([b])
    assert b in queue
    queue.remove(b)
    assert b not in queue
    assert len(queue) == 0
    queue.appendleft(b)
    assert queue.popleft() is b


def test_misuse_raises_and_leaves_the_queue_intact() -> None:
    bs = blocks(3)
    queue = FreeBlockQueue(bs[:2])
    with pytest.raises(FreeQueueError):
        queue.append(bs[0])
    with pytest.raises(FreeQueueError):
        queue.appendleft(bs[1])
    with pytest.raises(FreeQueueError):
        queue.remove(bs[2])
    other = FreeBlockQueue([Block(9, Medium.HBM), Block(8, Medium.HBM)])
    stranger = other.head()
    assert stranger is not None
    with pytest.raises(FreeQueueError):
        queue.remove(stranger)
    assert ids(queue) == [0, 1]
    assert ids(other) == [9, 8]
    empty = FreeBlockQueue()
    with pytest.raises(FreeQueueError):
        empty.popleft()
    with pytest.raises(FreeQueueError):
        FreeBlockQueue([bs[2], bs[2]])


ops = st.lists(
    st.tuples(st.sampled_from(["append", "appendleft", "popleft", "remove"]), st.integers(0, 7)),
    max_size=60,
)


@given(ops)
def test_random_operations_match_a_plain_list(script: list[tuple[str, int]]) -> None:
    bs = blocks(8)
    queue = FreeBlockQueue()
    model: list[int] = []
    for op, i in script:
        if op == "append" and i not in model:
            queue.append(bs[i])
            model.append(i)
        elif op == "appendleft" and i not in model:
            queue.appendleft(bs[i])
            model.insert(0, i)
        elif op == "popleft" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            queue.remove(bs[i])
            model.remove(i)
        assert ids(queue) == model
        assert len(queue) == len(model)
        assert [b.block_id for b in bs if b in queue] == sorted(model)
