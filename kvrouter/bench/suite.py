"""The policy comparison: every policy on one trace, and the issue-5 suite over three workloads.

:func:`compare_policies` replays one trace with each policy (a rich progress
bar per run), prints the table, and writes the JSON report and the plots;
``kvrouter bench sim`` is a thin shell over it.

:func:`run_suite` (``kvrouter bench suite``, or ``python -m kvrouter.bench.suite``)
regenerates the figures of docs/benchmarks.md: the chat, groups and agent
workloads of :data:`CASES`, each on 8 workers whose HBM cannot hold the
working set (DRAM and SSD tiers on), at three loads. Load is a fraction of the
cluster's *capacity*, measured with the simulator itself: the trace is replayed
with every arrival compressed into its first second under ``round_robin`` (a
cache-oblivious router), and the capacity is the completed requests per second
of makespan. A load ``L`` then replays the trace at
``time_scale = L * capacity / (trace requests / trace duration)``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvrouter.bench.oracle import OracleBound
from kvrouter.bench.report import (
    BenchReport,
    PolicySummary,
    plot_hit_rates,
    plot_ttft_cdf,
    render_table,
    summarize,
    write_json,
)
from kvrouter.bench.simulator import SimConfig, SimResult, simulate, trace_oracle
from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord
from kvrouter.bench.workloads import (
    AgentWorkload,
    ChatWorkload,
    GroupsWorkload,
    Workload,
    generate,
)
from kvrouter.policy_factory import build_policy
from policies.base import Policy
from policies.registry import DEFAULT_POLICY, policy_names

__all__ = [
    "CASES",
    "LOADS",
    "Comparison",
    "SuiteCase",
    "compare_policies",
    "describe_trace",
    "measure_capacity",
    "parse_policies",
    "run_suite",
]


def parse_policies(spec: str) -> list[str]:
    """``"all"`` or comma-separated registered names, in the given order.

    Raises:
        ValueError: An unknown name (the message lists the valid ones) or an empty list.
    """
    if spec.strip() == "all":
        return policy_names()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = set(policy_names())
    for name in names:
        if name not in known:
            raise ValueError(f"unknown policy {name!r}; valid: all, {', '.join(policy_names())}")
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


def _config_dict(config: SimConfig) -> dict[str, object]:
    out: dict[str, object] = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "profile"
    }
    out["profile"] = config.profile.name
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
) -> Comparison:
    """Replay ``trace`` with each named policy (seeded with ``config.seed``) and report.

    Prints the table; writes ``json_path`` and ``<plots>/<label>_ttft_cdf.png`` and
    ``<plots>/<label>_hit_rate.png`` when given. ``extra`` adds unregistered policies
    (prototypes) by name, run after the named ones.
    """
    builders: list[tuple[str, Callable[[], Policy]]] = [
        (name, functools.partial(build_policy, name, seed=config.seed)) for name in names
    ]
    builders += list((extra or {}).items())
    oracle = trace_oracle(trace, config)
    results: list[SimResult] = []
    columns = (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        for name, build in builders:
            task = progress.add_task(name, total=len(trace))
            policy = build()
            advance = functools.partial(progress.advance, task)
            results.append(simulate(trace, policy, config, progress=advance))
    summaries = [summarize(r.policy, r.records, r.busy_s, oracle) for r in results]
    render_table(
        summaries,
        console,
        title=f"{label}: oracle hit rate {oracle.hit_rate:.1%} "
        f"(infinite cache {oracle.unbounded_hit_rate:.1%}), ms for latencies",
    )
    if json_path is not None:
        oracle_json = {
            "capacity_blocks": float(oracle.capacity_blocks),
            "hit_rate": oracle.hit_rate,
            "unbounded_hit_rate": oracle.unbounded_hit_rate,
        }
        report = BenchReport(
            trace=label, config=_config_dict(config), oracle=oracle_json, summaries=summaries
        )
        write_json(report, json_path)
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        ttfts = {
            r.policy: [t for rec in r.records if (t := rec.ttft_s) is not None] for r in results
        }
        plot_ttft_cdf(ttfts, plots / f"{label}_ttft_cdf.png", title=f"{label}: TTFT")
        plot_hit_rates(summaries, plots / f"{label}_hit_rate.png", oracle, title=f"{label}")
    return Comparison(label, oracle, results, summaries)


@dataclass(frozen=True, slots=True)
class SuiteCase:
    """One workload of the suite and the cluster it runs on (tiers in blocks per worker)."""

    name: str
    workload: Workload
    workers: int
    hbm_blocks: int
    dram_blocks: int
    ssd_blocks: int


#: Sized so that the distinct prompt content exceeds the cluster's HBM (it spills
#: to DRAM and SSD) while one worker's HBM still holds its running batch, that
#: sessions and agents outnumber the requests in flight (a turn comes after its
#: previous answer), and that the whole suite runs in minutes on two cores.
CASES: tuple[SuiteCase, ...] = (
    SuiteCase(
        "chat",
        ChatWorkload(
            sessions=300, turns=4, system_tokens=1024, user_tokens=256, answer_tokens=128,
            think_time_s=30.0, session_rate=40.0,
        ),
        workers=4, hbm_blocks=4096, dram_blocks=8192, ssd_blocks=16384,
    ),
    SuiteCase(
        "groups",
        GroupsWorkload(
            groups=32, users=8, system_tokens=4096, question_tokens=256, output_tokens=128,
            rate=10.0, requests=800,
        ),
        workers=4, hbm_blocks=2560, dram_blocks=4096, ssd_blocks=8192,
    ),
    SuiteCase(
        "agent",
        AgentWorkload(
            agents=24, steps=10, system_tokens=2048, context_min=8192, context_max=32768,
            tool_tokens_min=100, tool_tokens_max=600, output_tokens=64, step_interval_s=20.0,
            agent_rate=4.0,
        ),
        workers=4, hbm_blocks=6144, dram_blocks=12288, ssd_blocks=24576,
    ),
)  # fmt: skip

#: (label, fraction of measured capacity).
LOADS: tuple[tuple[str, float], ...] = (("light", 0.3), ("load70", 0.7), ("load90", 0.9))


def measure_capacity(trace: Sequence[TraceRecord], config: SimConfig) -> float:
    """Requests/s the cluster completes under round_robin with every arrival in the first second."""
    span = (max(r.timestamp for r in trace) - min(r.timestamp for r in trace)) / 1e3
    burst = dataclasses.replace(config, time_scale=max(span, 1.0))
    result = simulate(trace, build_policy("round_robin", seed=config.seed), burst)
    end = max(r.finish_s or 0.0 for r in result.records)
    return len(trace) / end


def _quick(case: SuiteCase) -> SuiteCase:
    w = case.workload
    if isinstance(w, ChatWorkload):
        small: Workload = dataclasses.replace(w, sessions=24, turns=3)
    elif isinstance(w, GroupsWorkload):
        small = dataclasses.replace(w, groups=8, requests=60)
    else:
        small = dataclasses.replace(w, agents=6, steps=4)
    return dataclasses.replace(case, workload=small)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def run_suite(
    out_dir: Path, *, console: Console, quick: bool = False, seed: int = 1
) -> list[dict[str, object]]:
    """Run every case at every load; write plots, ``suite.json`` and print the ratio table.

    Returns:
        One row per (case, load): capacity, time scale, kv_ttft's TTFT p90 against the
        best peer and round robin, and its hit rate against the oracle.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    names = policy_names()
    rows: list[dict[str, object]] = []
    reports: dict[str, object] = {}
    started = time.perf_counter()
    for case in map(_quick, CASES) if quick else CASES:
        trace = generate(case.workload, seed)
        config = SimConfig(
            workers=case.workers,
            hbm_blocks=case.hbm_blocks,
            dram_blocks=case.dram_blocks,
            ssd_blocks=case.ssd_blocks,
            seed=seed,
        )
        console.rule(f"{case.name}: {describe_trace(trace)}")
        capacity = measure_capacity(trace, config)
        span = (trace[-1].timestamp - trace[0].timestamp) / 1e3
        natural = len(trace) / span
        console.print(f"capacity (round_robin, saturated): {capacity:.2f} req/s")
        for label, load in LOADS:
            cfg = dataclasses.replace(config, time_scale=load * capacity / natural)
            name = f"{case.name}_{label}"
            cmp = compare_policies(trace, names, cfg, console=console, label=name, plots=out_dir)
            ours = cmp.summary(DEFAULT_POLICY)
            peers = [s for s in cmp.summaries if s.policy in names and s.policy != DEFAULT_POLICY]
            best = min(peers, key=lambda s: s.ttft_p90_s)
            rr = cmp.summary("round_robin")
            rows.append(
                {
                    "workload": case.name,
                    "load": load,
                    "capacity_rps": capacity,
                    "time_scale": cfg.time_scale,
                    "kv_ttft_p90_s": ours.ttft_p90_s,
                    "best_peer": best.policy,
                    "best_peer_p90_s": best.ttft_p90_s,
                    "p90_vs_best_peer": _ratio(ours.ttft_p90_s, best.ttft_p90_s),
                    "p90_vs_round_robin": _ratio(ours.ttft_p90_s, rr.ttft_p90_s),
                    "hit_rate": ours.hit_rate,
                    "oracle_hit_rate": cmp.oracle.hit_rate,
                    "hit_vs_oracle": ours.hit_vs_oracle,
                }
            )
            reports[name] = {
                "config": _config_dict(cfg),
                "oracle_hit_rate": cmp.oracle.hit_rate,
                "summaries": cmp.summaries,
            }
    table = Table(title=f"kv_ttft against its peers ({time.perf_counter() - started:,.0f} s)")
    columns = ("workload", "load", "p90 / best peer", "best peer", "p90 / RR", "hit / oracle")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(
            str(row["workload"]),
            f"{row['load']:.0%}",
            f"{row['p90_vs_best_peer']:.2f}",
            str(row["best_peer"]),
            f"{row['p90_vs_round_robin']:.2f}",
            f"{row['hit_vs_oracle']:.3f}",
        )
    console.print(table)
    data = {"rows": rows, "runs": reports}
    (out_dir / "suite.json").write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2))
    return rows


if __name__ == "__main__":  # pragma: no cover
    _term = Console()
    run_suite(Path("docs/plots"), console=_term if _term.is_terminal else Console(width=170))
