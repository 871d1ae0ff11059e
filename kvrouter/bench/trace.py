"""Request traces in Mooncake's public format, and their replay into token ids.

Format (Mooncake, FAST'25 trace release): one JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds, ``input_length`` / ``output_length``
are token counts, and each hash id stands for one 512-token block of the prompt,
prefix-chained: two requests whose ``hash_ids`` agree on their first ``k``
entries share their first ``k * 512`` prompt tokens.

Replay turns hash id ``h`` into 512 token ids: token ``j`` of block ``h`` is the
``j``-th output of SplitMix64 seeded with ``h`` (Steele, Lea and Flood, OOPSLA
2014; Vigna's reference constants), modulo the vocabulary size. That depends on
nothing but ``h`` and ``j`` (never on Python's salted ``hash``), so every
process, the simulator and a live replay alike, sees the same tokens. Blocks are
concatenated and truncated to ``input_length``; a prompt longer than
``len(hash_ids) * 512`` continues the last id's stream (``j >= 512``).

Time scale: ``scale`` multiplies the arrival *rate*. Replayed arrival times are
``(timestamp - first timestamp) / 1000 / scale`` seconds, so ``scale=2`` replays
the trace twice as fast (twice the load) and ``scale=0.5`` at half the load.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from indexer.keys import block_keys

__all__ = [
    "HASH_BLOCK_TOKENS",
    "PromptFactory",
    "TraceError",
    "TraceRecord",
    "arrival_times",
    "block_tokens",
    "read_trace",
    "write_trace",
]

#: Tokens one hash id stands for in Mooncake's traces.
HASH_BLOCK_TOKENS = 512

_U64_MAX = 2**64 - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)

# msgspec decodes integers up to 2**64 - 1 only, so a lower bound makes an id a u64.
HashId = Annotated[int, msgspec.Meta(ge=0)]


class TraceError(ValueError):
    """A trace line is malformed or out of range (the message names the file and line)."""


class TraceRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One request of a trace.

    Attributes:
        timestamp: Arrival time in milliseconds (any origin; replay starts at the first).
        input_length: Prompt tokens (>= 1).
        output_length: Tokens to generate (>= 1).
        hash_ids: One id per 512-token prompt block, prefix-chained (at least one).
        session_id: The client's session (an extension of the Mooncake format; a
            replay applies session affinity to it as the gateway does).
    """

    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=1)]
    hash_ids: Annotated[list[HashId], msgspec.Meta(min_length=1)]
    session_id: str | None = None


_decoder = msgspec.json.Decoder(TraceRecord)
_encoder = msgspec.json.Encoder()


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        with path.open("rb") as fh:
            yield from enumerate(fh, start=1)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRecord]:
    """Read a trace file, validating every line; blank lines are skipped.

    Args:
        path: A JSON-lines file in the format above.
        limit: Read at most this many records (the first ones in the file).

    Raises:
        TraceError: The file cannot be read, or a line is not a valid record
            (the message gives ``file:line`` and the reason).
    """
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0, got {limit}")
    source = Path(path)
    records: list[TraceRecord] = []
    for lineno, line in _iter_lines(source):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        try:
            rec = _decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise TraceError(f"{source}:{lineno}: invalid trace record: {exc}") from exc
        if max(rec.hash_ids) > _U64_MAX:
            raise TraceError(f"{source}:{lineno}: hash ids must be unsigned 64-bit integers")
        records.append(rec)
    return records


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> int:
    """Write records as JSON lines (integral timestamps as integers); return how many."""
    n = 0
    with Path(path).open("wb") as fh:
        for rec in records:
            ts = rec.timestamp
            if isinstance(ts, float) and ts.is_integer():
                rec = msgspec.structs.replace(rec, timestamp=int(ts))
            fh.write(_encoder.encode(rec))
            fh.write(b"\n")
            n += 1
    return n


def arrival_times(records: Sequence[TraceRecord], scale: float = 1.0) -> list[float]:
    """Replayed arrival of each record in seconds: ``(ts - first ts) / 1000 / scale``.

    Raises:
        ValueError: ``scale`` is not a positive finite number.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"time scale must be a positive finite number, got {scale}")
    if not records:
        return []
    origin = min(r.timestamp for r in records)
    return [(r.timestamp - origin) / 1000.0 / scale for r in records]


def _splitmix(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Output number ``counters + 1`` of SplitMix64 seeded with ``seeds`` (uint64 arrays)."""
    z = seeds + (counters + np.uint64(1)) * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def block_tokens(
    hash_id: int, count: int = HASH_BLOCK_TOKENS, *, vocab_size: int = 32000
) -> list[int]:
    """Tokens ``0..count-1`` of hash id ``hash_id`` (``count`` may exceed 512: padding).

    Raises:
        ValueError: ``hash_id`` is not a u64, or ``count`` / ``vocab_size`` is out of range.
    """
    if not 0 <= hash_id <= _U64_MAX:
        raise ValueError(f"hash id must be an unsigned 64-bit integer, got {hash_id}")
    if count < 0 or vocab_size < 1:
        raise ValueError("count must be >= 0 and vocab_size >= 1")
    seeds = np.full(count, hash_id, dtype=np.uint64)
    out = _splitmix(seeds, np.arange(count, dtype=np.uint64)) % np.uint64(vocab_size)
    return [int(t) for t in out.tolist()]


class PromptFactory:
    """Prompt token ids and block keys of trace records, as a replay sends them.

    Keys are ``indexer.keys.block_keys(tokens, block_size, root)``; when
    ``block_size`` divides 512 the keys of each whole hash-id block are cached by
    ``(parent key, hash id)`` (a bounded LRU), since a chat or agent trace repeats
    the same prefix in every turn and hashing it again would dominate a replay.

    Args:
        block_size: Tokens per KV block (``B``).
        root: ``indexer.keys.root_parent(model)``: the chain's first parent.
        vocab_size: Token ids are in ``[0, vocab_size)``; 32000 is valid for every
            model we serve.
        cache_entries: Hash-id blocks whose keys are kept (0 disables the cache).
    """

    def __init__(
        self, block_size: int, root: int, *, vocab_size: int = 32000, cache_entries: int = 1 << 16
    ) -> None:
        if block_size < 1 or vocab_size < 2 or cache_entries < 0:
            raise ValueError("block_size must be >= 1, vocab_size >= 2 and cache_entries >= 0")
        self.block_size = block_size
        self.root = root
        self.vocab_size = vocab_size
        self._per_id = HASH_BLOCK_TOKENS // block_size if HASH_BLOCK_TOKENS % block_size == 0 else 0
        self._cache: OrderedDict[tuple[int, int], array[int]] = OrderedDict()
        self._cache_entries = cache_entries

    def tokens(self, record: TraceRecord) -> list[int]:
        """The record's ``input_length`` prompt tokens (see the module docstring)."""
        n = record.input_length
        ids = np.array(record.hash_ids, dtype=np.uint64)
        pos = np.arange(n, dtype=np.int64)
        which = np.minimum(pos // HASH_BLOCK_TOKENS, len(ids) - 1)
        counters = (pos - which * HASH_BLOCK_TOKENS).astype(np.uint64)
        out = _splitmix(ids[which], counters) % np.uint64(self.vocab_size)
        return out.tolist()  # type: ignore[no-any-return]

    def _stream(self, hash_id: int, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` of ``hash_id``'s stream (beyond 511 for padding)."""
        seeds = np.full(stop - start, hash_id, dtype=np.uint64)
        counters = np.arange(start, stop, dtype=np.uint64)
        return (_splitmix(seeds, counters) % np.uint64(self.vocab_size)).tolist()  # type: ignore[no-any-return]

    def keys(self, record: TraceRecord) -> list[int]:
        """Block keys of the record's prompt, equal to ``block_keys(self.tokens(record), ...)``.

        Only the hash-id blocks missing from the cache are synthesized and hashed.
        """
        size = self.block_size
        full = record.input_length // size
        ids = record.hash_ids
        per = self._per_id
        if per == 0 or self._cache_entries == 0:
            return block_keys(self.tokens(record)[: full * size], size, self.root)
        keys: list[int] = []
        parent = self.root
        cache = self._cache
        for c, hid in enumerate(ids):
            want = min(per, full - c * per)
            if want <= 0:
                return keys
            cached = cache.get((parent, hid))
            if cached is not None:
                cache.move_to_end((parent, hid))
                chunk = cached.tolist()[:want]
            else:
                chunk = block_keys(self._stream(hid, 0, want * size), size, parent)
                if want == per:
                    cache[(parent, hid)] = array("Q", chunk)
                    if len(cache) > self._cache_entries:
                        cache.popitem(last=False)
            keys.extend(chunk)
            parent = keys[-1]
        done = len(keys)
        if done < full:
            offset = (len(ids) - 1) * HASH_BLOCK_TOKENS
            tail = self._stream(ids[-1], done * size - offset, full * size - offset)
            keys.extend(block_keys(tail, size, parent))
        return keys
