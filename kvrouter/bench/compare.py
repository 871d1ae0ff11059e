"""Every policy replayed on one trace: the comparison ``kvrouter bench sim`` prints.

:func:`compare_policies` replays one trace with each policy (a rich progress
bar per run), prints the table, and writes the JSON report and the plots.
Under several arrival perturbations (``jitter``) each policy is replayed once
per perturbation and the table holds the medians, with each run's percentiles
beside them: on a real trace a p99 set by a few long prompts can move by 10%
with arrivals moved by under a millisecond (Mooncake's synthetic trace on
HBM-only workers, docs/benchmarks.md, "2026-12-06 (fourth)"), and one
trajectory's luck is not a difference between policies.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvrouter.bench.oracle import OracleBound
from kvrouter.bench.report import (
    BenchReport,
    PolicySummary,
    median_summary,
    plot_hit_rates,
    plot_ttft_cdf,
    render_table,
    summarize,
    write_json,
)
from kvrouter.bench.simulator import SimConfig, SimResult, simulate, trace_oracle
from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord
from kvrouter.policy_factory import build_policy
from policies.base import Policy
from policies.registry import check_policy_names, policy_names

__all__ = ["Comparison", "compare_policies", "config_dict", "describe_trace", "parse_policies"]


def parse_policies(spec: str) -> list[str]:
    """``"all"`` or comma-separated registered names, in the given order.

    Raises:
        ValueError: An unknown name (the message lists the valid ones) or an empty list.
    """
    if spec.strip() == "all":
        return policy_names()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    check_policy_names(names, also=["all"])
    if not names:
        raise ValueError("no policy given")
    return names


def describe_trace(records: Sequence[TraceRecord]) -> str:
    """One line: requests, duration, rate, mean prompt and output, distinct prompt content."""
    if not records:
        return "no request"
    span = (max(r.timestamp for r in records) - min(r.timestamp for r in records)) / 1e3
    distinct = len({h for r in records for h in r.hash_ids}) * HASH_BLOCK_TOKENS
    n = len(records)
    return (
        f"{n} requests over {span:,.1f} s ({n / span if span > 0 else 0:.2f}/s), "
        f"mean prompt {sum(r.input_length for r in records) / n:,.0f} tokens, "
        f"mean output {sum(r.output_length for r in records) / n:,.0f}, "
        f"distinct prompt content ~{distinct:,} tokens"
    )


def config_dict(config: SimConfig) -> dict[str, object]:
    """The cluster's settings as JSON-ready values (the profile by name, tiers in blocks)."""
    out: dict[str, object] = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in ("profile", "worker_profiles")
    }
    out["profile"] = config.profile.name
    out["worker_profiles"] = [p.name for p in config.worker_profiles]
    cap = config.capacity()
    out["capacity_blocks"] = {"hbm": cap.hbm, "dram": cap.dram, "ssd": cap.ssd}
    return out


@dataclass(slots=True)
class Comparison:
    """Every policy's replay of one trace on one cluster."""

    label: str
    oracle: OracleBound
    results: list[SimResult]
    summaries: list[PolicySummary]
    #: With several perturbations: each one's summaries, in the order of the call's
    #: ``jitter`` (the summaries above are their medians, the results the first one's).
    runs: list[list[PolicySummary]] = dataclasses.field(default_factory=list)

    def summary(self, policy: str) -> PolicySummary:
        """The named policy's summary (KeyError if it did not run)."""
        for s in self.summaries:
            if s.policy == policy:
                return s
        raise KeyError(policy)


def compare_policies(
    trace: Sequence[TraceRecord],
    names: Sequence[str],
    config: SimConfig,
    *,
    console: Console,
    label: str = "trace",
    json_path: Path | None = None,
    plots: Path | None = None,
    extra: Mapping[str, Callable[[], Policy]] | None = None,
    jitter: Sequence[int] = (),
) -> Comparison:
    """Replay ``trace`` with each named policy (seeded with ``config.seed``) and report.

    Prints the table; writes ``json_path`` and ``<plots>/<label>_ttft_cdf.png`` and
    ``<plots>/<label>_hit_rate.png`` when given. ``extra`` adds unregistered policies
    (prototypes) by name, run after the named ones. ``jitter``: replay each policy
    under each of these perturbations (``SimConfig.jitter``) instead of the config's
    one; with several, the table and report hold each policy's medians
    (:func:`~kvrouter.bench.report.median_summary`) and every run's TTFT percentiles
    are printed too; the plots are the first perturbation's.

    Raises:
        ValueError: A negative perturbation (refused by ``SimConfig`` before any replay).
    """
    perturbations = list(dict.fromkeys(jitter)) or [config.jitter]
    configs = [dataclasses.replace(config, jitter=k) for k in perturbations]
    builders: list[tuple[str, Callable[[], Policy]]] = [
        (name, functools.partial(build_policy, name, seed=config.seed)) for name in names
    ]
    builders += list((extra or {}).items())
    oracle = trace_oracle(trace, config)
    results: list[SimResult] = []
    runs: list[list[PolicySummary]] = []
    columns = (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        for k, run_config in zip(perturbations, configs, strict=True):
            replays: list[SimResult] = []
            for name, build in builders:
                shown = name if len(perturbations) == 1 else f"{name} (jitter {k})"
                task = progress.add_task(shown, total=len(trace))
                advance = functools.partial(progress.advance, task)
                replays.append(simulate(trace, build(), run_config, progress=advance))
            run = [
                summarize(r.policy, r.records, r.busy_s, oracle, r.busy_arrivals_s) for r in replays
            ]
            runs.append(run)
            results = results or replays
    summaries = [median_summary([run[i] for run in runs]) for i in range(len(builders))]
    several = len(perturbations) > 1
    ks = ",".join(map(str, perturbations))
    median = f"median of {len(runs)} replays (jitter {ks}), " if several else ""
    render_table(
        summaries,
        console,
        title=f"{label}: {median}oracle hit rate {oracle.hit_rate:.1%} "
        f"(infinite cache {oracle.unbounded_hit_rate:.1%}), ms for latencies",
    )
    if several:
        _render_runs(runs, perturbations, console)
    if json_path is not None:
        oracle_json = {
            "capacity_blocks": float(oracle.capacity_blocks),
            "hit_rate": oracle.hit_rate,
            "unbounded_hit_rate": oracle.unbounded_hit_rate,
        }
        config_json = config_dict(configs[0])
        if several:
            config_json["jitter"] = perturbations
        report = BenchReport(
            trace=label,
            config=config_json,
            oracle=oracle_json,
            summaries=summaries,
            runs=runs if several else [],
        )
        write_json(report, json_path)
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        ttfts = {
            r.policy: [t for rec in r.records if (t := rec.ttft_s) is not None] for r in results
        }
        plot_ttft_cdf(ttfts, plots / f"{label}_ttft_cdf.png", title=f"{label}: TTFT")
        plot_hit_rates(summaries, plots / f"{label}_hit_rate.png", oracle, title=f"{label}")
    return Comparison(label, oracle, results, summaries, runs if several else [])


def _render_runs(
    runs: Sequence[Sequence[PolicySummary]], perturbations: Sequence[int], console: Console
) -> None:
    """Each policy's TTFT p50 / p90 / p99 in each replay: how far luck moves them."""
    table = Table(title="TTFT p50 / p90 / p99 (ms) per replay")
    table.add_column("policy")
    for k in perturbations:
        table.add_column(f"jitter {k}", justify="right")
    for i, first in enumerate(runs[0]):
        cells = []
        for run in runs:
            s = run[i]
            cells.append(
                " / ".join(f"{1e3 * v:,.0f}" for v in (s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s))
            )
        table.add_row(first.policy, *cells)
    console.print(table)
