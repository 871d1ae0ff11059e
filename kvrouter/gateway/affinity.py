"""Session affinity: a client's session id as a routing *hint*.

A request carrying a session id (``X-Session-Id``) goes back to the worker
that served the session last, unless that worker has left or the policy
scores it clearly worse than its own choice (predicted TTFT more than
``slack`` times the best plus ``slack_s``; for score-maximizing policies,
below ``1/slack`` of the best). Cache-aware policies usually agree anyway:
the session's prefix lives on that worker.

Memory is bounded whatever clients send: a session id of any length is
kept as its 64-bit hash, and at most ``max_sessions`` entries are kept
(least recently used dropped first, expired ones too), about 150 bytes
each. Two ids that collide share a hint, which only costs a detour.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from policies.base import Decision

__all__ = ["SessionAffinity"]


@dataclass(slots=True)
class SessionAffinity:
    """Remembers each session's last worker (bounded, expiring)."""

    ttl_s: float = 600.0
    max_sessions: int = 100_000
    slack: float = 1.25
    slack_s: float = 0.05
    _last: OrderedDict[int, tuple[str, float]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._last)

    def prefer(self, session_id: str | None, decision: Decision, now: float | None = None) -> str:
        """The worker to use: the session's last one if the hint holds, else the policy's."""
        if not session_id:
            return decision.worker
        now = time.monotonic() if now is None else now
        entry = self._last.get(_key(session_id))
        if entry is None or entry[1] < now:
            return decision.worker
        worker = entry[0]
        if worker == decision.worker or worker not in decision.scores:
            return decision.worker
        best = decision.scores[decision.worker].get("total", 0.0)
        mine = decision.scores[worker].get("total", 0.0)
        if decision.lower_is_better:
            ok = mine <= best * self.slack + self.slack_s
        else:
            ok = mine >= best / self.slack
        return worker if ok else decision.worker

    def record(self, session_id: str | None, worker: str, now: float | None = None) -> None:
        """Remember that ``session_id`` was served by ``worker``."""
        if not session_id or self.max_sessions <= 0:
            return
        now = time.monotonic() if now is None else now
        key = _key(session_id)
        self._last[key] = (worker, now + self.ttl_s)
        self._last.move_to_end(key)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        # Entries are in order of use, so expired ones sit at the front.
        while self._last and next(iter(self._last.values()))[1] < now:
            self._last.popitem(last=False)


def _key(session_id: str) -> int:
    return xxhash.xxh3_64_intdigest(session_id.encode("utf-8", "surrogatepass"))
