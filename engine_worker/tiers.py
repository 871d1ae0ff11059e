"""Where KV bytes live: one HBM tensor, one DRAM tensor and an SSD slot file.

Each medium's storage is allocated once and addressed by slot id::

    hbm  : tensor [capacity.hbm,  *layout.block_shape] on ``device``  (the KV cache itself)
    dram : tensor [capacity.dram, *layout.block_shape] on ``dram_device``, pinned for CUDA
    ssd  : file   capacity.ssd slots of layout.block_bytes bytes (see ``ssd_tier``)

A block's bytes for all layers are contiguous, so moving a block between
media is exactly one copy (one ``copy_``, one ``pwrite`` or one ``preadv``).

Tiers are *exclusive*: a key lives on exactly one medium at a time. A
block demoted to DRAM leaves HBM, a block promoted to HBM leaves DRAM. The
alternative (inclusive, each lower tier a superset) would waste the
smaller tiers' capacity on copies of what HBM already holds, and would
need the index to track every copy; with exclusive tiers each key has one
(host, medium) entry and "how much of this prefix sits where" is a simple
count. The cost -- a promoted block must be written down again if it is
evicted later -- is one copy, which is paid only for blocks still worth
keeping.

Copies are synchronous (``non_blocking=False``): the pool reuses a slot
right after moving its bytes, so an asynchronous copy would race with the
next write into that slot.

Every copy between media is timed (``time.perf_counter`` around it; a copy
between two CUDA tensors is the one kind that returns before it is done,
so that one is followed by a device synchronize) and folded into a
:class:`TransferStat` per (source, destination) pair. The worker's
heartbeat publishes :meth:`TierStorage.load_bandwidth` -- measured bytes/s
from DRAM and SSD into HBM -- which the router's TTFT prediction divides
a prefix's lower-tier bytes by.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType

import torch

from engine_worker.block_checksum import block_checksum
from engine_worker.block_pool import PoolError, TierCapacity
from engine_worker.kv_layout import KVLayout
from engine_worker.ssd_tier import SSDEntry, SSDTier
from engine_worker.transfer_stat import TransferStat
from indexer.media import MEDIA, Medium

__all__ = ["TierError", "TierStorage", "TransferStat"]


class TierError(PoolError):
    """Bad use of the storage: slot out of range, wrong tensor shape or dtype, missing SSD path."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, zero-copy and writable."""
    return t.view(-1).view(torch.uint8).numpy().data


class TierStorage:
    """The tensors and slot file behind a :class:`~engine_worker.block_pool.BlockPool`.

    Args:
        layout: KV block geometry; its dtype is the tensors' dtype.
        capacity: Blocks per medium.
        device: Device of the HBM tensor (``"cuda:0"`` on a GPU worker, CPU in tests).
        dram_device: Device of the DRAM tensor (host memory).
        ssd_path: Directory of the SSD tier; required when ``capacity.ssd > 0``.
            An existing one is reopened and its journal replayed
            (:meth:`restored_ssd`).

    Raises:
        TierError: ``capacity.ssd > 0`` without ``ssd_path``.
        ManifestError: The SSD directory is corrupt, from another layout, or in use.
    """

    def __init__(
        self,
        layout: KVLayout,
        capacity: TierCapacity,
        *,
        device: str | torch.device = "cpu",
        dram_device: str | torch.device = "cpu",
        ssd_path: Path | None = None,
    ) -> None:
        if capacity.ssd > 0 and ssd_path is None:
            raise TierError("an SSD tier (capacity.ssd > 0) needs ssd_path")
        self.layout = layout
        self.capacity = capacity
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        shape = layout.block_shape
        pin = self.device.type == "cuda" and torch.device(dram_device).type == "cpu"
        self.hbm = torch.zeros((capacity.hbm, *shape), dtype=self.dtype, device=self.device)
        self.dram = torch.empty(
            (capacity.dram, *shape), dtype=self.dtype, device=dram_device, pin_memory=pin
        )
        self._staging = torch.empty(layout.block_bytes, dtype=torch.uint8, pin_memory=pin)
        # Each host-memory tensor's bytes, once: a block's view is then a slice (a KV
        # transfer takes one per block it sends or receives, on the engine thread).
        self._host_bytes = {
            m: _as_bytes(t) if t.device.type == "cpu" else None
            for m, t in ((Medium.HBM, self.hbm), (Medium.DRAM, self.dram))
        }
        self._ssd = SSDTier(ssd_path, layout, capacity.ssd) if ssd_path and capacity.ssd else None
        self._stats: dict[tuple[Medium, Medium], TransferStat] = {}

    # ---------------------------------------------------------------- block I/O

    def copy_block(self, src: Medium, src_id: int, dst: Medium, dst_id: int) -> None:
        """Copy one block's bytes (all layers) from a slot of ``src`` to a slot of ``dst``.

        The copy is timed into :meth:`transfer_stats`.
        """
        self._check(src, src_id)
        self._check(dst, dst_id)
        t0 = time.perf_counter()
        if src is not Medium.SSD and dst is not Medium.SSD:
            to, frm = self._tensor(dst), self._tensor(src)
            to[dst_id].copy_(frm[src_id])
            if to.is_cuda and frm.is_cuda:
                torch.cuda.synchronize(to.device)
        elif dst is not Medium.SSD:
            self._read_ssd(src_id, self._tensor(dst)[dst_id])
        elif src is not Medium.SSD:
            self._write_ssd(dst_id, self._tensor(src)[src_id])
        else:
            ssd = self._ssd_tier()
            ssd.read_into(src_id, _as_bytes(self._staging))
            ssd.write_from(dst_id, _as_bytes(self._staging))
        seconds = time.perf_counter() - t0
        stat = self._stats.get((src, dst))
        if stat is None:
            stat = self._stats[(src, dst)] = TransferStat()
        stat.add(self.layout.block_bytes, seconds)

    # ------------------------------------------------------------ measurement

    def transfer_stats(self) -> dict[tuple[Medium, Medium], TransferStat]:
        """Copies measured so far per (source, destination) medium; pairs never used are absent."""
        return {pair: stat.copy() for pair, stat in self._stats.items()}

    def bandwidth(self, src: Medium, dst: Medium) -> float | None:
        """Recent measured bytes/s of copies from ``src`` to ``dst``; None before the first."""
        stat = self._stats.get((src, dst))
        return stat.bandwidth if stat is not None else None

    def load_bandwidth(self) -> dict[Medium, float]:
        """Measured bytes/s loading KV into HBM, per lower medium that has loaded any.

        What the worker publishes as ``WorkerView.load_bandwidth``.
        """
        out: dict[Medium, float] = {}
        for medium in MEDIA[1:]:
            bw = self.bandwidth(medium, Medium.HBM)
            if bw is not None:
                out[medium] = bw
        return out

    def read_block(self, medium: Medium, block_id: int) -> torch.Tensor:
        """A CPU copy of one block, shaped ``layout.block_shape``."""
        self._check(medium, block_id)
        if medium is Medium.SSD:
            out = torch.empty(self.layout.block_shape, dtype=self.dtype)
            self._read_ssd(block_id, out)
            return out
        return self._tensor(medium)[block_id].to("cpu", copy=True)

    def write_block(self, medium: Medium, block_id: int, block: torch.Tensor) -> None:
        """Overwrite one block with ``block`` (shape ``layout.block_shape``, the layout's dtype)."""
        self._check(medium, block_id)
        if tuple(block.shape) != self.layout.block_shape or block.dtype != self.dtype:
            raise TierError(
                f"block must be {self.layout.block_shape} {self.dtype}, "
                f"got {tuple(block.shape)} {block.dtype}"
            )
        if medium is Medium.SSD:
            self._write_ssd(block_id, block)
        else:
            self._tensor(medium)[block_id].copy_(block)

    def read_bytes(self, medium: Medium, block_id: int) -> bytes:
        """One block's raw bytes, copied into an immutable ``bytes``, in one copy for
        CPU tensors.

        ``torch`` copies of sub-megabyte tensors go through its parallel copy path, which
        costs milliseconds per block on a busy machine; a NumPy view of the same memory
        copies at memory speed.
        """
        return bytes(self.read_payload(medium, block_id))

    def read_payload(self, medium: Medium, block_id: int) -> memoryview:
        """One block's raw bytes as a KV transfer sends them: read off the SSD, or copied
        out of device memory, into a buffer of their own; a view of where they are in
        host memory (:meth:`block_view`). One copy fewer than :meth:`read_bytes` for the
        first two."""
        self._check(medium, block_id)
        if medium is Medium.SSD:
            out = memoryview(bytearray(self.layout.block_bytes))
            self._ssd_tier().read_into(block_id, out)
            return out
        view = self.block_view(medium, block_id)
        if view is not None:
            return view
        return _as_bytes(self._tensor(medium)[block_id].to("cpu"))

    def block_view(self, medium: Medium, block_id: int) -> memoryview | None:
        """The bytes of one block in place (zero-copy, writable) when it lives in host
        memory; None for the SSD tier and device tensors (use :meth:`read_bytes`)."""
        self._check(medium, block_id)
        data = self._host_bytes.get(medium)
        if data is None:
            return None
        size = self.layout.block_bytes
        return data[block_id * size : (block_id + 1) * size]

    def checksum(self, medium: Medium, block_id: int) -> int | None:
        """The checksum of one block's bytes (:mod:`engine_worker.block_checksum`) when
        they are in host memory; None for the SSD tier and device tensors, which a
        sender stages anyway (the pool then learns it from the sender)."""
        view = self.block_view(medium, block_id)
        return block_checksum(view) if view is not None else None

    def write_bytes(self, medium: Medium, block_id: int, data: bytes | memoryview) -> None:
        """Overwrite one block with raw bytes (``layout.block_bytes`` of them)."""
        self._check(medium, block_id)
        if len(data) != self.layout.block_bytes:
            raise TierError(f"a block is {self.layout.block_bytes} bytes, got {len(data)}")
        if medium is Medium.SSD:
            self._ssd_tier().write_from(block_id, memoryview(data))
            return
        block = self._tensor(medium)[block_id]
        if block.device.type == "cpu":
            _as_bytes(block)[:] = data
        else:
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            block.copy_(src.view(self.dtype).view(self.layout.block_shape))

    # ------------------------------------------------------- SSD journal hooks

    def restored_ssd(self) -> list[SSDEntry]:
        """Slots the SSD tier holds now, oldest first (after a restart: what its journal held).

        A new :class:`~engine_worker.block_pool.BlockPool` caches these on SSD;
        give each storage to one pool only.
        """
        return self._ssd.entries if self._ssd is not None else []

    def record_stored(self, medium: Medium, block_id: int, key: int, parent: int | None) -> None:
        """Note that a slot now holds ``key`` (persisted for SSD, nothing for the others)."""
        if medium is Medium.SSD:
            self._ssd_tier().record_stored(block_id, key, parent)

    def record_freed(self, medium: Medium, block_id: int) -> None:
        """Note that a slot holds nothing (persisted for SSD, nothing for the others)."""
        if medium is Medium.SSD:
            self._ssd_tier().record_freed(block_id)

    def record_cleared(self) -> None:
        """Note that every slot of every medium is empty."""
        if self._ssd is not None:
            self._ssd.record_cleared()

    def close(self) -> None:
        """Release the SSD files and lock (the tensors are freed with the object)."""
        if self._ssd is not None:
            self._ssd.close()

    def __enter__(self) -> TierStorage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _tensor(self, medium: Medium) -> torch.Tensor:
        return self.hbm if medium is Medium.HBM else self.dram

    def _ssd_tier(self) -> SSDTier:
        if self._ssd is None:
            raise TierError("this storage has no SSD tier")
        return self._ssd

    def _check(self, medium: Medium, block_id: int) -> None:
        n = self.capacity.of(medium)
        if not 0 <= block_id < n:
            raise TierError(f"{medium} block id {block_id} out of range [0, {n})")

    def _read_ssd(self, slot: int, dst: torch.Tensor) -> None:
        if dst.device.type == "cpu" and dst.is_contiguous():
            self._ssd_tier().read_into(slot, _as_bytes(dst))
        else:
            self._ssd_tier().read_into(slot, _as_bytes(self._staging))
            dst.copy_(self._staging.view(self.dtype).view(self.layout.block_shape))

    def _write_ssd(self, slot: int, src: torch.Tensor) -> None:
        if src.device.type == "cpu" and src.is_contiguous():
            self._ssd_tier().write_from(slot, _as_bytes(src))
        else:
            self._staging.view(self.dtype).view(self.layout.block_shape).copy_(src)
            self._ssd_tier().write_from(slot, _as_bytes(self._staging))
