"""What ``kvrouter top`` shows, as pure code: a :class:`Frame` in, a rich renderable out.

A frame is one look at the cluster (heartbeat views from Redis, then the
workers', gateways' and indexer's ``/metrics``); :mod:`kvrouter.ops.cluster`
takes it. Counters and histograms are cumulative since each process
started; given the previous frame, :func:`render` shows the window between
the two instead, so a refreshing view follows the present.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from indexer.media import MEDIA
from kvrouter.ops.exposition import Buckets

__all__ = ["Frame", "GatewayStats", "IndexStats", "WorkerStats", "render"]


@dataclass(slots=True)
class WorkerStats:
    """One worker: its heartbeat view and (when it answered) its ``/metrics``.

    Attributes:
        host: Worker name.
        role: prefill, decode or both.
        running: Requests running (heartbeat).
        waiting: Requests waiting (heartbeat).
        in_flight: Requests accepted and not finished (heartbeat).
        kv_used: Blocks holding data per medium (heartbeat).
        kv_capacity: Blocks per medium (heartbeat).
        scraped: Whether ``/metrics`` answered.
        prompt_tokens: Prompt tokens received (cumulative).
        hit_tokens: Prompt tokens served from cache per medium (cumulative).
        ttft: The worker's time-to-first-token histogram.
        step: The engine step-time histogram.
    """

    host: str
    role: str
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    kv_used: dict[str, int] = field(default_factory=dict)
    kv_capacity: dict[str, int] = field(default_factory=dict)
    scraped: bool = False
    prompt_tokens: float = 0.0
    hit_tokens: dict[str, float] = field(default_factory=dict)
    ttft: Buckets = field(default_factory=Buckets)
    step: Buckets = field(default_factory=Buckets)


@dataclass(slots=True)
class GatewayStats:
    """The gateway replicas together (histograms and counters summed).

    Attributes:
        replicas: Replicas that answered / asked for.
        requests: Requests answered per HTTP status (cumulative).
        ttft: Observed time to first token.
        predicted: The policy's predicted TTFT of the chosen worker.
        cache_aware: Replicas routing cache-aware (the others route by load only).
    """

    replicas: tuple[int, int] = (0, 0)
    requests: dict[str, float] = field(default_factory=dict)
    ttft: Buckets = field(default_factory=Buckets)
    predicted: Buckets = field(default_factory=Buckets)
    cache_aware: int = 0


@dataclass(slots=True)
class IndexStats:
    """The indexer: apply lag, hosts it consumes and those waiting for a snapshot."""

    lag: Buckets = field(default_factory=Buckets)
    hosts_owned: float = 0.0
    hosts_pending: float = 0.0


@dataclass(slots=True)
class Frame:
    """One look at the cluster."""

    redis: str
    workers: list[WorkerStats] = field(default_factory=list)
    gateway: GatewayStats | None = None
    index: IndexStats | None = None
    errors: list[str] = field(default_factory=list)


def render(frame: Frame, previous: Frame | None = None) -> RenderableType:
    """The frame as tables: workers, then gateway and index figures, then errors.

    With ``previous``, counters and histograms cover the window since it.
    """
    parts: list[RenderableType] = [_workers(frame, previous)]
    summary = Table.grid(padding=(0, 3))
    summary.add_column(style="bold")
    summary.add_column()
    before_gw = previous.gateway if previous else None
    if frame.gateway is not None:
        _gateway_rows(summary, frame.gateway, before_gw)
    if frame.index is not None:
        _index_rows(summary, frame.index, previous.index if previous else None)
    if summary.row_count:
        parts.append(summary)
    for err in frame.errors:
        parts.append(Text(f"! {err}", style="yellow"))
    return Group(*parts)


def _workers(frame: Frame, previous: Frame | None) -> Table:
    table = Table(title=f"kvrouter top — {len(frame.workers)} workers (Redis {frame.redis})",
                  title_justify="left", expand=False)  # fmt: skip
    for name, justify in (
        ("worker", "left"), ("role", "left"), ("run", "right"), ("wait", "right"),
        ("in flight", "right"),
        *((f"KV {m.value}", "right") for m in MEDIA),
        ("hit rate", "right"), ("hit tokens", "right"), ("TTFT p50/p90", "right"),
        ("step p50", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    before = {w.host: w for w in previous.workers} if previous else {}
    for w in sorted(frame.workers, key=lambda w: w.host):
        old = before.get(w.host)
        kv = [_used(w.kv_used.get(m.value, 0), w.kv_capacity.get(m.value, 0)) for m in MEDIA]
        if not w.scraped:
            figures = ["-", "-", "-", "-"]
        else:
            hits = _minus(w.hit_tokens, old.hit_tokens if old else {})
            prompt = w.prompt_tokens - (old.prompt_tokens if old else 0.0)
            if prompt < 0:  # the worker restarted
                hits, prompt = w.hit_tokens, w.prompt_tokens
            ttft = w.ttft.minus(old.ttft) if old else w.ttft
            step = w.step.minus(old.step) if old else w.step
            figures = [
                _ratio(sum(hits.values()), prompt),
                " ".join(f"{m}:{n:.0f}" for m, n in sorted(hits.items()) if n) or "0",
                _pair(ttft),
                _seconds(step.quantile(0.5)),
            ]
        table.add_row(
            w.host, w.role, str(w.running), str(w.waiting), str(w.in_flight), *kv, *figures
        )
    return table


def _gateway_rows(grid: Table, gw: GatewayStats, old: GatewayStats | None) -> None:
    requests = _minus(gw.requests, old.requests if old else {})
    total = sum(requests.values())
    by_status = ", ".join(f"{s}: {n:.0f}" for s, n in sorted(requests.items()) if n)
    ttft = gw.ttft.minus(old.ttft) if old else gw.ttft
    predicted = gw.predicted.minus(old.predicted) if old else gw.predicted
    answered, asked = gw.replicas
    mode = (
        "cache-aware"
        if gw.cache_aware == answered
        else f"[red]load only on {answered - gw.cache_aware} of {answered}[/]"
    )
    grid.add_row("gateway", f"{answered}/{asked} replicas, routing {mode}")
    grid.add_row("requests", f"{total:.0f} ({by_status})" if by_status else "0")
    grid.add_row("TTFT p50/p90", f"observed {_pair(ttft)}   predicted {_pair(predicted)}")


def _index_rows(grid: Table, ix: IndexStats, old: IndexStats | None) -> None:
    lag = ix.lag.minus(old.lag) if old else ix.lag
    grid.add_row(
        "index", f"apply lag p50/p90 {_pair(lag)}   hosts {ix.hosts_owned:.0f}, "
        f"{ix.hosts_pending:.0f} waiting for a snapshot",
    )  # fmt: skip


def _minus(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    out = {k: v - before.get(k, 0.0) for k, v in now.items()}
    return dict(now) if any(v < 0 for v in out.values()) else out


def _used(used: int, capacity: int) -> str:
    return f"{used}/{capacity}" if capacity else "-"


def _ratio(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "-"


def _pair(b: Buckets) -> str:
    return f"{_seconds(b.quantile(0.5))}/{_seconds(b.quantile(0.9))}"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"
