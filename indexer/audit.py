"""Audit: does the index hold, for every live worker, exactly the blocks the worker holds?

For each live worker (registry ``{p}:hosts`` + heartbeats, never a scan)
the audit asks the worker itself (``GET {view.url}/kv/keys``, with the
internal token when the workers have one), reads the index's entries for
that host (:meth:`indexer.index.base.KVIndex.entries`) and compares them
per medium: blocks *missing* from the index and *extra* blocks the index
still shows. Events in flight make a busy cluster differ for a moment, so
hosts that differ are checked again a few times before the verdict.

:func:`compare` is the pure core; :func:`audit` does the I/O;
:func:`render` draws the rich table ``kvrouter index audit`` prints.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.table import Table

from indexer.index.base import KVIndex
from indexer.ingest_reader import Client
from indexer.media import MEDIA, Medium
from indexer.views import WorkerView
from indexer.wire import Keyspace, decode_view

__all__ = ["AuditReport", "HostAudit", "MediumDiff", "audit", "compare", "live_workers", "render"]


@dataclass(frozen=True, slots=True)
class MediumDiff:
    """How one host's index entries differ from its own blocks on one medium.

    Attributes:
        medium: The medium.
        missing: Keys the worker holds and the index lacks, sorted.
        extra: Keys the index shows and the worker does not hold, sorted.
    """

    medium: Medium
    missing: list[int]
    extra: list[int]


@dataclass(frozen=True, slots=True)
class HostAudit:
    """The verdict on one worker.

    Attributes:
        host: The worker's name.
        url: Where it was asked.
        worker_blocks: Blocks per medium the worker reported.
        index_blocks: Entries per medium the index holds for it.
        diffs: Media that differ (empty when they match).
        error: Why the worker could not be audited, or None.
    """

    host: str
    url: str
    worker_blocks: dict[Medium, int] = field(default_factory=dict)
    index_blocks: dict[Medium, int] = field(default_factory=dict)
    diffs: list[MediumDiff] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the index matches the worker exactly."""
        return self.error is None and not self.diffs


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The verdict on every live worker (sorted by host)."""

    hosts: list[HostAudit]
    attempts: int = 1

    @property
    def ok(self) -> bool:
        """Whether every live worker matches."""
        return all(h.ok for h in self.hosts)


def compare(
    worker: Mapping[Medium, set[int]], index: Mapping[Medium, set[int]]
) -> list[MediumDiff]:
    """Per medium, the keys missing from the index and the extra keys it holds (pure)."""
    out = []
    for m in MEDIA:
        have, shown = worker.get(m, set()), index.get(m, set())
        missing, extra = sorted(have - shown), sorted(shown - have)
        if missing or extra:
            out.append(MediumDiff(m, missing, extra))
    return out


async def live_workers(client: Client, keyspace: Keyspace) -> list[WorkerView]:
    """Registered workers whose heartbeat is present, sorted by host."""
    names = sorted(
        n.decode() if isinstance(n, bytes) else n for n in await client.hkeys(keyspace.hosts)
    )
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(keyspace.heartbeat(name))
    views = []
    for raw in await pipe.execute():
        if raw is None:
            continue
        try:
            views.append(decode_view(raw))
        except ValueError:
            continue
    return views


async def _worker_keys(
    http: httpx.AsyncClient, view: WorkerView, token: str | None
) -> dict[Medium, set[int]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = await http.get(f"{view.url.rstrip('/')}/kv/keys", headers=headers)
    if response.status_code != 200:
        raise ValueError(
            f"HTTP {response.status_code} from {view.url}/kv/keys: {response.text:.120}"
        )
    body: Any = response.json()
    blocks = body.get("blocks", {}) if isinstance(body, dict) else {}
    return {m: {int(k) for k in blocks.get(m.value, [])} for m in MEDIA}


async def _audit_host(
    view: WorkerView, index: KVIndex, http: httpx.AsyncClient, token: str | None
) -> HostAudit:
    try:
        have = await _worker_keys(http, view, token)
    except (httpx.HTTPError, ValueError) as exc:
        return HostAudit(view.host, view.url, error=str(exc) or type(exc).__name__)
    shown = await index.entries(view.host)
    return HostAudit(
        view.host,
        view.url,
        {m: len(have[m]) for m in MEDIA},
        {m: len(shown[m]) for m in MEDIA},
        compare(have, shown),
    )


async def audit(
    client: Client,
    index: KVIndex,
    *,
    keyspace: Keyspace | None = None,
    internal_token: str | None = None,
    retries: int = 0,
    interval_s: float = 1.0,
    http: httpx.AsyncClient | None = None,
) -> AuditReport:
    """Audit every live worker; hosts that differ are checked again up to ``retries`` times.

    Args:
        client: Redis (registry and heartbeats).
        index: The index to check.
        keyspace: Key prefix shared with the workers.
        internal_token: The workers' internal token (their ``/kv/keys`` needs it).
        retries: Extra attempts for hosts that differ (events may be in flight).
        interval_s: Wait between attempts.
        http: An HTTP client (one is made if None).

    Raises:
        IndexUnavailableError, redis.RedisError: the index or Redis failed.
    """
    keyspace = keyspace or Keyspace()
    own_http = http is None
    http = http or httpx.AsyncClient(timeout=30.0)
    try:
        views = {v.host: v for v in await live_workers(client, keyspace)}
        results: dict[str, HostAudit] = {}
        attempts = 0
        todo = sorted(views)
        while todo:
            attempts += 1
            checked = await asyncio.gather(
                *(_audit_host(views[h], index, http, internal_token) for h in todo)
            )
            results.update({r.host: r for r in checked})
            todo = [r.host for r in checked if not r.ok]
            if attempts > retries:
                break
            if todo:
                await asyncio.sleep(interval_s)
        return AuditReport([results[h] for h in sorted(results)], attempts)
    finally:
        if own_http:
            await http.aclose()


def _sample(keys: list[int], n: int) -> str:
    shown = ", ".join(f"{k:016x}" for k in keys[:n])
    return shown + (f", ... (+{len(keys) - n})" if len(keys) > n else "")


def render(report: AuditReport, samples: int = 3) -> Table:
    """A table of the verdict: one row per host that matches, one per medium that differs."""
    table = Table(title=f"KV index audit ({len(report.hosts)} live workers, "
                        f"{report.attempts} attempt(s))")  # fmt: skip
    for col in ("host", "medium", "worker", "index", "missing in index", "extra in index",
                "sample keys"):  # fmt: skip
        table.add_column(col, justify="right" if col in ("worker", "index") else "left")
    for h in report.hosts:
        if h.error is not None:
            table.add_row(h.host, "", "", "", "", "", f"[red]unreachable: {h.error}[/red]")
            continue
        if not h.diffs:
            total_w, total_i = sum(h.worker_blocks.values()), sum(h.index_blocks.values())
            table.add_row(h.host, "all", str(total_w), str(total_i), "0", "0", "[green]ok[/green]")
            continue
        for d in h.diffs:
            sample = "; ".join(
                part for part in (
                    f"missing {_sample(d.missing, samples)}" if d.missing else "",
                    f"extra {_sample(d.extra, samples)}" if d.extra else "",
                ) if part
            )  # fmt: skip
            table.add_row(
                h.host, d.medium.value, str(h.worker_blocks[d.medium]),
                str(h.index_blocks[d.medium]), str(len(d.missing)), str(len(d.extra)),
                f"[red]{sample}[/red]",
            )  # fmt: skip
    return table
