"""Prefill/decode disaggregation on the worker: ``kv_transfer_params`` and block leases.

The request fields follow vLLM's KV connector API, with our block keys as
block ids:

* ``{"do_remote_decode": true}``: a *prefill-only* request. The worker runs the
  prompt and generates one token, then holds the prompt's blocks under a
  lease, and its response carries what a decoder needs::

      "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
        "remote_engine_id": <worker name>, "remote_host": ..., "remote_port": ...,
        "remote_block_ids": [block keys], "block_keys": [same], "remote_request_id": <lease>,
        "num_tokens": <prompt tokens>, "tp_size": 1}

* ``{"do_remote_prefill": true, "remote_host", "remote_port", "remote_block_ids",
  "remote_request_id"}``: a decode request. The worker pulls the blocks it
  lacks from that host (releasing the lease), then computes what is left of
  the prompt and decodes. A failed or refused pull is logged and counted, and
  the worker computes the prompt itself: the client gets one correct answer.

A lease (:class:`Leases`) pins the cached run of a prompt's blocks, on
whatever medium each sits (a block the pool demoted between the prefill's end
and the lease is held on DRAM or SSD, where a decoder's pull reads it), so the
pool cannot evict them, until the decoder's pull names it or its time runs out
(default 30 s); then they are released like a finished request's blocks
(still cached). A lease is not a prefix hit and does not count as one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from engine_worker.block_pool import Block
from engine_worker.protocol import ApiError
from engine_worker.scheduler import Scheduler

__all__ = ["Lease", "Leases", "PdParams", "parse_pd", "remote_address"]

_U64_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class PdParams:
    """A request's PD part.

    Attributes:
        remote_decode: Prefill only; hold the blocks for a decoder.
        remote_prefill: Pull the prompt's blocks from ``source`` before computing.
        source: Base URL of the prefill worker (``remote_prefill`` only).
        block_keys: The blocks to pull (``remote_prefill`` only).
        lease: The prefill worker's lease to release once pulled.
    """

    remote_decode: bool = False
    remote_prefill: bool = False
    source: str = ""
    block_keys: tuple[int, ...] = ()
    lease: str | None = None


def _bad(message: str) -> ApiError:
    return ApiError(400, f"kv_transfer_params: {message}", param="kv_transfer_params")


def parse_pd(params: Mapping[str, Any] | None) -> PdParams | None:
    """Validate a request's ``kv_transfer_params``; None when it asks for nothing.

    Raises:
        ApiError: 400 for a malformed value (unknown keys are ignored, as vLLM does).
    """
    if not params:
        return None
    decode = params.get("do_remote_decode", False)
    prefill = params.get("do_remote_prefill", False)
    if not isinstance(decode, bool) or not isinstance(prefill, bool):
        raise _bad("do_remote_decode and do_remote_prefill must be booleans")
    if decode and prefill:
        raise _bad("a request cannot both hand off its decode and pull its prefill")
    if decode:
        return PdParams(remote_decode=True)
    if not prefill:
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host or len(host) > 255 or any(c in host for c in "/@?# "):
        raise _bad("remote_host must be a host name or address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise _bad("remote_port must be a port number")
    keys = params.get("remote_block_ids", params.get("block_keys"))
    if (
        not isinstance(keys, list)
        or len(keys) > 1 << 20
        or any(
            isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= _U64_MAX for k in keys
        )
    ):
        raise _bad("remote_block_ids must be a list of block keys (u64)")
    lease = params.get("remote_request_id")
    if lease is not None and (not isinstance(lease, str) or len(lease) > 128):
        raise _bad("remote_request_id must be a string")
    bracketed = f"[{host}]" if ":" in host else host
    return PdParams(
        remote_prefill=True,
        source=f"http://{bracketed}:{port}",
        block_keys=tuple(keys),
        lease=lease,
    )


def remote_address(base_url: str) -> dict[str, str | int]:
    """``remote_host`` and ``remote_port`` of ``kv_transfer_params`` for a worker's base URL."""
    url = httpx.URL(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return {"remote_host": url.host, "remote_port": port}


@dataclass(slots=True)
class Lease:
    """Blocks held for a decoder until ``deadline`` (``time.monotonic``)."""

    blocks: list[Block]
    deadline: float


class Leases:
    """The worker's block leases. Every method runs under the scheduler lock (the engine
    thread between steps, or a pool call)."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, s: Scheduler, lease_id: str, keys: Sequence[int], ttl_s: float) -> list[int]:
        """Pin the cached run of ``keys`` on any medium; returns the keys held (maybe none)."""
        self.release(s, lease_id)
        held = s.pool.pin(s.pool.match_prefix(keys))
        if held:
            self._leases[lease_id] = Lease(held, time.monotonic() + ttl_s)
        return [b.key for b in held if b.key is not None]

    def release(self, s: Scheduler, lease_id: str) -> bool:
        """Free a lease's blocks (they stay cached); False if there is no such lease."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        s.pool.free(lease.blocks[::-1])
        return True

    def expire(self, s: Scheduler, now: float | None = None) -> int:
        """Release every lease past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        late = [k for k, lease in self._leases.items() if lease.deadline <= now]
        for lease_id in late:
            self.release(s, lease_id)
        self.expired += len(late)
        return len(late)

    def release_all(self, s: Scheduler) -> None:
        """Free every lease (shutdown)."""
        for lease_id in list(self._leases):
            self.release(s, lease_id)
