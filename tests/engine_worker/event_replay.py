"""Test helper: what an index that applies a pool's events in order would hold."""

from __future__ import annotations

from collections.abc import Iterable

from indexer.events import AllCleared, BlockRemoved, BlockStored, Event
from indexer.media import MEDIA, Medium


class EventReplay:
    """A plain ``{medium: set(keys)}`` built only from drained events."""

    def __init__(self) -> None:
        self.held: dict[Medium, set[int]] = {m: set() for m in MEDIA}

    def apply(self, events: Iterable[Event]) -> None:
        """Apply events in order, as the indexer would."""
        for event in events:
            if isinstance(event, BlockStored):
                self.held[event.medium].update(event.keys)
            elif isinstance(event, BlockRemoved):
                self.held[event.medium].difference_update(event.keys)
            else:
                assert isinstance(event, AllCleared)
                for keys in self.held.values():
                    keys.clear()

    def matches(self, snapshot: dict[Medium, list[int]]) -> bool:
        """Whether the replayed state equals a pool snapshot."""
        return {m: set(keys) for m, keys in snapshot.items()} == self.held
