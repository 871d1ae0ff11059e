"""``kvrouter bench``: generate workloads, replay traces in the offline simulator, run the suite.

::

    kvrouter bench gen chat --out chat.jsonl --seed 1 --sessions 200 --turns 6
    kvrouter bench gen conversation --out conv.jsonl --seed 1
    kvrouter bench sim --trace chat.jsonl --workers 8 --policies all --json out.json --plots plots/
    kvrouter bench suite --out-dir docs/plots
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.console import Console

from engine_worker.profiles import DEFAULT_PROFILE, ProfileError, load_fleet
from kvrouter.bench.compare import compare_policies, describe_trace, parse_policies
from kvrouter.bench.production import think_time
from kvrouter.bench.report import (
    BenchReport,
    plot_hit_rates,
    plot_ttft_cdf,
    render_table,
    summarize,
    write_json,
)
from kvrouter.bench.simulator import SimConfig, SimulationError
from kvrouter.bench.suite import CASES, SETS, parse_jitter, parse_tiers, run_suite
from kvrouter.bench.trace import TraceError, TraceRecord, read_trace, write_trace
from kvrouter.bench.workloads import (
    AgentWorkload,
    ChatWorkload,
    ConversationWorkload,
    GroupsWorkload,
    MixedWorkload,
    Workload,
    WorkloadError,
    generate,
)

__all__ = ["bench_app"]

_T = TypeVar("_T")

bench_app = typer.Typer(
    help="Benchmarks: workload generators, the offline simulator, the policy suite.",
    no_args_is_help=True,
)
gen_app = typer.Typer(help="Write a synthetic workload as a trace file.", no_args_is_help=True)
bench_app.add_typer(gen_app, name="gen")

Out = Annotated[Path, typer.Option("--out", help="Trace file to write (JSON lines).")]
Seed = Annotated[int, typer.Option(help="Random seed; the same seed gives the same trace.")]


def _write(workload: Workload, out: Path, seed: int) -> None:
    try:
        records = generate(workload, seed)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from exc
    write_trace(out, records)
    _console().print(f"wrote {out}: {describe_trace(records)}")


def _build(make: Callable[..., _T], **values: object) -> _T:
    """``make(**values)``, a bad value refused as a bad parameter."""
    try:
        return make(**values)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from exc


@gen_app.command("chat")
def gen_chat(
    out: Out,
    seed: Seed = 0,
    sessions: Annotated[int, typer.Option(help="Sessions.")] = 200,
    turns: Annotated[int, typer.Option(help="Turns per session.")] = 6,
    system_tokens: Annotated[int, typer.Option(help="Shared system prompt.")] = 1024,
    user_tokens: Annotated[int, typer.Option(help="Mean user message.")] = 256,
    answer_tokens: Annotated[int, typer.Option(help="Mean answer.")] = 256,
    think_time_s: Annotated[float, typer.Option(help="Mean time between turns.")] = 20.0,
    session_rate: Annotated[float, typer.Option(help="Sessions started per second.")] = 2.0,
) -> None:
    """Multi-turn chat: each turn's prompt is the whole history plus a new message."""
    values = dict(locals())
    del values["out"], values["seed"]
    _write(_build(ChatWorkload, **values), out, seed)


@gen_app.command("groups")
def gen_groups(
    out: Out,
    seed: Seed = 0,
    groups: Annotated[int, typer.Option(help="Groups, each with a system prompt.")] = 16,
    users: Annotated[int, typer.Option(help="Users (questions) per group.")] = 16,
    system_tokens: Annotated[int, typer.Option(help="Group system prompt.")] = 4096,
    question_tokens: Annotated[int, typer.Option(help="Question.")] = 256,
    output_tokens: Annotated[int, typer.Option(help="Mean answer.")] = 128,
    rate: Annotated[float, typer.Option(help="Requests per second.")] = 20.0,
    requests: Annotated[int, typer.Option(help="Requests.")] = 2000,
) -> None:
    """Shared-prefix groups: a group system prompt plus each user's question."""
    values = dict(locals())
    del values["out"], values["seed"]
    _write(_build(GroupsWorkload, **values), out, seed)


@gen_app.command("agent")
def gen_agent(
    out: Out,
    seed: Seed = 0,
    agents: Annotated[int, typer.Option(help="Agents.")] = 32,
    steps: Annotated[int, typer.Option(help="Model calls per agent.")] = 20,
    system_tokens: Annotated[int, typer.Option(help="Shared tool definitions.")] = 2048,
    context_min: Annotated[int, typer.Option(help="Smallest first prompt.")] = 8192,
    context_max: Annotated[int, typer.Option(help="Largest first prompt.")] = 32768,
    tool_tokens_min: Annotated[int, typer.Option(help="Smallest tool output.")] = 100,
    tool_tokens_max: Annotated[int, typer.Option(help="Largest tool output.")] = 600,
    output_tokens: Annotated[int, typer.Option(help="Mean answer.")] = 64,
    step_interval_s: Annotated[float, typer.Option(help="Mean time between steps.")] = 4.0,
    agent_rate: Annotated[float, typer.Option(help="Agents started per second.")] = 0.5,
) -> None:
    """Agent loops: long contexts growing by tool output, short answers, many steps."""
    values = dict(locals())
    del values["out"], values["seed"]
    _write(_build(AgentWorkload, **values), out, seed)


@gen_app.command("conversation")
def gen_conversation(
    out: Out,
    seed: Seed = 0,
    sessions: Annotated[int, typer.Option(help="Sessions.")] = 900,
    session_rate: Annotated[float, typer.Option(help="Sessions started per second.")] = 1.0,
    arrival_shape: Annotated[float, typer.Option(help="Gamma shape of session gaps.")] = 0.5,
    turns_mean: Annotated[float, typer.Option(help="Mean turns per session.")] = 1.8,
    apps: Annotated[int, typer.Option(help="Apps, each with a system prompt.")] = 8,
    system_tokens: Annotated[int, typer.Option(help="App system prompt.")] = 1536,
    documents: Annotated[int, typer.Option(help="Shared documents.")] = 200,
    document_share: Annotated[float, typer.Option(help="Sessions opening on a document.")] = 0.12,
    paste_share: Annotated[float, typer.Option(help="Sessions opening with a long paste.")] = 0.5,
    think_time_s: Annotated[
        float, typer.Option(help="Median think time before a next turn (log-normal).")
    ] = 7.0,
    think_time_sigma: Annotated[float, typer.Option(help="Its log-normal sigma.")] = 0.75,
    horizon_s: Annotated[
        float | None, typer.Option(help="Drop turns arriving after this many seconds.")
    ] = None,
) -> None:
    """Production-shaped multi-turn chat: heavy-tailed prompts (mean ~13K, tail past 100K).

    Think times default to a chatbot trace's (~7 s median). ``--sessions 1800
    --session-rate 2 --think-time-s 130 --think-time-sigma 1.2 --horizon-s 900`` is the
    suite's ``returning`` case, whose sessions come back as late as the Mooncake
    conversation trace's (~100 s median).
    """
    values = dict(locals())
    del values["out"], values["seed"], values["think_time_s"], values["think_time_sigma"]
    values["horizon_s"] = math.inf if horizon_s is None else horizon_s
    think = _build(think_time, median_s=think_time_s, sigma=think_time_sigma)
    _write(_build(ConversationWorkload, think_time_s=think, **values), out, seed)


@gen_app.command("mixed")
def gen_mixed(
    out: Out,
    seed: Seed = 0,
    requests: Annotated[int, typer.Option(help="Requests.")] = 3000,
    rate: Annotated[float, typer.Option(help="Requests per second.")] = 4.0,
    arrival_shape: Annotated[float, typer.Option(help="Gamma shape of request gaps.")] = 0.3,
    apps: Annotated[int, typer.Option(help="Apps, each with a system prompt.")] = 16,
    system_tokens: Annotated[int, typer.Option(help="App system prompt.")] = 1024,
    long_share: Annotated[float, typer.Option(help="Share of long document prompts.")] = 0.1,
    documents: Annotated[int, typer.Option(help="Shared documents.")] = 120,
) -> None:
    """Short API prompts and 16K-126K document prompts arriving together, in bursts."""
    values = dict(locals())
    del values["out"], values["seed"]
    _write(_build(MixedWorkload, **values), out, seed)


def _console() -> Console:
    """The terminal's console; a wide one when writing to a file or pipe (the table has 15
    columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=170)


def _load(trace: Path, limit: int | None) -> list[TraceRecord]:
    try:
        records = read_trace(trace, limit=limit)
    except TraceError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from exc
    if not records:
        raise typer.BadParameter(f"{trace} holds no request", param_hint="--trace")
    return records


@bench_app.command("sim")
def sim(
    trace: Annotated[Path, typer.Option(help="Trace file (Mooncake JSON lines).")],
    workers: Annotated[int, typer.Option(help="Simulated workers.")] = 8,
    policies: Annotated[str, typer.Option(help="'all' or comma-separated names.")] = "all",
    time_scale: Annotated[float, typer.Option(help="Arrival rate multiplier.")] = 1.0,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    model: Annotated[str, typer.Option(help="Model name (root of block keys).")] = "llama3-8b",
    profile: Annotated[
        str,
        typer.Option(
            help="Packaged profile name or file; several, comma-separated: a mixed fleet "
            "(the workers take them in turn)."
        ),
    ] = DEFAULT_PROFILE,
    hbm_blocks: Annotated[int | None, typer.Option(help="HBM blocks/worker [H100].")] = None,
    dram_blocks: Annotated[int | None, typer.Option(help="DRAM blocks/worker [64 GB].")] = None,
    ssd_blocks: Annotated[int | None, typer.Option(help="SSD blocks/worker [256 GB].")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Requests per step.")] = 256,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Step token budget [profile's].")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context [trace's max].")] = None,
    event_delay_ms: Annotated[float, typer.Option(help="Event-to-index delay.")] = 10.0,
    view_interval_ms: Annotated[float, typer.Option(help="Heartbeat period (0: exact).")] = 0.0,
    prefill_workers: Annotated[int, typer.Option(help="Prefill-only workers (PD).")] = 0,
    decode_workers: Annotated[int, typer.Option(help="Decode-only workers (PD).")] = 0,
    pd: Annotated[str, typer.Option(help="Prefill/decode split: never | always | auto.")] = (
        "never"
    ),
    transfer_gbps: Annotated[
        float, typer.Option(help="KV transfer bandwidth between workers, GB/s.")
    ] = 12.5,
    seed: Annotated[int, typer.Option(help="Seed of the policies and epochs.")] = 0,
    jitter: Annotated[
        str,
        typer.Option(
            help="Perturbations k (e.g. 3, 0-2, 0,2): k > 0 delays each arrival by a seeded "
            "amount under 1 ms; several: each policy's medians over the replays."
        ),
    ] = "0",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Directory for PNG plots.")] = None,
    limit: Annotated[int | None, typer.Option(help="Replay the first N requests.")] = None,
) -> None:
    """Replay a trace on a simulated cluster with every chosen policy and compare them."""
    records = _load(trace, limit)
    try:
        names = parse_policies(policies)
        perturbations = parse_jitter(jitter)
        timings = load_fleet(profile)
        config = SimConfig(
            workers=workers,
            block_size=block_size,
            model=model,
            profile=timings[0],
            worker_profiles=tuple(timings) if len(timings) > 1 else (),
            hbm_blocks=hbm_blocks,
            dram_blocks=dram_blocks,
            ssd_blocks=ssd_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            event_delay_s=event_delay_ms / 1e3,
            view_interval_s=view_interval_ms / 1e3,
            time_scale=time_scale,
            seed=seed,
            prefill_workers=prefill_workers,
            decode_workers=decode_workers,
            pd=pd,  # type: ignore[arg-type]
            transfer_bandwidth=transfer_gbps * 1e9,
            jitter=perturbations[0],
        )
        config.capacity()
    except (ValueError, ProfileError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = _console()
    console.print(f"{trace}: {describe_trace(records)}")
    try:
        compare_policies(
            records,
            names,
            config,
            console=console,
            label=trace.stem,
            json_path=json_out,
            plots=plots,
            jitter=perturbations,
        )
    except SimulationError as exc:
        console.print(f"[red]simulation failed:[/red] {exc}")
        raise typer.Exit(code=1) from exc


@bench_app.command("live")
def live(
    trace: Annotated[Path, typer.Option(help="Trace file (Mooncake JSON lines).")],
    gateway: Annotated[str, typer.Option(help="Gateway base URL.")] = "http://127.0.0.1:8000",
    model: Annotated[str, typer.Option(help="Served model name to ask for.")] = "tiny",
    redis: Annotated[
        str | None, typer.Option("--redis", help="Cluster Redis (busy times, oracle).")
    ] = None,
    time_scale: Annotated[float, typer.Option(help="Arrival rate multiplier.")] = 1.0,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    vocab_size: Annotated[int, typer.Option(help="Token ids of the prompts.")] = 32000,
    api_key: Annotated[str | None, typer.Option(help="Gateway API key.")] = None,
    label: Annotated[str, typer.Option(help="Name of this run in the report.")] = "live",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report.")] = None,
    plots: Annotated[Path | None, typer.Option(help="Directory for PNG plots.")] = None,
    limit: Annotated[int | None, typer.Option(help="Replay the first N requests.")] = None,
    stream: Annotated[
        bool, typer.Option(help="Streaming requests (non-streaming: no TTFT, a client sees none).")
    ] = True,
) -> None:
    """Replay a trace against a running gateway in real time; same report as ``bench sim``."""
    import asyncio

    from rich.progress import Progress

    from kvrouter.bench.live import replay_live

    records = _load(trace, limit)
    console = _console()
    console.print(f"{trace}: {describe_trace(records)}")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("live replay", total=len(records))
        result = asyncio.run(
            replay_live(
                records, gateway.rstrip("/"), model=model, time_scale=time_scale,
                block_size=block_size, vocab_size=vocab_size, redis_url=redis,
                api_key=api_key, progress=lambda n: progress.advance(task, n), stream=stream,
            )
        )  # fmt: skip
    summary = summarize(label, result.records, result.busy_s, result.oracle)
    render_table([summary], console, title=f"{label}: live replay against {gateway}")
    if result.errors:
        console.print(f"[red]{result.errors} requests failed[/red]")
    if json_out is not None:
        oracle = {"hit_rate": result.oracle.hit_rate} if result.oracle else None
        write_json(
            BenchReport(trace=label, config={"gateway": gateway, "time_scale": time_scale},
                        oracle=oracle, summaries=[summary]),
            json_out,
        )  # fmt: skip
    if plots is not None:
        plots.mkdir(parents=True, exist_ok=True)
        ttfts = {label: [t for r in result.records if (t := r.ttft_s) is not None]}
        plot_ttft_cdf(ttfts, plots / f"{label}_ttft_cdf.png", title=f"{label}: TTFT")
        plot_hit_rates([summary], plots / f"{label}_hit_rate.png", result.oracle, title=label)
    if result.errors:
        raise typer.Exit(code=1)


@bench_app.command("suite")
def suite(
    out_dir: Annotated[Path, typer.Option(help="Directory for plots and JSON.")] = Path(
        "docs/plots"
    ),
    quick: Annotated[bool, typer.Option(help="Tiny traces (a smoke run).")] = False,
    sets: Annotated[
        str, typer.Option("--set", help="Comma-separated sets: tune, report.")
    ] = "tune,report",
    only: Annotated[
        str, typer.Option(help="Comma-separated workloads to run (default: all).")
    ] = "",
    jobs: Annotated[int | None, typer.Option(help="Parallel replays [cores].")] = None,
    plots: Annotated[bool, typer.Option(help="Draw TTFT CDFs of the report set.")] = True,
    load: Annotated[
        str, typer.Option(help="Comma-separated load labels to run (default: all).")
    ] = "",
    view_interval_ms: Annotated[
        float,
        typer.Option(help="Routers' heartbeat period (0: exact views; 1000: a live gateway)."),
    ] = 0.0,
    seeds: Annotated[
        str,
        typer.Option(
            help="Comma-separated seeds to replay instead of the sets' (a set named 'seeds')."
        ),
    ] = "",
    jitter: Annotated[
        str,
        typer.Option(
            help="Perturbations k (e.g. 3, 0-4, 0,2): k > 0 delays each arrival by a seeded "
            "amount < 1 ms; several: medians over the runs, and how often each gap held."
        ),
    ] = "0",
    tiers: Annotated[
        str,
        typer.Option(
            help="KV tiers every worker keeps (hbm,dram,ssd); 'hbm': workers without KV "
            "offloading, as vLLM and SGLang run by default."
        ),
    ] = "hbm,dram,ssd",
    profile: Annotated[
        str,
        typer.Option(
            help="Timing profile of the workers (packaged name or file); several, "
            "comma-separated: a mixed fleet (e.g. llama3_8b_h100,llama3_8b_a100)."
        ),
    ] = DEFAULT_PROFILE,
    policies: Annotated[
        str,
        typer.Option(
            help="Comma-separated policies to replay (default: all): kv_ttft and its "
            "peers, e.g. the ones that are ever best, to make --jitter runs shorter."
        ),
    ] = "",
    workers: Annotated[
        int | None,
        typer.Option(
            help="Replay every workload on this many workers instead of its own (4 for "
            "chat, groups and agent, 8 for the others): a cluster size never tuned on."
        ),
    ] = None,
) -> None:
    """Every policy on every workload at three loads, tuned on one set, reported on another."""
    chosen = [s for s in sets.split(",") if s]
    unknown = [s for s in chosen if s not in SETS]
    if unknown or not chosen:
        raise typer.BadParameter(f"sets are {', '.join(SETS)}; got {sets!r}", param_hint="--set")
    names = [n for n in only.split(",") if n]
    if bad := [n for n in names if n not in CASES]:
        raise typer.BadParameter(
            f"unknown workload {', '.join(bad)}; choose from {', '.join(CASES)}",
            param_hint="--only",
        )
    try:
        seed_list = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"seeds are comma-separated integers; got {seeds!r}", param_hint="--seeds"
        ) from None
    try:
        run_suite(
            out_dir, console=_console(), quick=quick, sets=chosen, only=names, jobs=jobs,
            plots=plots, loads=[x for x in load.split(",") if x],
            view_interval_s=view_interval_ms / 1e3, seeds=seed_list,
            jitter=parse_jitter(jitter), tiers=parse_tiers(tiers),
            profiles=[p.strip() for p in profile.split(",") if p.strip()],
            policies=[p.strip() for p in policies.split(",") if p.strip()],
            cluster_size=workers,
        )  # fmt: skip
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


@bench_app.command("compare")
def compare_live(
    trace: Annotated[
        list[Path], typer.Option(help="Trace file (repeatable: one table per trace).")
    ],
    routers: Annotated[
        str,
        typer.Option(
            help="'all' or comma-separated kvrouter[:policy], vllm-router:policy, "
            "sglang-router:cache_aware."
        ),
    ] = "all",
    parts: Annotated[str, typer.Option(help="Comma-separated: replay, overhead, rps.")] = (
        "replay,overhead,rps"
    ),
    workers: Annotated[int, typer.Option(help="Sim workers of the replay.")] = 4,
    worker_time_scale: Annotated[
        float, typer.Option(help="Multiplies the workers' modeled step times.")
    ] = 1.0,
    time_scale: Annotated[float, typer.Option(help="Arrival rate multiplier.")] = 1.0,
    max_output: Annotated[int, typer.Option(help="Cap on each request's output tokens.")] = 0,
    hbm_blocks: Annotated[int, typer.Option(help="HBM blocks per worker.")] = 2048,
    dram_blocks: Annotated[int, typer.Option(help="DRAM blocks per worker.")] = 4096,
    overhead_probes: Annotated[int, typer.Option(help="Probe pairs per prompt class.")] = 40,
    rps_workers: Annotated[int, typer.Option(help="Sim workers (time scale 0) of --rps.")] = 4,
    rps_clients: Annotated[int, typer.Option(help="Concurrent closed-loop clients.")] = 32,
    rps_seconds: Annotated[float, typer.Option(help="Seconds per rps target.")] = 15.0,
    rps_warm: Annotated[
        float, typer.Option(help="Unmeasured warm-up seconds per rps target, before them.")
    ] = 2.0,
    log_dir: Annotated[Path, typer.Option(help="Process logs.")] = Path("var/compare"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write every figure.")] = None,
    limit: Annotated[int | None, typer.Option(help="Replay the first N requests.")] = None,
) -> None:
    """Our gateway and vllm-router / sglang-router in front of one sim fleet, side by side."""
    import msgspec

    from kvrouter.bench.compare_live import CompareConfig, run_compare, to_json
    from kvrouter.bench.fleet import FleetConfig, RouterSpec, vllm_events_supported

    console = _console()
    chosen = [p for p in parts.split(",") if p]
    if bad := [p for p in chosen if p not in ("replay", "overhead", "rps")]:
        raise typer.BadParameter(f"unknown part {', '.join(bad)}", param_hint="--parts")
    if routers == "all":
        routers = ("kvrouter,vllm-router:round_robin,vllm-router:cache_aware,"
                   "vllm-router:kv_aware,sglang-router:cache_aware")  # fmt: skip
    try:
        specs = [RouterSpec.parse(r) for r in routers.split(",") if r.strip()]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--routers") from exc
    if not vllm_events_supported() and any(s.policy == "kv_aware" for s in specs):
        console.print("[yellow]vllm-router:kv_aware skipped: the workers cannot publish vLLM "
                      "KV events yet (no KVWORKER_VLLM_EVENTS_ENDPOINT)[/yellow]")  # fmt: skip
        specs = [s for s in specs if s.policy != "kv_aware"]
    traces = []
    for path in trace:
        records = _load(path, limit)
        if max_output > 0:
            records = [msgspec.structs.replace(r, output_length=min(r.output_length, max_output))
                       for r in records]  # fmt: skip
        console.print(f"{path}: {describe_trace(records)}")
        traces.append((path.stem, records))
    fleet = FleetConfig(workers=workers, time_scale=worker_time_scale, hbm_blocks=hbm_blocks,
                        dram_blocks=dram_blocks)  # fmt: skip
    config = CompareConfig(specs, fleet, time_scale=time_scale, overhead_probes=overhead_probes,
                           rps_workers=rps_workers, rps_clients=rps_clients,
                           rps_seconds=rps_seconds, rps_warm_s=rps_warm)  # fmt: skip
    replays, overhead, rps = run_compare(traces, config, chosen, log_dir, console)
    if json_out is not None:
        json_out.write_bytes(to_json(replays, overhead, rps, {
            "traces": [str(t) for t in trace], "routers": [s.name for s in specs],
            "workers": workers, "worker_time_scale": worker_time_scale,
            "time_scale": time_scale, "max_output": max_output,
        }))  # fmt: skip
    failed = sum(r.errors for r in replays) + sum(r.errors for r in overhead)
    if failed:
        console.print(f"[red]{failed} requests failed[/red]")
        raise typer.Exit(code=1)
