"""``kvrouter bench compare``: our gateway and the peer routers, live, side by side.

One sim-worker fleet (:mod:`kvrouter.bench.fleet`) serves every router in
turn; the workers restart (and Redis is flushed) before each router, so each
one starts cold. Three measurements, each run side by side in one process:

* **replay**: the same trace through each router in real time
  (:func:`kvrouter.bench.live.replay_live`) with text prompts
  (:mod:`kvrouter.bench.text_prompts`); per router TTFT p50/p90/p99, hit rate
  (the workers' ``cached_tokens`` over prompt tokens), requests/s and the
  workers' busy share.
* **overhead**: one worker, unloaded, and every router in front of it at
  once; each probe request goes straight to the worker and through every
  router, in an order rotated from probe to probe, and a router's overhead
  is the median of its paired TTFT differences (paired and interleaved, so
  a noisy machine slows every router alike). Short
  prompts (unique 64-word prompts) and long ones (8K-16K tokens whose first
  8K are a prefix the router has already seen). With one worker, the direct
  and the routed request meet the same cache, so the difference is the
  router's alone.
* **rps**: closed loop, N clients sending short non-streaming completions
  (1 output token) for a fixed time, straight to the workers (round robin in
  the client: the workers' own ceiling) and through each router.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
from rich.console import Console
from rich.table import Table

from indexer.keys import root_parent
from kvrouter.bench.fleet import Fleet, FleetConfig, RouterSpec
from kvrouter.bench.live import replay_live
from kvrouter.bench.report import PolicySummary, summarize
from kvrouter.bench.text_prompts import TextPrompts
from kvrouter.bench.trace import TraceRecord

__all__ = [
    "CompareConfig",
    "OverheadResult",
    "ReplayRow",
    "RpsResult",
    "measure_overhead",
    "measure_rps",
    "render_overhead",
    "render_replays",
    "render_rps",
    "replay_routers",
    "run_compare",
    "text_prompts",
    "to_json",
]


class OverheadResult(msgspec.Struct, kw_only=True):
    """One router's added TTFT on one prompt class (milliseconds; medians over probes)."""

    router: str
    prompts: str
    probes: int
    direct_p50_ms: float
    routed_p50_ms: float
    overhead_p50_ms: float
    overhead_p90_ms: float
    errors: int


class RpsResult(msgspec.Struct, kw_only=True):
    """Closed-loop throughput of one target (``direct`` = the workers, round robin)."""

    target: str
    clients: int
    seconds: float
    requests: int
    errors: int
    rps: float
    latency_p50_ms: float
    latency_p99_ms: float
    #: Why requests failed: HTTP status code or exception class -> count.
    failures: dict[str, int] = msgspec.field(default_factory=dict)


@dataclass(slots=True)
class ReplayRow:
    """One router's replay: the report's summary plus the failures."""

    summary: PolicySummary
    errors: int


def replay_routers(
    fleet: Fleet,
    routers: Sequence[RouterSpec],
    trace: Sequence[TraceRecord],
    prompts: TextPrompts,
    *,
    time_scale: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> list[ReplayRow]:
    """Replay ``trace`` through each router in turn, restarting the fleet before each."""
    rows = []
    for n, spec in enumerate(routers):
        if n:
            fleet.restart()
        if progress is not None:
            progress(f"replaying {len(trace)} requests through {spec.name}")
        with fleet.router(spec) as base:
            result = asyncio.run(
                replay_live(
                    trace, base, model=fleet.config.model, time_scale=time_scale,
                    redis_url=fleet.redis_url, prompt=prompts.text, worker_urls=fleet.workers,
                )
            )  # fmt: skip
        rows.append(ReplayRow(summarize(spec.name, result.records, result.busy_s, result.oracle),
                              result.errors))  # fmt: skip
    return rows


async def _ttft(http: httpx.AsyncClient, base: str, model: str, prompt: str) -> float | None:
    """Seconds to the first streamed token of a 1-token completion (None: it failed)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    async with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        ttft = None
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"choices"' in line:
                ttft = time.perf_counter() - t0
    return ttft


def _probe_prompts(
    prompts: TextPrompts, rng: random.Random, kind: str, probes: int
) -> tuple[list[str], list[str]]:
    """(warm-up prompts, probe prompts): short = unique 64 words; long = one of 4 shared
    8K-word prefixes (warmed) plus 0-8K unique words."""
    if kind == "short":
        return [], [prompts.suffix(rng, 64) for _ in range(probes)]
    prefixes = [prompts.suffix(rng, 8192) for _ in range(4)]
    probe = [prefixes[i % 4] + prompts.suffix(rng, rng.randint(16, 8192)) for i in range(probes)]
    return prefixes, probe


def measure_overhead(
    fleet: Fleet,
    routers: Sequence[RouterSpec],
    prompts: TextPrompts,
    *,
    probes: int = 40,
    seed: int = 0,
    kinds: Sequence[str] = ("short", "long"),
    progress: Callable[[str], None] | None = None,
) -> list[OverheadResult]:
    """Each router's added TTFT per prompt class (see the module docstring).

    Every router runs at once in front of the one worker, and each probe goes
    straight to the worker and through every router, in an order rotated from
    probe to probe: what the machine does meanwhile (it is shared and noisy)
    falls on every router alike, and the ratios between routers hold.
    """
    direct = next(iter(fleet.workers.values()))
    model = fleet.config.model
    if progress is not None:
        progress(f"overhead of {', '.join(s.name for s in routers)}, interleaved")
    with contextlib.ExitStack() as stack:
        bases = {spec.name: stack.enter_context(fleet.router(spec)) for spec in routers}
        out = []
        for kind in kinds:
            warm, probe = _probe_prompts(prompts, random.Random(seed), kind, probes)
            out += asyncio.run(_overhead(kind, bases, direct, model, warm, probe))
    order = {spec.name: i for i, spec in enumerate(routers)}
    return sorted(out, key=lambda r: (order[r.router], kinds.index(r.prompts)))


async def _overhead(
    kind: str, bases: dict[str, str], direct: str, model: str, warm: list[str], probe: list[str]
) -> list[OverheadResult]:
    names = list(bases)
    targets = [direct, *bases.values()]
    pairs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    errors = dict.fromkeys(names, 0)
    async with httpx.AsyncClient(timeout=120) as http:
        for p in warm:
            for base in bases.values():
                await _ttft(http, base, model, p)
        for i, p in enumerate(probe):
            k = i % len(targets)
            got = {url: await _ttft(http, url, model, p) for url in targets[k:] + targets[:k]}
            d = got[direct]
            for name, base in bases.items():
                r = got[base]
                if d is None or r is None:
                    errors[name] += 1
                else:
                    pairs[name].append((d, r))
    return [_overhead_result(n, kind, pairs[n], errors[n]) for n in names]


def _overhead_result(
    name: str, kind: str, pairs: list[tuple[float, float]], errors: int
) -> OverheadResult:
    if not pairs:
        nan = float("nan")
        return OverheadResult(router=name, prompts=kind, probes=0, direct_p50_ms=nan,
                              routed_p50_ms=nan, overhead_p50_ms=nan, overhead_p90_ms=nan,
                              errors=errors)  # fmt: skip
    diffs = sorted((r - d) * 1e3 for d, r in pairs)
    return OverheadResult(
        router=name, prompts=kind, probes=len(pairs),
        direct_p50_ms=statistics.median(d for d, _ in pairs) * 1e3,
        routed_p50_ms=statistics.median(r for _, r in pairs) * 1e3,
        overhead_p50_ms=statistics.median(diffs),
        overhead_p90_ms=diffs[min(len(diffs) - 1, int(0.9 * len(diffs)))],
        errors=errors,
    )  # fmt: skip


def measure_rps(
    fleet: Fleet,
    routers: Sequence[RouterSpec],
    prompts: TextPrompts,
    *,
    clients: int = 32,
    seconds: float = 15.0,
    warm_s: float = 2.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[RpsResult]:
    """Closed-loop requests/s straight to the workers, then through each router (each
    measured for ``seconds`` after ``warm_s`` unmeasured)."""
    model = fleet.config.model
    rng = random.Random(seed)
    pool = [prompts.suffix(rng, 64) for _ in range(512)]
    if progress is not None:
        progress("requests/s straight to the workers")
    out = [asyncio.run(_closed_loop("direct", list(fleet.workers.values()), model, pool,
                                    clients, seconds, warm_s))]  # fmt: skip
    for spec in routers:
        fleet.restart()
        if progress is not None:
            progress(f"requests/s through {spec.name}")
        with fleet.router(spec) as base:
            out.append(
                asyncio.run(_closed_loop(spec.name, [base], model, pool, clients, seconds, warm_s))
            )
    return out


async def _closed_loop(
    name: str, targets: list[str], model: str, pool: list[str], clients: int, seconds: float,
    warm_s: float = 2.0,
) -> RpsResult:  # fmt: skip
    """``clients`` loops each sending one request after another until ``seconds`` pass
    (after ``warm_s`` unmeasured seconds: connections, caches and allocators warm up)."""
    latencies: list[float] = []
    failures: collections.Counter[str] = collections.Counter()
    turn = itertools.count()
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        stop = time.perf_counter() + seconds
        measuring = False

        async def client() -> None:
            while time.perf_counter() < stop:
                k = next(turn)
                body = {"model": model, "prompt": pool[k % len(pool)], "max_tokens": 1,
                        "ignore_eos": True, "temperature": 0}  # fmt: skip
                t0 = time.perf_counter()
                try:
                    r = await http.post(f"{targets[k % len(targets)]}/v1/completions", json=body)
                    why = "" if r.status_code == 200 else str(r.status_code)
                except httpx.HTTPError as exc:
                    why = type(exc).__name__
                if not measuring:
                    continue
                if why:
                    failures[why] += 1
                else:
                    latencies.append(time.perf_counter() - t0)

        stop = time.perf_counter() + warm_s
        await asyncio.gather(*(client() for _ in range(clients)))
        measuring = True
        t0 = time.perf_counter()
        stop = t0 + seconds
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    lat = sorted(latencies) or [float("nan")]
    return RpsResult(
        target=name, clients=clients, seconds=elapsed, requests=len(latencies),
        errors=sum(failures.values()), rps=len(latencies) / elapsed,
        latency_p50_ms=statistics.median(lat) * 1e3,
        latency_p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        failures=dict(failures),
    )  # fmt: skip


def text_prompts(model: str, block_size: int = 16) -> TextPrompts:
    """The text-prompt builder for ``model``'s tokenizer."""
    from engine_worker.tokenizer import load_tokenizer

    return TextPrompts(load_tokenizer(model), block_size, root_parent(model))


def render_replays(rows: Sequence[ReplayRow], console: Console, title: str) -> None:
    """One row per router: TTFT, hit rate, requests/s, busy share and CV, failures."""
    table = Table(title=title)
    for col in ("router", "done", "failed", "TTFT p50", "p90", "p99", "hit", "hit/oracle",
                "req/s", "busy", "busy CV"):  # fmt: skip
        table.add_column(col, justify="left" if col == "router" else "right")
    for row in rows:
        s = row.summary
        ratio = "-" if s.hit_vs_oracle is None else f"{s.hit_vs_oracle:.2f}"
        table.add_row(
            s.policy, f"{s.completed}/{s.requests}", str(row.errors),
            f"{s.ttft_p50_s * 1e3:.0f} ms", f"{s.ttft_p90_s * 1e3:.0f} ms",
            f"{s.ttft_p99_s * 1e3:.0f} ms", f"{s.hit_rate:.1%}", ratio,
            f"{s.throughput_rps:.2f}", f"{s.busy_share:.1%}", f"{s.load_cv:.2f}",
        )  # fmt: skip
    console.print(table)


def render_overhead(results: Sequence[OverheadResult], console: Console, baseline: str) -> None:
    """Router overhead per prompt class, and its ratio to ``baseline``'s (a router name)."""
    base = {r.prompts: r.overhead_p50_ms for r in results if r.router == baseline}
    table = Table(title=f"router overhead (TTFT through the router minus direct; vs {baseline})")
    for col in ("router", "prompts", "probes", "direct p50", "routed p50", "overhead p50",
                "overhead p90", f"/ {baseline}", "failed"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("router", "prompts") else "right")
    for r in results:
        ref = base.get(r.prompts)
        ratio = f"{r.overhead_p50_ms / ref:.2f}" if ref and ref > 0 else "-"
        table.add_row(
            r.router, r.prompts, str(r.probes), f"{r.direct_p50_ms:.1f} ms",
            f"{r.routed_p50_ms:.1f} ms", f"{r.overhead_p50_ms:.1f} ms",
            f"{r.overhead_p90_ms:.1f} ms", ratio, str(r.errors),
        )  # fmt: skip
    console.print(table)


def _failed(errors: int, why: dict[str, int]) -> str:
    """``3 (2x 503, 1x ReadTimeout)``: the count and its causes."""
    if not why:
        return str(errors)
    return f"{errors} ({', '.join(f'{n}x {k}' for k, n in sorted(why.items()))})"


def render_rps(results: Sequence[RpsResult], console: Console, baseline: str) -> None:
    """Closed-loop requests/s per target and its ratio to ``baseline``'s."""
    ref = next((r.rps for r in results if r.target == baseline), 0.0)
    table = Table(title=f"closed-loop requests/s (short prompts, 1 output token; vs {baseline})")
    for col in ("target", "clients", "requests", "failed", "req/s", f"/ {baseline}",
                "latency p50", "p99"):  # fmt: skip
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in results:
        table.add_row(
            r.target, str(r.clients), str(r.requests), _failed(r.errors, r.failures),
            f"{r.rps:.1f}",
            f"{r.rps / ref:.2f}" if ref else "-", f"{r.latency_p50_ms:.1f} ms",
            f"{r.latency_p99_ms:.1f} ms",
        )  # fmt: skip
    console.print(table)


def to_json(
    replays: Sequence[ReplayRow], overhead: Sequence[OverheadResult], rps: Sequence[RpsResult],
    config: dict[str, object],
) -> bytes:  # fmt: skip
    """Everything measured, as indented JSON."""
    doc = {
        "config": config,
        "replays": [{"errors": r.errors, **msgspec.to_builtins(r.summary)} for r in replays],
        "overhead": msgspec.to_builtins(list(overhead)),
        "rps": msgspec.to_builtins(list(rps)),
    }
    return json.dumps(doc, indent=2, default=str).encode() + b"\n"


@dataclass(slots=True)
class CompareConfig:
    """What ``kvrouter bench compare`` runs (see the CLI's help for each field)."""

    routers: list[RouterSpec]
    replay_fleet: FleetConfig
    time_scale: float = 1.0
    overhead_probes: int = 40
    rps_workers: int = 4
    rps_clients: int = 32
    rps_seconds: float = 15.0
    rps_warm_s: float = 2.0
    seed: int = 0


def run_compare(
    traces: Sequence[tuple[str, Sequence[TraceRecord]]],
    config: CompareConfig,
    parts: Sequence[str],
    log_dir: Path,
    console: Console,
) -> tuple[list[ReplayRow], list[OverheadResult], list[RpsResult]]:
    """Run the chosen ``parts`` (replay, overhead, rps), each on its own fleet, and print
    their tables."""
    model = config.replay_fleet.model
    prompts = text_prompts(model)
    say = console.log
    replays: list[ReplayRow] = []
    overhead: list[OverheadResult] = []
    rps: list[RpsResult] = []
    peers = [s.name for s in config.routers if s.kind == "vllm-router"]
    baseline = (
        "vllm-router:cache_aware" if "vllm-router:cache_aware" in peers else next(iter(peers), "")
    )
    if "replay" in parts:
        for label, trace in traces:
            prompts.check(trace[:20])
            fleet = Fleet(config.replay_fleet, log_dir / f"replay-{label}")
            try:
                fleet.start()
                rows = replay_routers(fleet, config.routers, trace, prompts,
                                      time_scale=config.time_scale, progress=say)  # fmt: skip
            finally:
                fleet.close()
            render_replays(rows, console, f"{label}: {len(trace)} requests, "
                           f"{config.replay_fleet.workers} sim workers")  # fmt: skip
            replays += rows
    if "overhead" in parts:
        one = FleetConfig(workers=1, time_scale=0.0, model=model, hbm_blocks=8192,
                          dram_blocks=0)  # fmt: skip
        fleet = Fleet(one, log_dir / "overhead")
        try:
            fleet.start()
            overhead = measure_overhead(fleet, config.routers, prompts,
                                        probes=config.overhead_probes, seed=config.seed,
                                        progress=say)  # fmt: skip
        finally:
            fleet.close()
        render_overhead(overhead, console, baseline)
    if "rps" in parts:
        many = FleetConfig(workers=config.rps_workers, time_scale=0.0, model=model)
        fleet = Fleet(many, log_dir / "rps")
        try:
            fleet.start()
            rps = measure_rps(fleet, config.routers, prompts, clients=config.rps_clients,
                              seconds=config.rps_seconds, warm_s=config.rps_warm_s,
                              seed=config.seed, progress=say)  # fmt: skip
        finally:
            fleet.close()
        render_rps(rps, console, baseline)
    return replays, overhead, rps
