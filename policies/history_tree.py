"""An approximate prefix tree of routing history, one tenant per worker.

SGLang's cache-aware router keeps a multi-tenant radix tree of the text it
routed to each worker (``sgl-project/sglang``, ``sgl-router/src/policies/tree.rs``)
and treats it as an estimate of that worker's prefix cache. We key the tree by
block keys instead of characters: a block key folds in its whole prefix
(``indexer.keys``), so a chain of keys *is* a path from the root and the tree
needs no explicit nodes, just ``key -> tenants holding it``. That is the
block-granular version of SGLang's tree: matches are counted in blocks.

Per tenant, keys sit in an LRU order in which a key's ancestors are always
more recent than the key (a chain is touched deepest first), so evicting from
the cold end removes leaves before their parents, as SGLang's leaf-first
LRU eviction does, and every tenant's set stays prefix-closed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

__all__ = ["HistoryTree"]


class HistoryTree:
    """Which worker was sent which key chains, with per-worker LRU eviction."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def size(self, tenant: str) -> int:
        """Number of blocks recorded for ``tenant``."""
        lru = self._lru.get(tenant)
        return len(lru) if lru is not None else 0

    def insert(self, keys: Sequence[int], tenant: str, now: float) -> None:
        """Record that the chain ``keys`` was routed to ``tenant`` at ``now``."""
        lru = self._lru.setdefault(tenant, OrderedDict())
        for key in reversed(keys):
            if key in lru:
                lru.move_to_end(key)
            else:
                self._holders.setdefault(key, set()).add(tenant)
            lru[key] = now

    def match_lengths(self, keys: Sequence[int], tenants: Collection[str]) -> dict[str, int]:
        """Per tenant, how many leading blocks of ``keys`` it holds (one pass over ``keys``)."""
        lengths = dict.fromkeys(tenants, 0)
        alive = set(lengths)
        depth = 0
        for key in keys:
            still = alive & self._holders.get(key, set())
            for tenant in alive - still:
                lengths[tenant] = depth
            alive = still
            if not alive:
                break
            depth += 1
        for tenant in alive:
            lengths[tenant] = depth
        return lengths

    def match(self, keys: Sequence[int], tenants: Collection[str]) -> tuple[int, list[str]]:
        """Longest prefix of ``keys`` held by any of ``tenants``.

        Returns:
            The matched length in blocks and the tenants holding the whole match,
            most recently used first (ties by name).
        """
        return self.best(keys, self.match_lengths(keys, tenants))

    def best(self, keys: Sequence[int], lengths: dict[str, int]) -> tuple[int, list[str]]:
        """From :meth:`match_lengths`' answer, the longest match and its holders by recency."""
        length = max(lengths.values(), default=0)
        if length == 0:
            return 0, []
        last = keys[length - 1]
        holders = [t for t, n in lengths.items() if n == length]
        return length, sorted(holders, key=lambda t: (-self._lru[t][last], t))

    def touch(self, keys: Sequence[int], tenant: str, now: float) -> None:
        """Mark the prefix of ``keys`` that ``tenant`` holds as used at ``now``."""
        lru = self._lru.get(tenant)
        if lru is None:
            return
        held = []
        for key in keys:
            if key not in lru:
                break
            held.append(key)
        for key in reversed(held):
            lru.move_to_end(key)
            lru[key] = now

    def evict(self, max_size: int) -> None:
        """Shrink every tenant to at most ``max_size`` blocks, least recently used first."""
        for tenant, lru in self._lru.items():
            while len(lru) > max_size:
                key, _ = lru.popitem(last=False)
                holders = self._holders[key]
                holders.discard(tenant)
                if not holders:
                    del self._holders[key]

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to ``tenant`` (a worker that left)."""
        for key in self._lru.pop(tenant, OrderedDict()):
            holders = self._holders[key]
            holders.discard(tenant)
            if not holders:
                del self._holders[key]
