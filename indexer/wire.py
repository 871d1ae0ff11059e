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

import msgspec

from indexer.views import WorkerView

__all__ = ["CONTROL_FIELD", "EVENT_FIELD", "OP_SNAPSHOT", "Keyspace", "decode_view", "encode_view"]

#: The stream entry field that holds a msgpack-encoded stream message.
EVENT_FIELD = b"d"
#: The control stream entry field naming the operation asked of the worker.
CONTROL_FIELD = b"op"
#: Control operation: publish a full snapshot in the event stream.
OP_SNAPSHOT = b"snapshot"

_view_encoder = msgspec.msgpack.Encoder()
_view_decoder = msgspec.msgpack.Decoder(WorkerView)


def encode_view(view: WorkerView) -> bytes:
    """Heartbeat payload of a worker view."""
    return _view_encoder.encode(view)


def decode_view(data: bytes) -> WorkerView:
    """Inverse of :func:`encode_view`; raises ValueError on a bad payload."""
    try:
        return _view_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"invalid heartbeat payload: {exc}") from exc


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

    def limit(self, suffix: str) -> str:
        """A key of the routers' shared rate-limit buckets."""
        return f"{self.prefix}:rl:{suffix}"
