"""The KV event schema and its msgpack codec.

Contract (DESIGN.md, "Events"): a worker publishes *batches*
``{host, epoch, seq, ts, events}``. ``epoch`` is random per worker start
(a restart is detected by a new epoch), ``seq`` is +1 per batch within an
epoch. Event kinds:

* ``stored{keys, parent, token_ids?, medium}`` -- consecutive blocks of one
  chain now sit on ``medium``; ``parent`` is the key just before
  ``keys[0]`` (the root parent for a sequence's first block; None when the
  engine did not say, e.g. a foreign engine).
* ``removed{keys, medium}`` -- these blocks left ``medium``.
* ``cleared{}`` -- the host dropped its whole cache.

Demotion is ``removed`` on the old medium plus ``stored`` on the new one;
promotion likewise in the other direction.

A :class:`Snapshot` is the host's full block set per medium, sent in-band
in the same stream when the indexer asks for one (or after a resync);
``seq`` is the seq of the last batch whose effects it includes, so that
later batches apply on top of it and earlier ones are dropped.

Everything on the wire is msgpack (msgspec structs tagged by ``type``).
Any malformed, truncated or out-of-range payload raises
:class:`EventDecodeError` and nothing else.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

from indexer.media import Medium

__all__ = [
    "AllCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventDecodeError",
    "Snapshot",
    "StreamMessage",
    "decode_batch",
    "decode_message",
    "encode_message",
]

# msgpack cannot carry integers above 2**64 - 1, so a lower bound makes a key a u64.
BlockKey = Annotated[int, msgspec.Meta(ge=0)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
HostName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class EventDecodeError(ValueError):
    """A payload is not a valid event batch or snapshot (malformed, truncated, out of range)."""


class BlockStored(msgspec.Struct, tag="stored", frozen=True, omit_defaults=True):
    """Blocks ``keys`` (one chain, in order) are now held on ``medium``."""

    keys: list[BlockKey]
    parent: BlockKey | None
    medium: Medium
    token_ids: list[TokenId] | None = None


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks ``keys`` are no longer held on ``medium``."""

    keys: list[BlockKey]
    medium: Medium


class AllCleared(msgspec.Struct, tag="cleared", frozen=True):
    """The host dropped every block on every medium."""


Event = BlockStored | BlockRemoved | AllCleared


class EventBatch(msgspec.Struct, tag="batch", frozen=True):
    """One published batch of a host's events, in the order they happened."""

    host: HostName
    epoch: Epoch
    seq: Seq
    ts: float
    events: list[Event]


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """A host's full block set per medium, as of batch ``seq`` of ``epoch``."""

    host: HostName
    epoch: Epoch
    seq: Seq
    ts: float
    blocks: dict[Medium, list[BlockKey]]


StreamMessage = EventBatch | Snapshot

_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(StreamMessage)
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_message(message: EventBatch | Snapshot) -> bytes:
    """Encode a batch or snapshot to msgpack bytes."""
    return _encoder.encode(message)


_T = TypeVar("_T")


def _decode(decoder: msgspec.msgpack.Decoder[_T], data: bytes) -> _T:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EventDecodeError(f"payload must be bytes, got {type(data).__name__}")
    try:
        return decoder.decode(data)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise EventDecodeError(f"invalid KV event payload: {exc}") from exc


def decode_message(data: bytes) -> EventBatch | Snapshot:
    """Decode a stream message (a batch or a snapshot); raises EventDecodeError."""
    return _decode(_message_decoder, data)


def decode_batch(data: bytes) -> EventBatch:
    """Decode an event batch; raises EventDecodeError (also for a snapshot)."""
    return _decode(_batch_decoder, data)
