"""The SSD tier: a preallocated file of fixed-size block slots and a journal of what they hold.

A directory holds two files::

    slots.bin         num_slots * block_bytes bytes; slot i at offset i * block_bytes
    manifest.journal  header, then fixed-size records appended as slots change

Header (64 bytes, little-endian): magic ``KVRSSD\\0\\1``, format version, the
KV layout (layers, kv heads, head dim, block size, dtype), block bytes and
slot count, then an xxh3-64 of everything before it. A journal written for
another model or geometry is refused: its bytes would be meaningless here.

Record (32 bytes): ``op u8, pad[3], slot u32, key u64, parent u64,
xxh3-64 of the first 24 bytes``; ``op`` is SET (slot holds key, with a
parent), SET_ROOTLESS (parent unknown) or FREE. Replaying the records in
order gives which key each slot holds; the order of the last SET per slot
is the LRU order restored at start.

Crash safety (process crash, not power loss: nothing is fsynced except a
compaction): a slot is journaled FREE *before* its bytes are overwritten,
and SET only *after* the new bytes are written, so a crash at any point
never leaves a record naming bytes that are not there. A crash in the
middle of appending a record leaves a short tail: it is ignored (with a
warning) and cut off, because it can only be the last, unfinished write.
Anything else -- a bad header, a record whose checksum fails, a record
naming a slot out of range, two slots claiming one key, a slot file of the
wrong size -- raises :class:`ManifestError`. When the journal holds more
than twice the live entries (plus a constant), it is compacted: rewritten
to one SET per live slot in a temporary file, fsynced and renamed over.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from engine_worker.block_pool import PoolError
from engine_worker.kv_layout import KVLayout

__all__ = ["HEADER_SIZE", "RECORD_SIZE", "ManifestError", "SSDEntry", "SSDTier"]

logger = logging.getLogger(__name__)

MAGIC = b"KVRSSD\x00\x01"
VERSION = 1
SLOTS_FILE = "slots.bin"
MANIFEST_FILE = "manifest.journal"

_HEADER = struct.Struct("<8sIIIII12sQQ")  # magic, version, layout x4, dtype, block_bytes, slots
HEADER_SIZE = _HEADER.size + 8
_RECORD = struct.Struct("<BxxxIQQ")
RECORD_SIZE = _RECORD.size + 8
_SUM = struct.Struct("<Q")
_SET, _SET_ROOTLESS, _FREE = 1, 2, 3
_MAX_SLOTS = 2**32 - 1
_COMPACT_SLACK = 1024


class ManifestError(PoolError):
    """The SSD tier's files are corrupt, belong to another layout, or are in use elsewhere."""


@dataclass(frozen=True, slots=True)
class SSDEntry:
    """One slot's content as the journal records it."""

    slot: int
    key: int
    parent: int | None


def _checksum(data: bytes) -> bytes:
    return _SUM.pack(xxhash.xxh3_64_intdigest(data))


def _header(layout: KVLayout, num_slots: int) -> bytes:
    body = _HEADER.pack(
        MAGIC,
        VERSION,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.dtype.encode(),
        layout.block_bytes,
        num_slots,
    )
    return body + _checksum(body)


def _record(op: int, slot: int, key: int, parent: int) -> bytes:
    body = _RECORD.pack(op, slot, key, parent)
    return body + _checksum(body)


#: Never follow a symlink planted where a tier file goes (it could point anywhere).
_PRIVATE = os.O_NOFOLLOW | os.O_CLOEXEC


def _read_private(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | _PRIVATE)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


class SSDTier:
    """Positional block I/O into the slot file, plus the journal that survives restarts.

    Opening an existing directory replays its journal (see the module
    docstring); :attr:`entries` then lists the slots holding keys, oldest
    first. The directory is locked (``flock``) while open, so two workers
    cannot share it.

    Args:
        path: Directory of the tier (created if missing).
        layout: KV block geometry; must match an existing journal's.
        num_slots: Slots in the file; must match an existing journal's.

    Raises:
        ManifestError: See the module docstring.
    """

    def __init__(self, path: Path, layout: KVLayout, num_slots: int) -> None:
        if not 0 < num_slots <= _MAX_SLOTS:
            raise ManifestError(f"SSD slot count must be in [1, {_MAX_SLOTS}], got {num_slots}")
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.block_bytes = layout.block_bytes
        self.num_slots = num_slots
        self._layout = layout
        self._live: dict[int, SSDEntry] = {}
        self._slot_of: dict[int, int] = {}
        self._records = 0
        manifest = self.path / MANIFEST_FILE
        slots = self.path / SLOTS_FILE
        size = num_slots * self.block_bytes
        self._fd = os.open(slots, os.O_RDWR | os.O_CREAT | _PRIVATE, 0o600)
        try:
            os.fchmod(self._fd, 0o600)  # KV bytes derive from prompts: owner only
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ManifestError(f"SSD tier {self.path} is in use by another pool") from None
            if manifest.exists():
                self._replay(_read_private(manifest))
                if os.fstat(self._fd).st_size != size:
                    raise ManifestError(
                        f"{slots} has {os.fstat(self._fd).st_size} bytes, the journal says {size}"
                    )
            else:
                os.ftruncate(self._fd, size)
                with contextlib.suppress(OSError):
                    os.posix_fallocate(self._fd, 0, size)
                self._rewrite()
            self._log = os.open(manifest, os.O_WRONLY | os.O_APPEND | _PRIVATE)
            os.fchmod(self._log, 0o600)
        except BaseException:
            os.close(self._fd)
            raise
        if self._records > 2 * len(self._live) + _COMPACT_SLACK:
            self._compact()

    @property
    def entries(self) -> list[SSDEntry]:
        """Slots holding a key, in the order they were written (oldest first)."""
        return list(self._live.values())

    # ---------------------------------------------------------------- block I/O

    def read_into(self, slot: int, buffer: memoryview) -> None:
        """Read slot ``slot`` into ``buffer`` (exactly ``block_bytes`` writable bytes)."""
        self._check_slot(slot)
        done = os.preadv(self._fd, [buffer], slot * self.block_bytes)
        if done != self.block_bytes:
            raise ManifestError(f"short read of SSD slot {slot}: {done} of {self.block_bytes}")

    def write_from(self, slot: int, buffer: memoryview) -> None:
        """Write ``buffer`` (exactly ``block_bytes`` bytes) into slot ``slot``."""
        self._check_slot(slot)
        offset, view = slot * self.block_bytes, buffer.cast("B")
        while len(view):
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    # ------------------------------------------------------------------ journal

    def record_stored(self, slot: int, key: int, parent: int | None) -> None:
        """Journal that ``slot`` now holds ``key`` (call after its bytes are written)."""
        self._check_slot(slot)
        if self._slot_of.get(key, slot) != slot:
            raise ManifestError(f"key {key} is already on SSD slot {self._slot_of[key]}")
        op = _SET if parent is not None else _SET_ROOTLESS
        self._append(_record(op, slot, key, parent or 0))
        self._set(SSDEntry(slot, key, parent))

    def record_freed(self, slot: int) -> None:
        """Journal that ``slot`` holds nothing (call before its bytes are overwritten)."""
        self._check_slot(slot)
        entry = self._live.pop(slot, None)
        if entry is None:
            return
        del self._slot_of[entry.key]
        self._append(_record(_FREE, slot, 0, 0))

    def record_cleared(self) -> None:
        """Journal that every slot is empty (rewrites the journal to its header)."""
        self._live.clear()
        self._slot_of.clear()
        self._compact()

    def close(self) -> None:
        """Close both files and release the directory lock (idempotent)."""
        for name in ("_log", "_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    # ---------------------------------------------------------------- internals

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise PoolError(f"SSD slot {slot} out of range [0, {self.num_slots})")

    def _set(self, entry: SSDEntry) -> None:
        old = self._live.pop(entry.slot, None)
        if old is not None:
            del self._slot_of[old.key]
        self._live[entry.slot] = entry
        self._slot_of[entry.key] = entry.slot

    def _append(self, record: bytes) -> None:
        os.write(self._log, record)
        self._records += 1
        if self._records > 2 * len(self._live) + _COMPACT_SLACK:
            self._compact()

    def _replay(self, data: bytes) -> None:
        where = self.path / MANIFEST_FILE
        head = data[:HEADER_SIZE]
        if len(head) < HEADER_SIZE or _checksum(head[:-8]) != head[-8:]:
            raise ManifestError(f"{where}: missing, truncated or corrupt header")
        if head[:8] != MAGIC:
            raise ManifestError(f"{where}: not a kvrouter SSD journal (format {head[:8]!r})")
        if head != _header(self._layout, self.num_slots):
            raise ManifestError(
                f"{where} was written for another KV layout or slot count than "
                f"{self._layout} x {self.num_slots}; remove {self.path} to start empty"
            )
        body = data[HEADER_SIZE:]
        whole = len(body) - len(body) % RECORD_SIZE
        for pos in range(0, whole, RECORD_SIZE):
            rec = body[pos : pos + RECORD_SIZE]
            if _checksum(rec[:-8]) != rec[-8:]:
                raise ManifestError(f"{where}: bad checksum in record {pos // RECORD_SIZE}")
            op, slot, key, parent = _RECORD.unpack(rec[:-8])
            if slot >= self.num_slots or op not in (_SET, _SET_ROOTLESS, _FREE):
                raise ManifestError(f"{where}: invalid record {pos // RECORD_SIZE}")
            if op == _FREE:
                entry = self._live.pop(slot, None)
                if entry is not None:
                    del self._slot_of[entry.key]
            elif self._slot_of.get(key, slot) != slot:
                raise ManifestError(f"{where}: key {key} claimed by two slots")
            else:
                self._set(SSDEntry(slot, key, parent if op == _SET else None))
        self._records = whole // RECORD_SIZE
        if whole != len(body):
            logger.warning("%s: ignoring a truncated last record (crash mid-write)", where)
            os.truncate(where, HEADER_SIZE + whole)

    def _rewrite(self) -> None:
        """Atomically replace the journal by the header plus one SET per live slot."""
        manifest = self.path / MANIFEST_FILE
        tmp = manifest.with_suffix(".tmp")
        parts = [_header(self._layout, self.num_slots)]
        for e in self._live.values():
            op = _SET if e.parent is not None else _SET_ROOTLESS
            parts.append(_record(op, e.slot, e.key, e.parent or 0))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _PRIVATE, 0o600)
        try:
            view = memoryview(b"".join(parts))
            while len(view):
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, manifest)
        self._records = len(self._live)

    def _compact(self) -> None:
        self._rewrite()
        os.close(self._log)
        self._log = os.open(self.path / MANIFEST_FILE, os.O_WRONLY | os.O_APPEND | _PRIVATE)
