"""How the Redis index lays its entries out in keys: bucketed hashes.

The layout was chosen by measurement (docs/index.md, kvrouter/tools/index_bench.py)::

    forward   {p}:idx:{G}:f:<F>        hash  field = 8-byte block key (big-endian)
                                             value = 3 bytes per holder: hid << 2 | rank
    reverse   {p}:idx:{G}:r:<hid>:<R>  hash  field = 8-byte block key, value = rank
    cursor    {p}:idx:cur              hash  hid -> "epoch:seq"
    group     {p}:idx:{G}:gc           hash  hid -> "epoch:seq" of the last batch applied
                                             to group G (Redis Cluster only)
    counters  {p}:idx:{G}:n            hash  medium rank -> entries (summed over all G)

``F``, ``R`` and ``G`` are the top ``key_bits``, ``host_bits`` and
``group_bits`` bits of the block key: ``F`` and ``R`` as raw big-endian
bytes, ``G`` in base 64 (:meth:`IndexLayout.group_tag`). A group is a prefix of both
bucket ids, so a key's forward entry and every host's reverse entry for it
share the hash tag ``{G}``: one slot, one node. Buckets stay small enough
for Redis' compact listpack encoding on a default configuration
(``hash-max-listpack-entries 128``, ``hash-max-listpack-value 64``) when
the bits match the expected scale (:meth:`IndexLayout.sized_for`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from redis.crc import key_slot

from indexer.index.base import InvalidKeyError
from indexer.wire import Keyspace

__all__ = [
    "IndexLayout",
    "StaleIncarnationError",
    "cursor_text",
    "pack_keys",
    "parse_cursor",
    "unpack_holders",
]
#: Target fields per bucket when sizing: well under the listpack limit of 128.
_TARGET_FILL = 64


class StaleIncarnationError(Exception):
    """Redis no longer holds the index this client knew (restart or reset): retry afresh."""


def cursor_text(epoch: int, seq: int) -> str:
    """A cursor as stored in Redis: ``"epoch:seq"`` in decimal (exact, never a double)."""
    return f"{epoch}:{seq}"


def parse_cursor(raw: bytes | str | None) -> tuple[int, int] | None:
    """Inverse of :func:`cursor_text` (None stays None)."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    epoch, seq = text.split(":")
    return int(epoch), int(seq)


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as concatenated 8-byte big-endian strings, the scripts' argument format.

    Lua numbers are doubles, so u64 keys never reach Lua as numbers; one
    argument for all keys also spares the client and Redis one argument
    object per key.

    Raises:
        InvalidKeyError: a key is negative, above 2**64 - 1 or not an integer.
    """
    try:
        return struct.pack(f">{len(keys)}Q", *keys)
    except (struct.error, TypeError) as exc:
        raise InvalidKeyError(f"block keys must be integers in [0, 2**64): {exc}") from None


def unpack_holders(value: bytes) -> dict[int, int]:
    """Decode a forward value into ``{host_id: medium rank}``."""
    out: dict[int, int] = {}
    for i in range(0, len(value) - 2, 3):
        v = (value[i] << 16) | (value[i + 1] << 8) | value[i + 2]
        out[v >> 2] = v & 3
    return out


@dataclass(frozen=True, slots=True)
class IndexLayout:
    """Bucket sizes of the Redis index (all clients of one index must agree).

    Attributes:
        key_bits: Forward buckets are ``2**key_bits``; aim for <= ~64 distinct
            blocks per bucket (``blocks / 2**key_bits``).
        host_bits: Reverse buckets per host are ``2**host_bits``; aim for <= ~64
            of a host's blocks per bucket.
        group_bits: Hash-tag groups are ``2**group_bits``; on Redis Cluster they
            spread the index over slots (use >= 8 so nodes get even shares).
    """

    key_bits: int = 16
    host_bits: int = 12
    group_bits: int = 8

    def __post_init__(self) -> None:
        for name in ("key_bits", "host_bits", "group_bits"):
            bits = getattr(self, name)
            if not isinstance(bits, int) or not 0 <= bits <= 24:
                raise ValueError(f"{name} must be an integer in [0, 24], got {bits!r}")
        if self.group_bits > min(self.key_bits, self.host_bits):
            raise ValueError("group_bits must not exceed key_bits or host_bits")

    @classmethod
    def sized_for(cls, blocks: int, blocks_per_host: int, *, group_bits: int = 8) -> IndexLayout:
        """The layout whose buckets hold about 64 entries at the given scale.

        Args:
            blocks: Expected distinct block keys in the index.
            blocks_per_host: Expected blocks held by the largest host.
            group_bits: Hash-tag groups (see the class docstring).
        """

        def bits(n: int) -> int:
            return max(group_bits, min(24, math.ceil(math.log2(max(1, n) / _TARGET_FILL))))

        return cls(bits(blocks), bits(blocks_per_host), group_bits)

    @property
    def tag(self) -> str:
        """Identifies the layout in Redis so that mismatched clients are refused."""
        return f"v1:k{self.key_bits}:h{self.host_bits}:g{self.group_bits}"

    @property
    def groups(self) -> int:
        """Number of hash-tag groups."""
        return 1 << self.group_bits

    def group_of(self, key: int) -> int:
        """Group of a block key (its top ``group_bits`` bits)."""
        return key >> (64 - self.group_bits)

    def script_config(self, keyspace: Keyspace) -> list[str]:
        """The leading ARGV every Lua script of the index takes."""
        return [keyspace.index(""), str(self.key_bits), str(self.host_bits), str(self.group_bits)]

    def group_tag(self, group: int) -> str:
        """The hash tag of a group: base 64, least significant digit first, digits '0'..'o'.

        Never a brace, so Redis hashes exactly the tag; the scripts build the same
        (``tag`` in common.lua).
        """
        digits = max(1, math.ceil(self.group_bits / 6))
        return "".join(chr(48 + ((group >> (6 * i)) & 63)) for i in range(digits))

    def group_key(self, keyspace: Keyspace, group: int, kind: str) -> str:
        """A per-group key: ``gc`` (group cursors) or ``n`` (counters)."""
        return keyspace.index(f"{{{self.group_tag(group)}}}:{kind}")

    def group_slots(self) -> list[int]:
        """Redis Cluster slot of every group, indexed by group."""
        return [key_slot(self.group_tag(g).encode()) for g in range(self.groups)]
