"""The policy suite: every policy, workload and load; tuned on one set, reported on another.

``kvrouter bench suite`` (or ``python -m kvrouter.bench.suite``) regenerates the
figures of docs/benchmarks.md. Each *run* is a workload of :data:`CASES` and a
seed; each *cell* a run at one load; every registered policy replays every
cell in the simulator (a process pool spreads the replays over the cores).

Two sets of runs, printed apart:

* ``tune`` -- the traces a policy change may be judged on while it is made;
* ``report`` -- other seeds of the same workloads, and three held-out
  workloads (``longchat``, ``rag``, ``returning``) from the same families with
  other parameters, never looked at while tuning. A change that only fits the
  tuning traces shows as a gap between the two. ``returning`` brings sessions
  back as late as the Mooncake conversation trace does, when their histories
  have left HBM (:data:`RETURN_THINK_TIME`).

Load is a fraction of the cluster's *capacity*, measured with the simulator
itself: the trace is replayed with every arrival compressed into its first
second under ``round_robin`` (a cache-oblivious router), and the capacity is
the completed requests per second of makespan. A load ``L`` then replays the
trace at ``time_scale = L * capacity / (trace requests / trace duration)``.
Cache-aware policies serve more than round robin, so a load above 1 is where
they saturate: the production-shaped cases go to 1.4 (at 1.2 the busiest
peer's workers were busy 91-97% of the makespan, drain included). The tables
print the busiest peer's busy share over the makespan and, in parentheses,
while requests arrived: the drain after the last arrival, when fewer and fewer
workers have work left, dilutes the first, not the second.

For every cell the suite prints each policy's summary, then per set: ``kv_ttft``
against the best peer *at each percentile* (the best peer may differ from one
percentile to the next), its hit rate against the oracle, preemptions, and the
prediction error of ``kv_ttft`` (predicted against simulated TTFT) by prompt
length.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine_worker.profiles import default_profile, load_fleet
from indexer.media import MEDIA
from kvrouter.bench.compare import config_dict
from kvrouter.bench.production import think_time
from kvrouter.bench.report import (
    PolicySummary,
    RequestRecord,
    busy_text,
    median_summary,
    plot_ttft_cdf,
    render_table,
    summarize,
)
from kvrouter.bench.simulator import SimConfig, simulate, trace_oracle
from kvrouter.bench.trace import TraceRecord
from kvrouter.bench.workloads import (
    AgentWorkload,
    ChatWorkload,
    ConversationWorkload,
    GroupsWorkload,
    MixedWorkload,
    Workload,
    generate,
)
from kvrouter.policy_factory import build_policy
from policies.registry import DEFAULT_POLICY, check_policy_names, policy_names

__all__ = [
    "ALL_TIERS",
    "CASES",
    "LENGTH_BINS",
    "LOADS",
    "RETURN_THINK_TIME",
    "SETS",
    "CellResult",
    "SuiteCase",
    "measure_capacity",
    "parse_jitter",
    "parse_tiers",
    "prediction_error",
    "run_suite",
]

#: (label, fraction of measured capacity) of the generated workloads.
LOADS: tuple[tuple[str, float], ...] = (("light", 0.3), ("load70", 0.7), ("load90", 0.9))

#: The KV tiers a case's workers have (the media's wire names), unless ``--tiers``
#: takes some away.
ALL_TIERS: tuple[str, ...] = tuple(m.value for m in MEDIA)

#: Loads of the production-shaped workloads: moderate, busy, and saturated.
PRODUCTION_LOADS: tuple[tuple[str, float], ...] = (
    ("load60", 0.6),
    ("load90", 0.9),
    ("saturated", 1.4),
)


#: Think time of the held-out ``returning`` case, fitted to the public Mooncake
#: conversation trace (``kvcache-ai/Mooncake``, ``FAST25-release/traces/
#: conversation_trace.jsonl``), where a conversation's next turn arrives a median of
#: ~100 s after the turn before it, p90 312-372 s, in windows of 870-985 s
#: (docs/benchmarks.md). In the case's 900 s window (turns past it are cut, as a
#: window cuts them), a log-normal think time of median 130 s and sigma 1.2 gives
#: gaps of median 99-113 s and p90 315-320 s (seeds 2 and 3).
RETURN_THINK_TIME = think_time(130.0, 1.2)


@dataclass(frozen=True, slots=True)
class SuiteCase:
    """A workload and the cluster it runs on (tiers in blocks per worker; None: H100-sized)."""

    name: str
    workload: Workload
    workers: int = 8
    hbm_blocks: int | None = None
    dram_blocks: int | None = None
    ssd_blocks: int | None = None
    loads: tuple[tuple[str, float], ...] = LOADS

    def config(
        self,
        seed: int,
        time_scale: float = 1.0,
        tiers: Sequence[str] = ALL_TIERS,
        profiles: Sequence[str] = (),
    ) -> SimConfig:
        """The simulated cluster of this case; its workers lack the lower tiers (DRAM,
        SSD) that ``tiers`` leaves out (HBM-only workers: vLLM or SGLang without KV
        offloading), and with several ``profiles`` (packaged names or files) they are a
        mixed fleet, taking them in turn."""
        fleet = load_fleet(profiles) if profiles else [default_profile()]
        return SimConfig(
            profile=fleet[0],
            worker_profiles=tuple(fleet) if len(fleet) > 1 else (),
            workers=self.workers,
            hbm_blocks=self.hbm_blocks,
            dram_blocks=self.dram_blocks if "dram" in tiers else 0,
            ssd_blocks=self.ssd_blocks if "ssd" in tiers else 0,
            seed=seed,
            time_scale=time_scale,
        )


#: The generated workloads are sized so that the distinct prompt content exceeds the
#: cluster's HBM (it spills to DRAM and SSD) while one worker's HBM still holds its
#: running batch. The production-shaped ones run on 8 H100-sized workers (Llama-3-8B:
#: 427K tokens of HBM each), where a few 100K-token prompts fill a worker.
CASES: dict[str, SuiteCase] = {
    c.name: c
    for c in (
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
                tool_tokens_min=100, tool_tokens_max=600, output_tokens=64,
                step_interval_s=20.0, agent_rate=4.0,
            ),
            workers=4, hbm_blocks=6144, dram_blocks=12288, ssd_blocks=24576,
        ),
        SuiteCase("conversation", ConversationWorkload(), loads=PRODUCTION_LOADS),
        SuiteCase("mixed", MixedWorkload(), loads=PRODUCTION_LOADS),
        # Held out: the same families with other shapes, only ever in the report set.
        SuiteCase(
            "longchat",
            ConversationWorkload(
                sessions=500, turns_mean=3.5, arrival_shape=0.3, apps=4, documents=80,
                document_share=0.2, paste_share=0.35, session_rate=0.5,
            ),
            loads=PRODUCTION_LOADS,
        ),
        SuiteCase(
            "rag",
            MixedWorkload(requests=2500, rate=3.0, arrival_shape=1.0, long_share=0.2,
                          documents=300, apps=6),
            loads=PRODUCTION_LOADS,
        ),
        # Sessions that come back as late as the Mooncake conversation trace's do (a turn
        # a median of ~100 s after the last, p90 ~320 s, against ~16 s in `conversation`):
        # ~300 requests arrive in between, and a history has often left HBM.
        SuiteCase(
            "returning",
            ConversationWorkload(sessions=1800, session_rate=2.0, think_time_s=RETURN_THINK_TIME,
                                 horizon_s=900.0),
            loads=PRODUCTION_LOADS,
        ),
    )
}  # fmt: skip

#: (case, seed) runs of each set.
SETS: dict[str, tuple[tuple[str, int], ...]] = {
    "tune": (("chat", 1), ("groups", 1), ("agent", 1), ("conversation", 1), ("mixed", 1)),
    "report": (
        ("chat", 2), ("groups", 2), ("agent", 2), ("conversation", 2), ("conversation", 3),
        ("mixed", 2), ("mixed", 3), ("longchat", 2), ("rag", 2), ("returning", 2),
    ),
}  # fmt: skip

#: Prompt-length bins (tokens) of the prediction-error table.
LENGTH_BINS: tuple[int, ...] = (0, 2_048, 8_192, 32_768, 65_536, 131_072, 1 << 30)


def measure_capacity(trace: Sequence[TraceRecord], config: SimConfig) -> float:
    """Requests/s the cluster completes under round_robin with every arrival in the first second."""
    span = (max(r.timestamp for r in trace) - min(r.timestamp for r in trace)) / 1e3
    burst = dataclasses.replace(config, time_scale=max(span, 1.0))
    result = simulate(trace, build_policy("round_robin", seed=config.seed), burst)
    end = max(r.finish_s or 0.0 for r in result.records)
    return len(trace) / end


def _quick(case: SuiteCase) -> SuiteCase:
    w = case.workload
    small: Workload
    if isinstance(w, ChatWorkload):
        small = dataclasses.replace(w, sessions=24, turns=3)
    elif isinstance(w, GroupsWorkload):
        small = dataclasses.replace(w, groups=8, requests=60)
    elif isinstance(w, AgentWorkload):
        small = dataclasses.replace(w, agents=6, steps=4)
    elif isinstance(w, ConversationWorkload):
        small = dataclasses.replace(w, sessions=40)
    else:
        small = dataclasses.replace(w, requests=80)
    return dataclasses.replace(case, workload=small)


def _case(name: str, quick: bool, workers: int | None = None) -> SuiteCase:
    """The case ``name`` (tiny with ``quick``), on ``workers`` workers instead of its own."""
    case = CASES[name]
    if workers is not None:
        case = dataclasses.replace(case, workers=workers)
    return _quick(case) if quick else case


# -- replays (run in worker processes: module-level functions of picklable arguments) ------


def _trace(name: str, seed: int, quick: bool) -> list[TraceRecord]:
    return generate(_case(name, quick).workload, seed)


def _capacity(
    name: str,
    seed: int,
    quick: bool,
    tiers: Sequence[str] = ALL_TIERS,
    profiles: Sequence[str] = (),
    workers: int | None = None,
) -> tuple[float, float]:
    """(capacity, natural rate) of a run, in requests/s."""
    trace = _trace(name, seed, quick)
    span = (trace[-1].timestamp - trace[0].timestamp) / 1e3
    config = _case(name, quick, workers).config(seed, tiers=tiers, profiles=profiles)
    capacity = measure_capacity(trace, config)
    return capacity, len(trace) / max(span, 1e-9)


#: A replay's records, busy time per worker, and busy time per worker while requests arrived.
_Replayed = tuple[list[RequestRecord], dict[str, float], dict[str, float]]
_Pending = tuple["_Run", str, float, float, dict[tuple[str, int], Future[_Replayed]], Future[float]]


def _replay(
    name: str,
    seed: int,
    quick: bool,
    time_scale: float,
    policy: str,
    view_interval_s: float = 0.0,
    jitter: int = 0,
    tiers: Sequence[str] = ALL_TIERS,
    profiles: Sequence[str] = (),
    workers: int | None = None,
) -> _Replayed:
    trace = _trace(name, seed, quick)
    config = _case(name, quick, workers).config(seed, time_scale, tiers, profiles)
    config = dataclasses.replace(config, view_interval_s=view_interval_s, jitter=jitter)
    result = simulate(trace, build_policy(policy, seed=seed), config)
    return result.records, result.busy_s, result.busy_arrivals_s


def _oracle(
    name: str,
    seed: int,
    quick: bool,
    time_scale: float,
    tiers: Sequence[str] = ALL_TIERS,
    profiles: Sequence[str] = (),
    workers: int | None = None,
) -> float:
    trace = _trace(name, seed, quick)
    config = _case(name, quick, workers).config(seed, time_scale, tiers, profiles)
    return trace_oracle(trace, config).hit_rate


# -- results ------------------------------------------------------------------------------


class CellResult(msgspec.Struct, kw_only=True):
    """Every policy on one run at one load.

    Attributes:
        set: ``tune`` or ``report``.
        case: Workload name.
        seed: Trace seed.
        load_label: The load's name.
        load: Fraction of the measured capacity.
        capacity_rps: Measured capacity (round robin, saturated).
        time_scale: Arrival-rate multiplier of the replay.
        oracle_hit_rate: The oracle bound's hit rate.
        summaries: Per policy, its figures (with several perturbations, the median of
            its runs' figures: :func:`~kvrouter.bench.report.median_summary`).
        prediction: ``kv_ttft``'s (prompt tokens, predicted, simulated TTFT) per request
            (of the first perturbation's run).
        jitter: The arrival perturbations the cell was replayed under (``SimConfig.jitter``).
        runs: With several perturbations, each one's summaries, in ``jitter`` order
            (empty for one).
    """

    set: str
    case: str
    seed: int
    load_label: str
    load: float
    capacity_rps: float
    time_scale: float
    oracle_hit_rate: float
    summaries: list[PolicySummary]
    prediction: list[tuple[int, float, float]] = msgspec.field(default_factory=list)
    jitter: list[int] = msgspec.field(default_factory=lambda: [0])
    runs: list[list[PolicySummary]] = msgspec.field(default_factory=list)

    @property
    def label(self) -> str:
        """``<case>_s<seed>_<load>``: the cell's name in tables and plot files."""
        return f"{self.case}_s{self.seed}_{self.load_label}"

    def summary(self, policy: str) -> PolicySummary:
        """The named policy's summary (KeyError if it did not run)."""
        for s in self.summaries:
            if s.policy == policy:
                return s
        raise KeyError(policy)


#: The percentiles compared against the best peer, with their summary fields.
PERCENTILES: tuple[tuple[str, str], ...] = (
    ("p50", "ttft_p50_s"),
    ("p90", "ttft_p90_s"),
    ("p99", "ttft_p99_s"),
    ("mean", "ttft_mean_s"),
)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def versus_best_peer(cell: CellResult, ours: str = DEFAULT_POLICY) -> dict[str, object]:
    """``ours`` against the best peer at each percentile of one cell (a JSON-ready row)."""
    mine = cell.summary(ours)
    peers = [s for s in cell.summaries if s.policy != ours]
    row: dict[str, object] = {
        "set": cell.set,
        "cell": cell.label,
        "load": cell.load,
        "busy_peers": max((s.busy_share for s in peers), default=0.0),
        # Stored cells summarized before this was measured have None here.
        "busy_peers_arriving": max(
            (s.busy_share_arrivals for s in peers if s.busy_share_arrivals is not None),
            default=None,
        ),
        "hit_vs_oracle": mine.hit_vs_oracle,
        "preemptions": mine.preemptions,
        "preemptions_best_peer": min((s.preemptions for s in peers), default=0),
    }
    for name, attr in PERCENTILES:
        best, ratio = _versus(cell.summaries, ours, attr)
        row[f"{name}_s"] = getattr(mine, attr)
        row[f"{name}_best_peer"] = best.policy
        row[f"{name}_vs_best_peer"] = ratio
        if cell.runs:
            row[f"{name}_behind_runs"] = sum(_versus(r, ours, attr)[1] > 1.0 for r in cell.runs)
    if cell.runs:
        row["runs"] = len(cell.runs)
    return row


def _versus(
    summaries: Sequence[PolicySummary], ours: str, attr: str
) -> tuple[PolicySummary, float]:
    """The peer best at ``attr`` among ``summaries``, and ``ours`` / that peer."""
    mine = next(s for s in summaries if s.policy == ours)
    best = min((s for s in summaries if s.policy != ours), key=lambda s: getattr(s, attr))
    return best, _ratio(getattr(mine, attr), getattr(best, attr))


def prediction_error(
    samples: Sequence[tuple[int, float, float]], bins: Sequence[int] = LENGTH_BINS
) -> list[dict[str, float]]:
    """Simulated against predicted TTFT by prompt length: one row per non-empty bin.

    Each row: ``lo`` / ``hi`` tokens, ``n``, the median and p90 of simulated /
    predicted, and the median and p90 of the absolute error in seconds.
    """
    rows = []
    for lo, hi in itertools.pairwise(bins):
        inside = [(p, a) for n, p, a in samples if lo <= n < hi and p > 0]
        if not inside:
            continue
        ratio = np.array([a / p for p, a in inside])
        error = np.abs(np.array([a - p for p, a in inside]))
        rows.append(
            {
                "lo": float(lo),
                "hi": float(hi),
                "n": float(len(inside)),
                "ratio_p50": float(np.percentile(ratio, 50)),
                "ratio_p90": float(np.percentile(ratio, 90)),
                "abs_error_p50_s": float(np.percentile(error, 50)),
                "abs_error_p90_s": float(np.percentile(error, 90)),
            }
        )
    return rows


# -- the run --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Run:
    set: str
    case: str
    seed: int
    capacity: Future[tuple[float, float]]


def run_suite(
    out_dir: Path,
    *,
    console: Console,
    quick: bool = False,
    sets: Sequence[str] = ("tune", "report"),
    only: Sequence[str] = (),
    jobs: int | None = None,
    plots: bool = True,
    loads: Sequence[str] = (),
    view_interval_s: float = 0.0,
    seeds: Sequence[int] = (),
    jitter: Sequence[int] = (0,),
    tiers: Sequence[str] = ALL_TIERS,
    profiles: Sequence[str] = (),
    policies: Sequence[str] = (),
    cluster_size: int | None = None,
) -> list[CellResult]:
    """Replay every selected run with every policy at its loads; print and write the results.

    Args:
        out_dir: Where ``suite.json`` and the TTFT plots go.
        console: Where the tables go.
        quick: Tiny traces (a smoke run).
        sets: Which sets to run (``tune``, ``report``).
        only: Restrict to these workload names (all when empty).
        jobs: Replays run in parallel (default: the machine's cores).
        plots: Draw a TTFT CDF per cell of the report set's first seed of each workload.
        loads: Restrict to these load labels (all when empty).
        view_interval_s: The routers' heartbeat period (0: exact views at each routing;
            1.0 is the workers' default heartbeat, what a live gateway sees).
        seeds: Instead of ``sets``, replay these seeds of every selected workload, as
            one set named ``seeds``: traces the stored tables never held, to check that
            a result holds beyond the seeds it was measured on.
        jitter: Replay every cell's arrivals under each of these perturbations
            (``SimConfig.jitter``: each arrival up to 1 ms later; 0 replays them as they
            are). With several, a cell's figures are the medians over its runs and the
            ratio table says in how many runs ``kv_ttft`` was behind: differences between
            policies that outlast the luck of one trajectory.
        tiers: The KV tiers every worker keeps (``hbm`` always; ``dram``, ``ssd``):
            leaving out ``dram`` and ``ssd`` replays every cell on workers without KV
            offloading, a cluster the policies were not tuned on. Capacity, loads and
            the oracle are measured on that cluster.
        profiles: Timing profiles (packaged names or files): one replaces the H100
            profile of every worker, several make every case a mixed fleet whose
            workers take them in turn (``SimConfig.worker_profiles``; e.g.
            ``llama3_8b_h100,llama3_8b_a100``: every other worker an A100). Capacity,
            loads and the oracle are measured on that fleet.
        policies: Replay only these policies (all registered ones when empty):
            ``kv_ttft`` and at least one peer. The best peer of a cell is then the best
            of these, so leave out only peers that are never best (with several
            perturbations a full suite is hours on a small machine).
        cluster_size: Replay every case on this many workers instead of its own (4 for
            the generated cases, 8 for the production-shaped ones): a cluster size the
            policies were not tuned on. Capacity, loads and the oracle are measured on
            that cluster.

    Raises:
        ValueError: Nothing selected (an unknown set, workload or load label), a
            negative view interval, seed or jitter, no jitter, tiers without ``hbm`` or
            with an unknown name; a profile that does not load, or profiles of
            different models; unknown policies, or a selection without ``kv_ttft``
            and a peer; a cluster size below 1.

    Returns:
        One result per cell, in set, run and load order.
    """
    started = time.perf_counter()
    names = _check_policies(policies)
    if bad_seeds := [x for x in seeds if x < 0]:
        raise ValueError(f"seeds must be >= 0, got {', '.join(map(str, bad_seeds))}")
    if seeds:
        once = dict.fromkeys(seeds)
        selected = [("seeds", case, seed) for case in (only or CASES) for seed in once]
    else:
        selected = [
            (s, case, seed) for s in sets for case, seed in SETS[s] if not only or case in only
        ]
    if not selected:
        raise ValueError("no run selected")
    labels = {label for _, case, _ in selected for label, _ in _case(case, quick).loads}
    if bad := [x for x in loads if x not in labels]:
        have = ", ".join(sorted(labels))
        raise ValueError(f"unknown load {', '.join(bad)}; the runs have {have}")
    if not view_interval_s >= 0:
        raise ValueError(f"view interval must be >= 0, got {view_interval_s}")
    if bad_jitter := [x for x in jitter if x < 0]:
        raise ValueError(f"jitter must be >= 0, got {', '.join(map(str, bad_jitter))}")
    jitters = list(dict.fromkeys(jitter))
    if not jitters:
        raise ValueError("no jitter to replay under (0 replays the trace as it is)")
    tiers = _check_tiers(tiers)
    if cluster_size is not None and cluster_size < 1:
        raise ValueError(f"cluster size must be >= 1, got {cluster_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    profiles = tuple(profiles)
    # Loading the fleet here refuses a bad profile name, or a mix of models, before
    # any replay starts.
    _case(selected[0][1], quick).config(0, profiles=profiles)
    workers = jobs or os.cpu_count() or 1
    cells: list[CellResult] = []
    columns = (
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with ProcessPoolExecutor(workers) as pool, Progress(*columns, console=console) as progress:
        runs = [
            _Run(s, c, seed, pool.submit(_capacity, c, seed, quick, tiers, profiles, cluster_size))
            for s, c, seed in selected
        ]
        pending: list[_Pending] = []
        for run in runs:
            capacity, natural = run.capacity.result()
            for label, load in _case(run.case, quick, cluster_size).loads:
                if loads and label not in loads:
                    continue
                scale = load * capacity / natural
                replays: dict[tuple[str, int], Future[_Replayed]] = {
                    (p, k): pool.submit(
                        _replay,
                        run.case,
                        run.seed,
                        quick,
                        scale,
                        p,
                        view_interval_s,
                        k,
                        tiers,
                        profiles,
                        cluster_size,
                    )
                    for k in jitters
                    for p in names
                }
                oracle = pool.submit(
                    _oracle, run.case, run.seed, quick, scale, tiers, profiles, cluster_size
                )
                pending.append((run, label, load, scale, replays, oracle))
        task = progress.add_task("replays", total=sum(len(p[4]) for p in pending))
        plotted = _plotted()
        for run, label, load, scale, replays, oracle in pending:
            hit = oracle.result()
            by_jitter: dict[int, list[PolicySummary]] = {k: [] for k in jitters}
            prediction: list[tuple[int, float, float]] = []
            ttfts: dict[str, list[float]] = {}
            for (policy, k), future in replays.items():
                records, busy_s, arriving = future.result()
                s = summarize(policy, records, busy_s, busy_arrivals_s=arriving)
                ratio = s.hit_rate / hit if hit > 0 else None
                s = msgspec.structs.replace(s, oracle_hit_rate=hit, hit_vs_oracle=ratio)
                by_jitter[k].append(s)
                first = k == jitters[0]
                if policy == DEFAULT_POLICY and first:
                    prediction = [
                        (r.prompt_tokens, r.predicted_ttft_s, r.ttft_s)
                        for r in records
                        if r.predicted_ttft_s is not None and r.ttft_s is not None
                    ]
                if first and plots and plotted.get(run.case) == run.seed and run.set == "report":
                    ttfts[policy] = [t for r in records if (t := r.ttft_s) is not None]
                progress.advance(task)
            per_run = list(by_jitter.values())
            summaries = [median_summary([r[i] for r in per_run]) for i in range(len(names))]
            capacity, _ = run.capacity.result()
            cell = CellResult(
                set=run.set, case=run.case, seed=run.seed, load_label=label, load=load,
                capacity_rps=capacity, time_scale=scale, oracle_hit_rate=hit,
                summaries=summaries, prediction=prediction, jitter=jitters,
                runs=per_run if len(per_run) > 1 else [],
            )  # fmt: skip
            cells.append(cell)
            if ttfts:
                path = out_dir / f"{cell.label}_ttft_cdf.png"
                plot_ttft_cdf(ttfts, path, title=f"{cell.label}: TTFT")
    _print(cells, console, time.perf_counter() - started)
    _write(cells, out_dir / "suite.json", view_interval_s, jitters, tiers, profiles, cluster_size)
    return cells


def _print(cells: Sequence[CellResult], console: Console, seconds: float) -> None:
    for cell in cells:
        title = (
            f"{cell.set} set, {cell.label}: {cell.load:.0%} of {cell.capacity_rps:.2f} req/s, "
            f"oracle hit {cell.oracle_hit_rate:.1%}, ms for latencies"
        )
        if cell.runs:
            title += f", medians of {len(cell.runs)} runs (jitter {_ranges(cell.jitter)})"
        render_table(cell.summaries, console, title=title)
    for name in dict.fromkeys(c.set for c in cells):
        rows = [versus_best_peer(c) for c in cells if c.set == name]
        _print_ratios(name, rows, console)
        samples = [s for c in cells if c.set == name for s in c.prediction]
        _print_prediction(name, prediction_error(samples), console)
    console.print(f"suite: {len(cells)} cells in {seconds:,.0f} s")


def _print_ratios(name: str, rows: Sequence[dict[str, object]], console: Console) -> None:
    table = Table(title=f"{name} set: {DEFAULT_POLICY} / best peer at each percentile")
    for col in (
        "cell",
        "peers busy (arriving)",
        "p50",
        "p90",
        "p99",
        "mean",
        "hit/oracle",
        "preempt.",
    ):
        table.add_column(col, justify="left" if col == "cell" else "right")
    worse = always = 0
    for row in rows:
        ratios = [float(row[f"{p}_vs_best_peer"]) for p, _ in PERCENTILES]  # type: ignore[arg-type]
        worse += any(r > 1.0 for r in ratios[:3])
        runs = row.get("runs")
        behind = [f" {row[f'{p}_behind_runs']}/{runs}" if runs else "" for p, _ in PERCENTILES]
        always += bool(runs) and any(row[f"{p}_behind_runs"] == runs for p, _ in PERCENTILES[:3])
        table.add_row(
            str(row["cell"]),
            busy_text(row["busy_peers"], row.get("busy_peers_arriving")),  # type: ignore[arg-type]
            *(
                f"{r:.2f} {row[f'{p}_best_peer']}"[:24] + b
                for r, (p, _), b in zip(ratios, PERCENTILES, behind, strict=True)
            ),
            f"{row['hit_vs_oracle']:.3f}",
            f"{row['preemptions']} / {row['preemptions_best_peer']}",
        )
    console.print(table)
    several = any(row.get("runs") for row in rows)
    on = " on the medians" if several else ""
    console.print(f"{name} set: cells where {DEFAULT_POLICY} is behind a peer at p50, p90 or p99"
                  f"{on}: {worse} of {len(rows)}")  # fmt: skip
    if several:
        console.print(f"{name} set: cells where it is behind at one of them in every run: "
                      f"{always} of {len(rows)} (n/m: behind in n of m runs)")  # fmt: skip


def _print_prediction(name: str, rows: Sequence[dict[str, float]], console: Console) -> None:
    table = Table(
        title=f"{name} set: {DEFAULT_POLICY}: simulated / predicted TTFT by prompt length"
    )
    for col in ("prompt tokens", "requests", "ratio p50", "ratio p90", "|err| p50", "|err| p90"):
        table.add_column(col, justify="right")
    for r in rows:
        hi = "" if r["hi"] >= 1 << 30 else f"{r['hi']:,.0f}"
        table.add_row(
            f"{r['lo']:,.0f}-{hi}",
            f"{r['n']:,.0f}",
            f"{r['ratio_p50']:.2f}",
            f"{r['ratio_p90']:.2f}",
            f"{r['abs_error_p50_s'] * 1e3:,.0f} ms",
            f"{r['abs_error_p90_s'] * 1e3:,.0f} ms",
        )
    console.print(table)


def _plotted() -> dict[str, int]:
    """Per workload, the seed whose cells get a TTFT CDF plot: its first in the report set."""
    first: dict[str, int] = {}
    for case, seed in SETS["report"]:
        first.setdefault(case, seed)
    return first


def _ranges(values: Sequence[int]) -> str:
    """``0-4,7``: sorted integers with runs of consecutive ones shortened."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def parse_jitter(spec: str) -> list[int]:
    """``"0-4"``, ``"3"`` or ``"0,2,5-6"``: the perturbations to replay under.

    Raises:
        ValueError: Not integers and ranges, a range that runs backwards, or none.
    """
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(
                f"jitter is k, a range a-b or a comma list of them; got {spec!r}"
            ) from None
        if b < a:
            raise ValueError(f"jitter range {part!r} runs backwards")
        out.extend(range(a, b + 1))
    return list(dict.fromkeys(out))


def parse_tiers(spec: str) -> tuple[str, ...]:
    """``hbm,dram,ssd`` -> the tiers every worker keeps, in that order.

    Raises:
        ValueError: An unknown tier, or no ``hbm``.
    """
    return _check_tiers([t.strip().lower() for t in spec.split(",") if t.strip()])


def _check_policies(policies: Sequence[str]) -> list[str]:
    """The policies a suite replays: all registered ones, or the selection (once each, in
    the registry's order) when it holds ``kv_ttft`` and a peer to compare it with."""
    names = policy_names()
    if not policies:
        return names
    check_policy_names(policies)
    chosen = [n for n in names if n in policies]
    if DEFAULT_POLICY not in chosen or len(chosen) < 2:
        raise ValueError(f"the suite compares {DEFAULT_POLICY} with peers: name it and a peer")
    return chosen


def _check_tiers(tiers: Sequence[str]) -> tuple[str, ...]:
    if bad := [t for t in tiers if t not in ALL_TIERS]:
        raise ValueError(f"unknown tier {', '.join(bad)}; tiers are {', '.join(ALL_TIERS)}")
    if "hbm" not in tiers:
        raise ValueError("tiers must include hbm (where every worker computes)")
    return tuple(t for t in ALL_TIERS if t in tiers)


def _write(
    cells: Sequence[CellResult],
    path: Path,
    view_interval_s: float = 0.0,
    jitter: Sequence[int] = (0,),
    tiers: Sequence[str] = ALL_TIERS,
    profiles: Sequence[str] = (),
    cluster_size: int | None = None,
) -> None:
    data = {
        "rows": [versus_best_peer(c) for c in cells],
        "prediction_error": {
            name: prediction_error([s for c in cells if c.set == name for s in c.prediction])
            for name in dict.fromkeys(c.set for c in cells)
        },
        "cells": [msgspec.structs.replace(c, prediction=[]) for c in cells],
        "config": {
            name: config_dict(
                dataclasses.replace(
                    case.config(0, tiers=tiers, profiles=profiles),
                    view_interval_s=view_interval_s,
                    jitter=0,
                )
            )
            | {"jitter": list(jitter)}
            for name, case in ((n, _case(n, False, cluster_size)) for n in CASES)
        },
    }
    path.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2))


if __name__ == "__main__":  # pragma: no cover
    _term = Console()
    run_suite(Path("docs/plots"), console=_term if _term.is_terminal else Console(width=170))
