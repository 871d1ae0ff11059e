"""Event batches and snapshots survive the wire; anything else raises EventDecodeError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    EventDecodeError,
    Snapshot,
    decode_batch,
    decode_message,
    encode_message,
)
from indexer.media import MEDIA, Medium

u64 = st.integers(min_value=0, max_value=2**64 - 1)
media = st.sampled_from(MEDIA)
stored = st.builds(
    BlockStored,
    keys=st.lists(u64, max_size=8),
    parent=st.none() | u64,
    medium=media,
    token_ids=st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=32),
)
removed = st.builds(BlockRemoved, keys=st.lists(u64, max_size=8), medium=media)
events = st.lists(st.one_of(stored, removed, st.just(AllCleared())), max_size=10)
batches = st.builds(
    EventBatch,
    host=st.text(min_size=1, max_size=20),
    epoch=st.integers(0, 2**63 - 1),
    seq=st.integers(0, 2**63 - 1),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=events,
)


@given(batches)
def test_batch_round_trip(batch: EventBatch) -> None:
    data = encode_message(batch)
    assert decode_batch(data) == batch
    assert decode_message(data) == batch


@given(st.dictionaries(media, st.lists(u64, max_size=5)), st.integers(0, 2**63 - 1))
def test_snapshot_round_trip(blocks: dict[Medium, list[int]], seq: int) -> None:
    snap = Snapshot(host="w0", epoch=7, seq=seq, ts=1.0, blocks=blocks)
    assert decode_message(encode_message(snap)) == snap


def test_wire_format_is_plain_tagged_msgpack() -> None:
    batch = EventBatch(
        host="w0",
        epoch=1,
        seq=2,
        ts=3.0,
        events=[
            BlockStored(keys=[2**64 - 1], parent=5, medium=Medium.DRAM),
            BlockRemoved(keys=[1], medium=Medium.HBM),
            AllCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(encode_message(batch))
    assert raw == {
        "type": "batch",
        "host": "w0",
        "epoch": 1,
        "seq": 2,
        "ts": 3.0,
        "events": [
            {"type": "stored", "keys": [2**64 - 1], "parent": 5, "medium": "dram"},
            {"type": "removed", "keys": [1], "medium": "hbm"},
            {"type": "cleared"},
        ],
    }


@given(batches, st.data())
def test_truncated_payloads_raise_one_error_type(batch: EventBatch, data: st.DataObject) -> None:
    payload = encode_message(batch)
    cut = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    with pytest.raises(EventDecodeError):
        decode_message(payload[:cut])


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_event_decode_error(payload: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_message(payload)


BAD: list[object] = [
    {"type": "batch", "host": "", "epoch": 0, "seq": 0, "ts": 0.0, "events": []},
    {"type": "batch", "host": "h", "epoch": -1, "seq": 0, "ts": 0.0, "events": []},
    {"type": "batch", "host": "h", "epoch": 0, "seq": 0, "ts": 0.0, "events": [{"type": "x"}]},
    {
        "type": "batch",
        "host": "h",
        "epoch": 0,
        "seq": 0,
        "ts": 0.0,
        "events": [{"type": "stored", "keys": [-3], "parent": None, "medium": "hbm"}],
    },
    {
        "type": "batch",
        "host": "h",
        "epoch": 0,
        "seq": 0,
        "ts": 0.0,
        "events": [{"type": "removed", "keys": [1], "medium": "tape"}],
    },
    {"type": "snapshot", "host": "h", "epoch": 0, "seq": 0, "ts": 0.0},
    [1, 2, 3],
    "batch",
]


@pytest.mark.parametrize("obj", BAD)
def test_schema_violations_raise_event_decode_error(obj: object) -> None:
    with pytest.raises(EventDecodeError):
        decode_message(msgspec.msgpack.encode(obj))


def test_decode_batch_refuses_a_snapshot() -> None:
    snap = Snapshot(host="h", epoch=0, seq=0, ts=0.0, blocks={})
    with pytest.raises(EventDecodeError):
        decode_batch(encode_message(snap))


def test_non_bytes_payload_raises_event_decode_error() -> None:
    with pytest.raises(EventDecodeError):
        decode_message("not bytes")  # type: ignore[arg-type]


def test_event_union_is_closed() -> None:
    kinds: set[type[Event]] = {BlockStored, BlockRemoved, AllCleared}
    assert {
        type(e) for e in [BlockStored([], None, Medium.HBM), BlockRemoved([], Medium.SSD)]
    } <= kinds
