"""The benchmark report: per-request records in, per-policy figures, a table, JSON and plots out.

The offline simulator (``kvrouter bench sim``) and the online replay against
a live cluster (``kvrouter bench live``) both produce
:class:`RequestRecord` lists and per-worker busy time, and both call
:func:`summarize`, so the two reports agree field for field.

Definitions (all times in seconds; a policy's makespan runs from the first
arrival to the last finish):

* TTFT: first token time minus arrival.
* TPOT (time per output token): ``(finish - first token) / (output tokens - 1)``
  over requests with at least two output tokens.
* throughput: completed requests, and output tokens, per second of makespan.
* hit rate: prompt tokens served from a prefix cache over prompt tokens, overall
  and per medium the hit was found on (HBM, DRAM, SSD).
* load imbalance: coefficient of variation (population standard deviation over
  mean) of the workers' busy time; busy share: their mean busy time over the makespan.
  Where the replay measured it (the simulator does), also their mean busy time
  between the first arrival and the last over that window (``busy_share_arrivals``):
  how saturated the cluster was while load was offered. The makespan share counts
  the drain after the last arrival, when fewer and fewer workers still have work,
  so an overloaded replay can be ~99% busy while requests arrive and well under
  that over its makespan.
* oracle: :mod:`kvrouter.bench.oracle`'s bound, and the hit rate as a ratio to it.

Percentiles interpolate linearly between order statistics (numpy's default).
Plots use matplotlib's object API on the Agg canvas (no display, no global state),
imported when a plot is drawn so that the CLI starts fast.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console
from rich.table import Table

from indexer.media import MEDIA
from kvrouter.bench.oracle import OracleBound

__all__ = [
    "BenchReport",
    "PolicySummary",
    "RequestRecord",
    "busy_text",
    "goodput_rps",
    "median_summary",
    "plot_hit_rates",
    "plot_ttft_cdf",
    "render_table",
    "summarize",
    "write_json",
]


@dataclass(slots=True)
class RequestRecord:
    """What one replayed request did.

    Attributes:
        index: Position of the request in the trace.
        worker: Host that served it.
        arrival_s: Arrival time.
        prompt_tokens: Prompt length.
        first_token_s: When its first output token was produced (None if never).
        finish_s: When it finished (None if it did not).
        output_tokens: Tokens generated.
        cached_tokens: Prompt tokens served from cache on (hbm, dram, ssd).
        preemptions: Times it was preempted and recomputed.
        predicted_ttft_s: The policy's TTFT prediction, when it makes one.
        prefill_worker: Host that prefilled it when prefill and decode were split (PD);
            ``worker`` decoded it, and ``cached_tokens`` are what this host's cache
            served. None: colocated.
    """

    index: int
    worker: str
    arrival_s: float
    prompt_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    cached_tokens: tuple[int, int, int] = (0, 0, 0)
    preemptions: int = 0
    predicted_ttft_s: float | None = None
    prefill_worker: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, or None if no token came."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time between output tokens after the first, or None (fewer than 2 tokens)."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


class PolicySummary(msgspec.Struct, kw_only=True):
    """One policy's figures over one run (see the module docstring for definitions)."""

    policy: str
    requests: int
    completed: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    tpot_p90_s: float
    tpot_p50_s: float = math.nan
    tpot_p99_s: float = math.nan
    makespan_s: float
    throughput_rps: float
    output_tps: float
    hit_rate: float
    hit_rate_by_medium: dict[str, float]
    load_cv: float
    busy_s: dict[str, float]
    busy_share: float = 0.0
    busy_share_arrivals: float | None = None
    preemptions: int
    oracle_hit_rate: float | None = None
    hit_vs_oracle: float | None = None


def median_summary(runs: Sequence[PolicySummary]) -> PolicySummary:
    """One policy's figures over several replays of the same cell, field by field.

    Each float field is the median of the runs' values, each count the low median
    (a value one run had), each per-medium or per-worker figure the median per key:
    a percentile that one lucky or unlucky trajectory moved does not move this.

    Raises:
        ValueError: No runs, or runs of different policies.
    """
    if not runs:
        raise ValueError("no runs to summarize")
    if len({r.policy for r in runs}) > 1:
        raise ValueError(f"runs of several policies: {sorted({r.policy for r in runs})}")
    fields: dict[str, object] = {}
    for name in PolicySummary.__struct_fields__:
        values = [getattr(r, name) for r in runs]
        first = values[0]
        if name == "policy" or first is None:
            fields[name] = first
        elif isinstance(first, int):
            fields[name] = statistics.median_low(values)
        elif isinstance(first, float):
            fields[name] = statistics.median(values)
        else:
            keys = dict.fromkeys(k for v in values for k in v)
            fields[name] = {k: statistics.median(v.get(k, 0.0) for v in values) for k in keys}
    return PolicySummary(**fields)  # type: ignore[arg-type]


class BenchReport(msgspec.Struct, kw_only=True):
    """A whole run: what was replayed, on what, the oracle and every policy's summary
    (under several arrival perturbations, the medians, with each replay's in ``runs``,
    in the order of ``config["jitter"]``)."""

    trace: str
    config: dict[str, object]
    oracle: dict[str, float] | None
    summaries: list[PolicySummary]
    runs: list[list[PolicySummary]] = msgspec.field(default_factory=list)


def goodput_rps(records: Sequence[RequestRecord], ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Requests per second of makespan that finished within both SLOs.

    A request counts when its TTFT is at most ``ttft_slo_s`` and its mean time per
    output token at most ``tpot_slo_s`` (one that made a single token meets the
    latter), DistServe's definition of goodput.
    """
    done = [r for r in records if r.finish_s is not None]
    if not done:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s for r in done if r.finish_s is not None)
    good = 0
    for r in done:
        ttft, tpot = r.ttft_s, r.tpot_s
        if ttft is not None and ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s):
            good += 1
    return good / (end - start) if end > start else 0.0


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def summarize(
    policy: str,
    records: Sequence[RequestRecord],
    busy_s: Mapping[str, float],
    oracle: OracleBound | None = None,
    busy_arrivals_s: Mapping[str, float] | None = None,
) -> PolicySummary:
    """Reduce one policy's records and busy times to its figures (``busy_arrivals_s``:
    per worker, its busy time between the first arrival and the last, where measured)."""
    done = [r for r in records if r.finish_s is not None]
    ttft = [t for r in records if (t := r.ttft_s) is not None]
    tpot = [t for r in records if (t := r.tpot_s) is not None]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s for r in done if r.finish_s is not None), default=start)
    makespan = end - start
    prompt = sum(r.prompt_tokens for r in records)
    cached = [sum(r.cached_tokens[m.rank] for r in records) for m in MEDIA]
    by_medium = {m.value: (cached[m.rank] / prompt if prompt else 0.0) for m in MEDIA}
    hit = sum(cached) / prompt if prompt else 0.0
    busy = np.array(list(busy_s.values()), dtype=float)
    cv = float(busy.std() / busy.mean()) if busy.size and busy.mean() > 0 else 0.0
    rate = oracle.hit_rate if oracle is not None else None
    window = max((r.arrival_s for r in records), default=start) - start
    arriving = None
    if busy_arrivals_s and window > 0:
        arriving = float(np.mean(list(busy_arrivals_s.values()))) / window
    return PolicySummary(
        policy=policy,
        requests=len(records),
        completed=len(done),
        ttft_mean_s=_mean(ttft),
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        tpot_mean_s=_mean(tpot),
        tpot_p90_s=_pct(tpot, 90),
        tpot_p50_s=_pct(tpot, 50),
        tpot_p99_s=_pct(tpot, 99),
        makespan_s=makespan,
        throughput_rps=len(done) / makespan if makespan > 0 else 0.0,
        output_tps=sum(r.output_tokens for r in done) / makespan if makespan > 0 else 0.0,
        hit_rate=hit,
        hit_rate_by_medium=by_medium,
        load_cv=cv,
        busy_s=dict(busy_s),
        busy_share=float(busy.mean()) / makespan if busy.size and makespan > 0 else 0.0,
        busy_share_arrivals=arriving,
        preemptions=sum(r.preemptions for r in records),
        oracle_hit_rate=rate,
        hit_vs_oracle=(hit / rate if rate else None),
    )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.0f}"


def busy_text(share: float, arriving: float | None) -> str:
    """A busy share over the makespan, and in parentheses while requests arrived (where
    measured): the form every table prints."""
    return f"{share:.1%}" if arriving is None else f"{share:.1%} ({arriving:.1%})"


def render_table(summaries: Sequence[PolicySummary], console: Console, title: str = "") -> None:
    """Print one row per policy: latency (ms), throughput, hit rates, busy share, preemptions."""
    table = Table(title=title or None, show_lines=False)
    for name in ("policy", "TTFT mean", "p50", "p90", "p99", "TPOT mean", "p90"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    right = (
        "req/s",
        "out tok/s",
        "hit",
        "hbm",
        "dram",
        "ssd",
        "busy (arriving)",
        "busy CV",
        "hit/oracle",
    )
    for name in (*right, "preempt."):
        table.add_column(name, justify="right")
    for s in summaries:
        ratio = "-" if s.hit_vs_oracle is None else f"{s.hit_vs_oracle:.2f}"
        table.add_row(
            s.policy,
            _ms(s.ttft_mean_s),
            _ms(s.ttft_p50_s),
            _ms(s.ttft_p90_s),
            _ms(s.ttft_p99_s),
            _ms(s.tpot_mean_s),
            _ms(s.tpot_p90_s),
            f"{s.throughput_rps:.2f}",
            f"{s.output_tps:,.0f}",
            f"{s.hit_rate:.1%}",
            *(f"{s.hit_rate_by_medium[m.value]:.1%}" for m in MEDIA),
            busy_text(s.busy_share, s.busy_share_arrivals),
            f"{s.load_cv:.2f}",
            ratio,
            str(s.preemptions),
        )
    console.print(table)


def write_json(report: BenchReport, path: str | Path) -> Path:
    """Write the report as indented JSON (NaN, for an empty statistic, becomes null)."""
    target = Path(path)
    target.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    return target


def plot_ttft_cdf(
    ttfts: Mapping[str, Sequence[float]], path: str | Path, title: str = "TTFT"
) -> Path:
    """One empirical CDF of TTFT per policy, log-scaled time axis, as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for policy, values in ttfts.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.step(np.maximum(xs, 1e-3), ys, where="post", label=policy, linewidth=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    target = Path(path)
    fig.savefig(target, dpi=90)
    return target


def plot_hit_rates(
    summaries: Sequence[PolicySummary],
    path: str | Path,
    oracle: OracleBound | None = None,
    title: str = "prefix hit rate",
) -> Path:
    """Hit rate per policy, stacked by medium, with the oracle bound as a line, as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    names = [s.policy for s in summaries]
    bottom = np.zeros(len(summaries))
    for m, color in zip(MEDIA, ("#2b6cb0", "#68a0d8", "#b7cde8"), strict=True):
        part = np.array([s.hit_rate_by_medium[m.value] for s in summaries])
        ax.bar(names, part, bottom=bottom, label=m.value, color=color)
        bottom += part
    if oracle is not None:
        ax.axhline(oracle.hit_rate, color="#c53030", linestyle="--", label="oracle (one LRU)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=30)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    target = Path(path)
    fig.savefig(target, dpi=90)
    return target
