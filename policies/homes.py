"""Where the prompts that come back live: each worker's homes, and how likely a new one returns.

A prompt that no worker holds (a new system prompt, document, session or
agent context) makes a home where it lands: if anything comes back for it
(the group's next user, the session's next turn, the agent's next step), it
comes back to that worker's cache. How many returning homes a worker holds
is the load it will carry later, and the views cannot show it: a burst of
new prompts is placed by the queues of the moment, so a worker whose first
homes happened to be cheap receives more of them, and later pays for all of
them at once (the bench suite's ``groups`` ended 6/6/9/11 homes where
SGLang's smallest-tree rule made 8/8/8/8, and its crowded workers then
pushed their traffic elsewhere by pulls).

This state is the router's own record. A home is keyed by the first block
of its prompt that no worker held when it was placed (the point where the
prompt became new), at that block's position: a later request whose key at
that position is the same shares everything up to there, so it returned.
Block keys are chained, so the check is one dictionary lookup per distinct
home position (at most one per block of the prompt). A home lives until
``window_s`` passes without a return; one that never returned counts as a
miss when it expires. The
return probability is learned from those outcomes, starting from
``prior_returns`` returns in as many homes (1: before anything is known, a
new prompt is taken to be a home that comes back, as SGLang's rule assumes).
A home still waiting for its first return counts as the part of a miss its
age is of the window, so traffic whose new prompts never return teaches it
within seconds, not only once a window has passed: a burst of one-off
documents at 10 per second brings the probability to 0.1 in ~10 s.

A worker's expected demand is its homes that returned (each is coming back)
plus the return probability times those still waiting for a first return;
the blocks of those waiting homes, weighed likewise, are cache they are
expected to make live (``pending_blocks``: ``kv_ttft``'s displacement term
protects them as it protects blocks already reused).
Time comes from the caller (``now``); nothing here reads a clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["HomeDemand"]


@dataclass(slots=True)
class _Home:
    host: str
    position: int
    last: float
    returned: bool = False
    blocks: int = 0


@dataclass(slots=True)
class HomeDemand:
    """Homes per worker within ``window_s`` of their last use, and their return rate."""

    window_s: float = 60.0
    prior_returns: float = 1.0
    #: Homes that returned and homes that expired without returning, so far.
    returns: int = 0
    misses: int = 0
    # Block key -> home, least recently used first (a return moves it to the end).
    _homes: dict[int, _Home] = field(default_factory=dict)
    _positions: Counter[int] = field(default_factory=Counter)
    _returned: Counter[str] = field(default_factory=Counter)
    _pending: Counter[str] = field(default_factory=Counter)
    # Per host: the blocks its homes waiting for a first return hold.
    _pending_blocks: Counter[str] = field(default_factory=Counter)
    # Homes waiting for a first return, and the sum of the times they were placed.
    _waiting: int = 0
    _placed_sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.prior_returns < 0:
            raise ValueError(f"prior_returns must be >= 0, got {self.prior_returns}")

    def observe(self, keys: Sequence[int], now: float) -> list[int]:
        """Forget homes past the window, then mark the homes a request with ``keys`` at
        ``now`` returns to; returns their keys (for :meth:`follow`)."""
        self.expire(now)
        found = []
        # Usually a handful of distinct positions (where shared system prompts end); never
        # more look-ups than the prompt has blocks.
        n = len(keys)
        positions = self._positions if len(self._positions) < n else range(n)
        for position in positions:
            if position < n:
                home = self._homes.get(keys[position])
                if home is not None and home.position == position:
                    found.append(keys[position])
        for key in found:
            home = self._homes.pop(key)
            if not home.returned:
                home.returned = True
                self.returns += 1
                self._pending[home.host] -= 1
                self._pending_blocks[home.host] -= home.blocks
                self._returned[home.host] += 1
                self._unwait(home.last)
            home.last = max(home.last, now)
            self._homes[key] = home
        return found

    def follow(self, keys: Sequence[int], host: str) -> None:
        """The request that returned to these homes went to ``host``: they live there now."""
        for key in keys:
            home = self._homes.get(key)
            if home is not None and home.host != host:
                counts = self._returned if home.returned else self._pending
                counts[home.host] -= 1
                counts[host] += 1
                if not home.returned:
                    self._pending_blocks[home.host] -= home.blocks
                    self._pending_blocks[host] += home.blocks
                home.host = host

    def place(self, host: str, keys: Sequence[int], position: int, now: float) -> None:
        """A prompt nobody held from block ``position`` on was routed to ``host``."""
        if not 0 <= position < len(keys) or keys[position] in self._homes:
            return
        blocks = len(keys) - position
        self._homes[keys[position]] = _Home(host, position, now, blocks=blocks)
        self._positions[position] += 1
        self._pending[host] += 1
        self._pending_blocks[host] += blocks
        self._waiting += 1
        self._placed_sum += now

    def return_probability(self, now: float) -> float:
        """The share of homes returned to (with the prior's returns), each home still
        waiting at ``now`` counting as the share of a miss its age is of the window."""
        waited = max(self._waiting * now - self._placed_sum, 0.0) / self.window_s
        settled = self.returns + self.misses + waited + self.prior_returns
        return (self.returns + self.prior_returns) / settled if settled > 0 else 0.0

    def demand(self, host: str, now: float) -> float:
        """Homes on ``host`` expected to be returned to, as of ``now``."""
        return self._returned[host] + self.return_probability(now) * self._pending[host]

    def pending_blocks(self, host: str, now: float) -> float:
        """Blocks of the homes on ``host`` still waiting for a first return, weighed by
        the return probability at ``now``: the cache they are expected to make live."""
        return self.return_probability(now) * self._pending_blocks[host]

    def expire(self, now: float) -> None:
        """Forget homes unused for the window; a home never returned to is a miss."""
        horizon = now - self.window_s
        while self._homes:
            key = next(iter(self._homes))
            home = self._homes[key]
            if home.last > horizon:
                break
            del self._homes[key]
            self._positions[home.position] -= 1
            if not self._positions[home.position]:
                del self._positions[home.position]
            if home.returned:
                self._returned[home.host] -= 1
            else:
                self.misses += 1
                self._pending[home.host] -= 1
                self._pending_blocks[home.host] -= home.blocks
                self._unwait(home.last)
            for counts in (self._returned, self._pending, self._pending_blocks):
                if not counts[home.host]:
                    del counts[home.host]

    def _unwait(self, placed: float) -> None:
        """A home placed at ``placed`` is no longer waiting for its first return."""
        self._waiting -= 1
        # Back to exactly zero whenever nothing waits, so a long-running gateway's sum of
        # epoch-second times does not carry rounding from one busy period to the next.
        self._placed_sum = self._placed_sum - placed if self._waiting else 0.0

    def __len__(self) -> int:
        return len(self._homes)
