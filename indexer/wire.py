"""Names of everything kvrouter keeps in Redis, in one place.

Workers, indexers and routers meet only through these keys, so they are
defined once. Every name starts with a configurable prefix (default
``kvr``) so that several clusters can share one Redis.

======================  =========  ===============================================
key                     type       written by -> read by
======================  =========  ===============================================
``{p}:ev:{host}``       stream     worker publisher -> indexer (field ``d``: a
                                   msgpack :class:`~indexer.events.EventBatch`
                                   or :class:`~indexer.events.Snapshot`)
``{p}:ctl:{host}``      stream     indexer -> worker (field ``op``: ``snapshot``)
``{p}:hb:{host}``       string     worker heartbeat, msgpack
                                   :class:`~indexer.views.WorkerView`, with a TTL
``{p}:hosts``           hash       registry: host name -> small integer host id
                                   (discovery reads it, then the heartbeats;
                                   nothing ever scans the keyspace)
``{p}:hostnames``       hash       registry: host id -> host name
``{p}:hostid``          string     registry: last host id handed out (INCR)
``{p}:idx:...``         (index)    the index backend's own layout (docs/index.md)
``{p}:load:...``        (router)   the routers' shared load accounting
======================  =========  ===============================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVENT_FIELD", "Keyspace"]

#: The stream entry field that holds a msgpack-encoded stream message.
EVENT_FIELD = b"d"


@dataclass(frozen=True, slots=True)
class Keyspace:
    """Redis key names under one prefix."""

    prefix: str = "kvr"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"invalid key prefix {self.prefix!r}")

    def events(self, host: str) -> str:
        """The host's event stream."""
        return f"{self.prefix}:ev:{host}"

    def control(self, host: str) -> str:
        """The host's control stream (snapshot requests)."""
        return f"{self.prefix}:ctl:{host}"

    def heartbeat(self, host: str) -> str:
        """The host's heartbeat key (expires when the host dies)."""
        return f"{self.prefix}:hb:{host}"

    @property
    def hosts(self) -> str:
        """Registry hash: host name -> host id."""
        return f"{self.prefix}:hosts"

    @property
    def hostnames(self) -> str:
        """Registry hash: host id -> host name."""
        return f"{self.prefix}:hostnames"

    @property
    def host_id_counter(self) -> str:
        """Registry counter: the last host id handed out."""
        return f"{self.prefix}:hostid"

    def index(self, suffix: str) -> str:
        """A key of the index backend's own layout."""
        return f"{self.prefix}:idx:{suffix}"

    def load(self, suffix: str) -> str:
        """A key of the routers' shared load accounting."""
        return f"{self.prefix}:load:{suffix}"
