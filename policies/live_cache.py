"""Which cached blocks each worker is still being asked for: its live cache.

A worker's HBM is usually full of cached blocks, and most of them are dead
(a one-off prompt, a finished session). Some are live: a session's history,
a group's system prompt, an agent's context, which the next request will
come back for. Placing new work on a worker whose HBM is full of live blocks
evicts some of them to DRAM, and the requests that come back for them pay a
reload (or a recompute) that nobody charged to the placement; a worker whose
cache is dead loses nothing. The worker's views cannot tell the two apart:
they publish how many blocks are used, not which ones are wanted.

This state is the router's own answer. Every block a routed request reused
on a worker (its matched prefix, local or pulled there) is live on that
worker until ``window_s`` passes without another request reusing it; a
block only created (a new prompt's) is not live until something comes back
for it, so one-off traffic leaves no live cache behind. Blocks are counted
once however many prefixes share them (a system prompt under many
sessions). The window is a reuse distance: a block nobody asked for in that
long is, for routing, as good as dead. A worker that restarted (a new
``epoch`` in its view) starts with an empty cache, and so with nothing live.
Time comes from the caller (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LiveCache"]


@dataclass(slots=True)
class LiveCache:
    """Blocks reused on each host within the last ``window_s`` seconds."""

    window_s: float = 60.0
    # Per host: the epoch its blocks belong to, and block key -> when it was last reused,
    # oldest first (a reuse moves the key to the end), so expiry pops from the front.
    _hosts: dict[str, tuple[int, dict[int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    def touch(self, host: str, keys: Sequence[int], now: float, epoch: int = 0) -> None:
        """Record that a request routed to ``host`` at ``now`` reuses ``keys`` there."""
        if not keys:
            return
        seen = self._blocks(host, epoch)
        if seen is None:
            seen = {}
            self._hosts[host] = (epoch, seen)
        for key in keys:
            seen[key] = max(now, seen.pop(key, now))

    def count(self, host: str, now: float, epoch: int = 0) -> int:
        """Distinct blocks reused on ``host`` (in ``epoch``) within the window before ``now``."""
        seen = self._blocks(host, epoch)
        if seen is None:
            return 0
        horizon = now - self.window_s
        while seen:
            oldest = next(iter(seen))
            if seen[oldest] >= horizon:
                break
            del seen[oldest]
        return len(seen)

    def hosts(self) -> set[str]:
        """The hosts with blocks on record (live, or not yet found expired)."""
        return set(self._hosts)

    def expire(self, now: float) -> None:
        """Forget every block past the window, and hosts left with none (a worker that
        left the cluster is never counted again, so only this frees what it held)."""
        for host, (epoch, _) in list(self._hosts.items()):
            if not self.count(host, now, epoch):
                del self._hosts[host]

    def _blocks(self, host: str, epoch: int) -> dict[int, float] | None:
        """``host``'s blocks, None when it has none or restarted (a new epoch starts with
        an empty cache, so the old epoch's blocks are dropped)."""
        entry = self._hosts.get(host)
        if entry is None:
            return None
        if entry[0] != epoch:
            del self._hosts[host]
            return None
        return entry[1]
