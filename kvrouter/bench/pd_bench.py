"""Prefill/decode disaggregation in the offline simulator: colocated vs PD, same GPU count.

A long-prompt, long-output workload (``mixed`` with 30% document questions of
16K-126K tokens and log-normal answers of median 600 tokens) replayed on 8
Llama-3-8B/H100-sized workers arranged four ways, every arrangement routed by
``kv_ttft``:

* ``colocated``: 8 workers that prefill and decode;
* ``always``: prefill-only + decode-only workers, every request split, at the
  split that serves this workload best: each load replays every split P/D
  (P = 1..7) and keeps the one with the highest goodput, as DistServe places its
  prefill and decode instances by simulating candidate placements (the table
  shows the split kept; ``--split 4/4`` fixes one instead);
* ``auto``: 8 workers, the gateway's planner deciding per request;
* ``auto+pooling``: the same, ``kv_ttft`` also pricing pulls of a peer's prefix.

Loads are fractions of the colocated cluster's capacity under round robin (as
in the suite). Each cell reports TTFT and TPOT p50/p90/p99 and goodput: requests
per second meeting both ``--ttft-slo`` and ``--tpot-slo`` (DistServe's
definition).

    python -m kvrouter.bench.pd_bench pd --jobs 2
    python -m kvrouter.bench.pd_bench pd --capacity 4.8 --only auto,auto+pooling
    python -m kvrouter.bench.pd_bench pooling --jobs 2

``pooling`` replays the suite's ``conversation`` workload (sessions whose
histories grow past 100K tokens; seed 2, 8 workers, H100 tiers) with
``kv_ttft`` alone and with pooling (a worker pulls a session's history from
the peer holding it instead of recomputing), at 0.9 and 1.4 of capacity.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvrouter.bench.production import LogNormal, MixedWorkload
from kvrouter.bench.report import goodput_rps, summarize
from kvrouter.bench.simulator import SimConfig, simulate
from kvrouter.bench.suite import measure_capacity
from kvrouter.bench.workloads import generate
from kvrouter.policy_factory import build_policy

__all__ = ["ARRANGEMENTS", "WORKLOAD", "WORKLOADS", "app", "main", "pooling"]

app = typer.Typer(help=__doc__, no_args_is_help=True)

WORKLOAD = MixedWorkload(
    requests=1200, rate=2.0, long_share=0.3, output_tokens=LogNormal(600, 0.5, 64, 4096)
)
#: ``--workload``: ``documents`` (above) or ``long``: every prompt long and its own
#: (a shared 1K system prompt, then ~8K tokens of its own, 2K-32K), answers of median 600.
WORKLOADS = {
    "documents": WORKLOAD,
    "long": MixedWorkload(
        requests=1200,
        rate=2.0,
        long_share=0.0,
        user_tokens=LogNormal(8000, 0.5, 2048, 32_000),
        output_tokens=LogNormal(600, 0.5, 64, 4096),
    ),
}

#: Name -> (SimConfig changes, kv_ttft options), 8 workers each.
ARRANGEMENTS: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "colocated": ({"workers": 8}, {}),
    "always": ({"workers": 0, "prefill_workers": 4, "decode_workers": 4, "pd": "always"}, {}),
    "auto": ({"workers": 8, "pd": "auto"}, {}),
    "auto+pooling": ({"workers": 8, "pd": "auto"}, {"pooling": True}),
}  # ``always``'s split is searched per load (see the module docstring)


WORKERS = 8


def _cell(
    name: str,
    load: float,
    scale: float,
    seed: int,
    ttft_slo: float,
    tpot_slo: float,
    split: tuple[int, int] | None = None,
    workload: str = "documents",
) -> dict[str, float | str]:
    changes, options = ARRANGEMENTS[name]
    if split is not None:
        changes = {**changes, "prefill_workers": split[0], "decode_workers": split[1]}
    trace = generate(WORKLOADS[workload], seed)
    config = dataclasses.replace(SimConfig(seed=seed, time_scale=scale), **changes)  # type: ignore[arg-type]
    pooling = bool(options.get("pooling"))
    result = simulate(trace, build_policy("kv_ttft", seed=seed, pooling=pooling), config)
    s = summarize(name, result.records, result.busy_s)
    if split is not None:
        name = f"{name} {split[0]}P/{split[1]}D"
    return {
        "arrangement": name, "load": load,
        "ttft_p50": s.ttft_p50_s, "ttft_p90": s.ttft_p90_s, "ttft_p99": s.ttft_p99_s,
        "tpot_p50": s.tpot_p50_s, "tpot_p90": s.tpot_p90_s, "tpot_p99": s.tpot_p99_s,
        "goodput": goodput_rps(result.records, ttft_slo, tpot_slo),
        "hit": s.hit_rate, "preemptions": s.preemptions,
    }  # fmt: skip


@app.command("pd")
def main(
    loads: Annotated[str, typer.Option(help="Comma-separated fractions of capacity")] = (
        "0.5,0.7,0.9"
    ),
    seed: Annotated[int, typer.Option(help="Trace seed")] = 1,
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO, seconds")] = 5.0,
    tpot_slo: Annotated[float, typer.Option(help="TPOT SLO, seconds")] = 0.05,
    jobs: Annotated[int, typer.Option(help="Parallel replays")] = 2,
    split: Annotated[
        str, typer.Option(help="always-PD split P/D, or 'search': the best goodput per load")
    ] = "search",
    workload: Annotated[str, typer.Option(help="documents | long")] = "documents",
    capacity: Annotated[
        float, typer.Option(help="Capacity in req/s the loads are fractions of (0: measure it)")
    ] = 0.0,
    only: Annotated[
        str, typer.Option(help="Comma-separated arrangements to replay (default: all)")
    ] = "",
) -> None:
    """Replay every arrangement at every load and print the comparison."""
    names = [n for n in only.split(",") if n] or list(ARRANGEMENTS)
    if unknown := set(names) - set(ARRANGEMENTS):
        raise typer.BadParameter(f"unknown arrangements {sorted(unknown)}", param_hint="--only")
    trace = generate(WORKLOADS[workload], seed)
    span = (trace[-1].timestamp - trace[0].timestamp) / 1e3
    capacity = capacity or measure_capacity(trace, SimConfig(seed=seed))
    natural = len(trace) / span
    fractions = [float(x) for x in loads.split(",") if x]
    if split == "search":
        splits = [(p, WORKERS - p) for p in range(1, WORKERS)]
    else:
        p, _, d = split.partition("/")
        splits = [(int(p), int(d))]
    with ProcessPoolExecutor(jobs) as pool:
        futures = {
            (f, name, sp): pool.submit(
                _cell, name, f, f * capacity / natural, seed, ttft_slo, tpot_slo, sp, workload
            )
            for f in fractions
            for name in names
            for sp in (splits if name == "always" else [None])
        }
        results = {k: fut.result() for k, fut in futures.items()}
    rows = []
    for f in fractions:
        for name in names:
            cells = [r for (load, n, _), r in results.items() if load == f and n == name]
            rows.append(max(cells, key=lambda r: float(r["goodput"])))
    table = Table(
        title=f"PD on 8 workers, {workload}: capacity {capacity:.2f} req/s; "
        f"goodput = TTFT <= {ttft_slo} s "
        f"and TPOT <= {tpot_slo * 1e3:.0f} ms"
    )
    cols = ("load", "arrangement", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
            "goodput req/s", "hit", "preempt.")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "arrangement" else "right")
    for r in rows:
        table.add_row(
            f"{r['load']:.0%}", str(r["arrangement"]),
            *(f"{float(r[k]) * 1e3:,.0f} ms" for k in ("ttft_p50", "ttft_p90", "ttft_p99")),
            *(f"{float(r[k]) * 1e3:.1f} ms" for k in ("tpot_p50", "tpot_p90", "tpot_p99")),
            f"{float(r['goodput']):.3f}", f"{float(r['hit']):.1%}", str(r["preemptions"]),
        )  # fmt: skip
    Console(width=170).print(table)


def _pooled(pooling: bool, load: float, seed: int) -> dict[str, float | str]:
    from kvrouter.bench import suite

    capacity, natural = suite._capacity("conversation", seed, False)
    scale = load * capacity / natural
    trace = suite._trace("conversation", seed, False)
    config = suite.CASES["conversation"].config(seed, scale)
    policy = build_policy("kv_ttft", seed=seed, pooling=pooling)
    result = simulate(trace, policy, config)
    s = summarize("pooling" if pooling else "no pooling", result.records, result.busy_s)
    return {
        "policy": s.policy, "load": load, "hit": s.hit_rate,
        "ttft_p50": s.ttft_p50_s, "ttft_p90": s.ttft_p90_s, "ttft_p99": s.ttft_p99_s,
        "preemptions": s.preemptions,
    }  # fmt: skip


@app.command("pooling")
def pooling(
    seed: Annotated[int, typer.Option(help="Trace seed")] = 2,
    jobs: Annotated[int, typer.Option(help="Parallel replays")] = 2,
) -> None:
    """kv_ttft with and without pooling on the conversation workload."""
    with ProcessPoolExecutor(jobs) as pool:
        futures = [
            pool.submit(_pooled, flag, load, seed) for load in (0.9, 1.4) for flag in (False, True)
        ]
        rows = [f.result() for f in futures]
    table = Table(title=f"Pooling on conversation seed {seed} (8 workers)")
    for col in ("load", "kv_ttft", "hit", "TTFT p50", "p90", "p99", "preempt."):
        table.add_column(col, justify="left" if col == "kv_ttft" else "right")
    for r in rows:
        table.add_row(
            f"{float(r['load']):.0%}", str(r["policy"]), f"{float(r['hit']):.1%}",
            *(f"{float(r[k]) * 1e3:,.0f} ms" for k in ("ttft_p50", "ttft_p90", "ttft_p99")),
            str(r["preemptions"]),
        )  # fmt: skip
    Console(width=170).print(table)


if __name__ == "__main__":  # pragma: no cover
    app()
