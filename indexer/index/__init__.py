"""The global KV index: one interface (:class:`KVIndex`), in-memory and Redis backends.

See docs/index.md for the Redis layout, the Lua scripts and cluster behaviour.
"""

from indexer.index.base import (
    ApplyResult,
    ApplyStatus,
    IndexStats,
    IndexUnavailableError,
    InvalidKeyError,
    KVIndex,
    KVIndexError,
)
from indexer.index.layout import IndexLayout
from indexer.index.memory import MemoryIndex
from indexer.index.redis_index import LayoutMismatchError, RedisIndex

__all__ = [
    "ApplyResult",
    "ApplyStatus",
    "IndexLayout",
    "IndexStats",
    "IndexUnavailableError",
    "InvalidKeyError",
    "KVIndex",
    "KVIndexError",
    "LayoutMismatchError",
    "MemoryIndex",
    "RedisIndex",
]
