"""One host's ingestion state: stream position, pending snapshot and held batches.

Pure: no I/O and no clock (callers pass ``now``), so the gap handling can
be reasoned about apart from Redis::

    batch applies            -> position advances
    batch is a gap           -> ask for a snapshot (pending), hold the batch
    pending, batch arrives   -> hold it (bounded: the oldest go first)
    pending, timeout passes  -> ask again
    snapshot replaces        -> pending ends; held batches newer than it apply
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from indexer.events import EventBatch, Snapshot

__all__ = ["START_ID", "HostState"]

#: Stream position before the first entry (XREAD returns every entry after it).
START_ID = b"0-0"


@dataclass(slots=True)
class HostState:
    """What a replica tracks for one host it consumes.

    Attributes:
        host: The host's name.
        stream: Its event stream key.
        last_id: The last stream entry consumed (persisted after each round).
        seen_at: When a message of the host was last consumed, or the host was
            taken over (the dead-host check waits a grace period after it).
        requested_at: When a snapshot was last asked for; None unless pending.
        held: Batches that arrived while pending, oldest first.
        purged: Whether the host was purged as dead since its last message.
        dirty: Whether ``last_id`` moved since it was last persisted.
        unchecked: Whether batches were consumed since the last snapshot request
            (a quiet host is then asked once: see ``IngestConfig.quiet_snapshot_s``).
        heard: The newest ``(epoch, seq)`` the stream delivered (a batch of any
            outcome, or an applied snapshot); None until the first one.
        behind_since: Since when the host's heartbeat has reported a newer batch
            than ``heard`` (a lost tail: see ``IngestConfig.tail_grace_s``).
    """

    host: str
    stream: str
    last_id: bytes = START_ID
    seen_at: float = 0.0
    requested_at: float | None = None
    held: deque[EventBatch] = field(default_factory=deque)
    purged: bool = False
    dirty: bool = False
    unchecked: bool = False
    heard: tuple[int, int] | None = None
    behind_since: float | None = None

    @property
    def pending(self) -> bool:
        """Whether the host waits for a snapshot."""
        return self.requested_at is not None

    def consumed(self, entry_id: bytes, now: float) -> None:
        """Record that the entry ``entry_id`` was dealt with (applied, held or skipped)."""
        self.last_id = entry_id
        self.seen_at = now
        self.purged = False
        self.dirty = True

    def hold(self, batch: EventBatch, limit: int) -> int:
        """Keep ``batch`` until the snapshot arrives; returns how many old ones were dropped.

        A dropped batch is at worst one more gap after the snapshot, which asks again.
        """
        self.held.append(batch)
        dropped = 0
        while len(self.held) > limit:
            self.held.popleft()
            dropped += 1
        return dropped

    def ask(self, now: float) -> None:
        """Mark a snapshot as asked for at ``now``."""
        self.requested_at = now

    def ask_due(self, now: float, timeout_s: float) -> bool:
        """Whether a pending request went unanswered for ``timeout_s`` (ask again)."""
        return self.requested_at is not None and now - self.requested_at >= timeout_s

    def quiet_check_due(self, now: float, quiet_s: float) -> bool:
        """Whether the host went quiet for ``quiet_s`` after batches (ask once, not waiting)."""
        return quiet_s > 0 and self.unchecked and not self.pending and now - self.seen_at >= quiet_s

    def hear(self, epoch: int, seq: int) -> None:
        """Record that the stream delivered ``(epoch, seq)`` (a new epoch supersedes)."""
        if self.heard is None or self.heard[0] != epoch or seq > self.heard[1]:
            self.heard = (epoch, seq)

    def tail_lost(self, epoch: int, seq: int, now: float, grace_s: float) -> bool:
        """Whether batches the heartbeat reports (``epoch``, up to ``seq``) are missing.

        The worker's heartbeat names the last batch it formed. Ahead of what the
        stream delivered for ``grace_s`` in a row (batches in flight arrive well
        within it), the batches in between were lost, and with nothing after
        them there is no seq gap to see: the caller asks for a snapshot.
        """
        if self.heard is None or self.heard[0] != epoch or seq <= self.heard[1]:
            self.behind_since = None
            return False
        if self.behind_since is None:
            self.behind_since = now
        return not self.pending and now - self.behind_since >= grace_s

    def answered(self, snapshot: Snapshot) -> list[EventBatch]:
        """End the wait with ``snapshot``; the held batches it does not cover, in order."""
        later = [b for b in self.held if b.epoch == snapshot.epoch and b.seq > snapshot.seq]
        later.sort(key=lambda b: b.seq)
        self.held.clear()
        self.requested_at = None
        return later

    def forget_pending(self) -> None:
        """Drop the wait and the held batches (the host was purged or its data lost)."""
        self.held.clear()
        self.requested_at = None
