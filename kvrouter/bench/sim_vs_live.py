"""The offline simulator against an online replay of the same trace slice.

    python -m kvrouter.bench.sim_vs_live [--no-stream] [--json PATH]
    python -m kvrouter.bench.sim_vs_live --pd always [--json PATH]

Starts a real cluster on this machine (embedded Redis, the indexer, ``sim``
workers timed by the Llama-3-8B/H100 profile, the gateway), replays a chat
trace through the gateway in real time (``kvrouter bench live``), then
replays the same trace in the offline simulator configured like the cluster
(workers, tiers, step budget, block size, heartbeat period), both with
``kv_ttft``, and prints both reports side by side.

``--pd always|auto`` runs prefill/decode disaggregation instead: the cluster
has ``--prefill-workers`` prefill-only and ``--decode-workers`` decode-only
workers (hosts ``p0``..., ``d0``..., as the simulator names them) and the
gateway splits with ``--pd``; the slice has long prompts (a 2K shared system
prompt and 1K user turns), so prefill is substantial. A split request's hit is
what the prefill worker's cache served (the live replay reads it from the
gateway's decision header). The live ``sim`` workers move placeholder
blocks and take the modeled time of the profile's KV bytes at
``--transfer-gbps`` (default 12.5, as the simulator's default); the simulator
moves KV at the same bandwidth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from indexer.profile import DEFAULT_TRANSFER_BANDWIDTH
from kvrouter.bench.live import LiveResult, replay_live
from kvrouter.bench.report import PolicySummary, RequestRecord, render_table, summarize
from kvrouter.bench.simulator import SimConfig, simulate, trace_oracle
from kvrouter.bench.trace import TraceRecord
from kvrouter.bench.workloads import ChatWorkload, generate
from kvrouter.embedded_redis import EmbeddedRedis, free_port
from kvrouter.gateway.pd import PdMode
from kvrouter.policy_factory import build_policy
from kvrouter.supervisor import Supervisor

__all__ = ["Cluster", "Comparison", "compare", "main", "pd_slice", "trace_slice"]

MODEL = "tiny"
WORKERS = 4
TIERS = {"hbm": 512, "dram": 1024, "ssd": 2048}
#: PD: prompts of 3K-6K tokens; decoders hold several of them at once.
PD_TIERS = {"hbm": 2048, "dram": 4096, "ssd": 0}
STEP_BUDGET = 8192
MAX_SEQS = 256
HEARTBEAT_S = 1.0
_PD_LINE = re.compile(
    r'^kvrouter_pd_(requests|fallbacks)_total\{\w+="(\w+)"\} ([0-9.eE+-]+)$', re.M
)


@dataclass(frozen=True, slots=True)
class Cluster:
    """The live cluster and the simulator's twin of it."""

    workers: int = WORKERS
    prefill_workers: int = 0
    decode_workers: int = 0
    pd: PdMode = "never"
    tiers: tuple[tuple[str, int], ...] = tuple(TIERS.items())

    def roles(self) -> list[tuple[str, str]]:
        """(host, role) of every worker, named as the simulator names them."""
        return [
            *((f"w{i}", "both") for i in range(self.workers)),
            *((f"p{i}", "prefill") for i in range(self.prefill_workers)),
            *((f"d{i}", "decode") for i in range(self.decode_workers)),
        ]

    def sim_config(self, time_scale: float, seed: int, transfer_bandwidth: float) -> SimConfig:
        """The offline simulator configured like the live cluster."""
        t = dict(self.tiers)
        return SimConfig(
            workers=self.workers, prefill_workers=self.prefill_workers,
            decode_workers=self.decode_workers, pd=self.pd, model=MODEL,
            hbm_blocks=t["hbm"], dram_blocks=t["dram"], ssd_blocks=t["ssd"],
            max_num_seqs=MAX_SEQS, max_num_batched_tokens=STEP_BUDGET,
            view_interval_s=HEARTBEAT_S, time_scale=time_scale, seed=seed,
            transfer_bandwidth=transfer_bandwidth,
        )  # fmt: skip


def trace_slice(seed: int, sessions: int) -> list[TraceRecord]:
    """A multi-turn chat slice whose distinct content exceeds the cluster's HBM."""
    workload = ChatWorkload(
        sessions=sessions, turns=4, system_tokens=1024, user_tokens=256, answer_tokens=48,
        think_time_s=6.0, session_rate=4.0,
    )  # fmt: skip
    return generate(workload, seed)


def pd_slice(seed: int, sessions: int, session_rate: float = 1.0) -> list[TraceRecord]:
    """A chat slice with long prompts (2K shared + 1K per user turn, 3 turns: 3K-6K tokens)."""
    workload = ChatWorkload(
        sessions=sessions, turns=3, system_tokens=2048, user_tokens=1024, answer_tokens=48,
        think_time_s=6.0, session_rate=session_rate,
    )  # fmt: skip
    return generate(workload, seed)


def _gateway_pd_counts(url: str) -> dict[str, float]:
    """The gateway's ``kvrouter_pd_requests_total`` / ``_fallbacks_total`` by label."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f"{kind}:{label}": float(v) for kind, label, v in _PD_LINE.findall(text)}


def run_live(
    trace: list[TraceRecord],
    time_scale: float,
    cluster: Cluster | None = None,
    transfer_bandwidth: float = DEFAULT_TRANSFER_BANDWIDTH,
    stream: bool = True,
) -> tuple[LiveResult, dict[str, float]]:
    """Replay on a real cluster of sim workers behind the gateway (their KV pulls modeled
    at ``transfer_bandwidth``), with streaming requests or not; also the gateway's PD
    counters (empty without PD)."""
    spec = cluster or Cluster()
    tiers = dict(spec.tiers)
    py = [sys.executable, "-m", "kvrouter"]
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory() as logs:
        env = {
            "KVWORKER_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S),
            "KVWORKER_SIM_TRANSFER_BANDWIDTH": repr(transfer_bandwidth),
        }
        sup = Supervisor(Path(logs), env=env)
        try:
            iport = free_port()
            children = [
                sup.spawn(
                    "indexer",
                    [*py, "indexer", "--redis", redis.url, "--metrics-port", str(iport)],
                    f"http://127.0.0.1:{iport}/metrics",
                )
            ]
            for host, role in spec.roles():
                port = free_port()
                args = [
                    *py, "worker", "--model", MODEL, "--runner", "sim", "--port", str(port),
                    "--name", host, "--redis", redis.url, "--hbm-blocks", str(tiers["hbm"]),
                    "--dram-blocks", str(tiers["dram"]), "--ssd-blocks", str(tiers["ssd"]),
                    "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", str(STEP_BUDGET),
                    "--log-level", "warning",
                ]  # fmt: skip
                if role != "both":
                    args += ["--role", role]
                children.append(sup.spawn(host, args, f"http://127.0.0.1:{port}/health"))
            gport = free_port()
            serve = [*py, "serve", "--port", str(gport), "--model", MODEL, "--redis", redis.url,
                     "--log-level", "warning"]  # fmt: skip
            if spec.pd != "never":
                serve += ["--pd", spec.pd]
            children.append(sup.spawn("gateway", serve, f"http://127.0.0.1:{gport}/ready"))
            sup.wait_healthy(children, 120)
            gateway = f"http://127.0.0.1:{gport}"
            live = asyncio.run(
                replay_live(
                    trace, gateway, model=MODEL, time_scale=time_scale, redis_url=redis.url,
                    decisions=spec.pd != "never", stream=stream,
                )
            )  # fmt: skip
            counts = _gateway_pd_counts(gateway) if spec.pd != "never" else {}
            return live, counts
        finally:
            sup.stop_all()


@dataclass(slots=True)
class Comparison:
    """Both replays of one slice."""

    requests: int
    offline: PolicySummary
    live: PolicySummary
    offline_records: list[RequestRecord]
    live_records: list[RequestRecord]
    errors: int
    gateway_pd: dict[str, float]

    @staticmethod
    def split(records: Sequence[RequestRecord]) -> tuple[int, int]:
        """(disaggregated, colocated) requests."""
        pd = sum(r.prefill_worker is not None for r in records)
        return pd, len(records) - pd

    @staticmethod
    def per_worker(records: Sequence[RequestRecord], prefill: bool = False) -> dict[str, int]:
        """Requests each worker decoded (or, with ``prefill``, prefilled)."""
        hosts = (r.prefill_worker or r.worker if prefill else r.worker for r in records)
        return dict(sorted(Counter(hosts).items()))

    def to_json(self) -> dict[str, Any]:
        """The figures as plain data."""

        def fields(s: PolicySummary) -> dict[str, Any]:
            return {f: getattr(s, f) for f in s.__struct_fields__}

        out: dict[str, Any] = {"requests": self.requests, "errors": self.errors}
        for label, s, recs in (
            ("offline", self.offline, self.offline_records),
            ("live", self.live, self.live_records),
        ):
            pd, colocated = self.split(recs)
            out[label] = {
                **fields(s), "disaggregated": pd, "colocated": colocated,
                "decoded_per_worker": self.per_worker(recs),
                "prefilled_per_worker": self.per_worker(recs, prefill=True),
            }  # fmt: skip
        if self.gateway_pd:
            out["gateway_pd_counters"] = self.gateway_pd
        return out


def compare(
    trace: list[TraceRecord],
    cluster: Cluster,
    *,
    time_scale: float = 1.0,
    seed: int = 1,
    transfer_bandwidth: float = DEFAULT_TRANSFER_BANDWIDTH,
) -> Comparison:
    """Replay ``trace`` live on ``cluster`` and offline on its twin, both with ``kv_ttft``
    and KV moving at ``transfer_bandwidth``."""
    live, counts = run_live(trace, time_scale, cluster, transfer_bandwidth)
    live_summary = summarize("live kv_ttft", live.records, live.busy_s, live.oracle)
    config = cluster.sim_config(time_scale, seed, transfer_bandwidth)
    sim = simulate(trace, build_policy("kv_ttft", seed=seed), config)
    sim_summary = summarize("offline kv_ttft", sim.records, sim.busy_s, trace_oracle(trace, config))
    return Comparison(
        len(trace), sim_summary, live_summary, sim.records, live.records, live.errors, counts
    )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.0f} ms"


def render_pd(c: Comparison, console: Console) -> None:
    """The PD comparison, one column per replay."""
    table = Table(title=f"PD: offline simulator vs online replay ({c.requests} requests)")
    for col in ("", "offline simulator", "online, through the gateway"):
        table.add_column(col, justify="left" if not col else "right")
    pairs = ((c.offline, c.offline_records), (c.live, c.live_records))

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *(cell(s, recs) for s, recs in pairs))

    row("hit rate", lambda s, r: f"{s.hit_rate:.1%}")
    row("hbm / dram / ssd", lambda s, r: " / ".join(
        f"{s.hit_rate_by_medium[m]:.1%}" for m in ("hbm", "dram", "ssd")))  # fmt: skip
    row("disaggregated / colocated", lambda s, r: "{} / {}".format(*Comparison.split(r)))
    row("prefilled per worker", lambda s, r: _counts(Comparison.per_worker(r, prefill=True)))
    row("decoded per worker", lambda s, r: _counts(Comparison.per_worker(r)))
    row("TTFT p50 / p90", lambda s, r: f"{_ms(s.ttft_p50_s)} / {_ms(s.ttft_p90_s)}")
    row("TPOT p50 / p90", lambda s, r: f"{_ms(s.tpot_p50_s)} / {_ms(s.tpot_p90_s)}")
    row("completed", lambda s, r: f"{s.completed} / {s.requests}")
    row("preemptions", lambda s, r: str(s.preemptions))
    console.print(table)


def _counts(per: dict[str, int]) -> str:
    return " ".join(f"{h}:{n}" for h, n in per.items())


def main() -> None:
    """Run both replays and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=None,
                    help="chat sessions (default: 60; 30 with --pd)")  # fmt: skip
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pd", choices=("always", "auto"), default=None,
                    help="prefill/decode disaggregation (default: colocated workers)")  # fmt: skip
    ap.add_argument("--prefill-workers", type=int, default=2)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--session-rate", type=float, default=1.0,
                    help="--pd: sessions started per second")  # fmt: skip
    ap.add_argument("--transfer-gbps", type=float, default=DEFAULT_TRANSFER_BANDWIDTH / 1e9,
                    help="KV transfer bandwidth, modeled by the live sim workers and the "
                    "simulator alike (default: 12.5)")  # fmt: skip
    ap.add_argument("--no-stream", action="store_true",
                    help="colocated: the live replay sends non-streaming requests (its TTFT "
                    "is then blank; hit rates and requests per worker compare)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console(width=170)
    if args.pd is not None:
        trace = pd_slice(args.seed, args.sessions or 30, args.session_rate)
        cluster = Cluster(
            workers=0, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
            pd=args.pd, tiers=tuple(PD_TIERS.items()),
        )  # fmt: skip
        bandwidth = args.transfer_gbps * 1e9
        c = compare(trace, cluster, time_scale=args.time_scale, seed=args.seed,
                    transfer_bandwidth=bandwidth)  # fmt: skip
        render_pd(c, console)
        if c.gateway_pd:
            console.print(f"gateway PD counters: {c.gateway_pd}")
        if c.errors:
            console.print(f"[red]{c.errors} live requests failed[/red]")
        if args.json:
            args.json.write_text(json.dumps(c.to_json(), indent=2))
        return
    trace = trace_slice(args.seed, args.sessions or 60)
    live, _ = run_live(
        trace, args.time_scale, transfer_bandwidth=args.transfer_gbps * 1e9,
        stream=not args.no_stream,
    )  # fmt: skip
    live_summary = summarize("live kv_ttft", live.records, live.busy_s, live.oracle)
    config = Cluster().sim_config(args.time_scale, args.seed, args.transfer_gbps * 1e9)
    sim = simulate(trace, build_policy("kv_ttft", seed=args.seed), config)
    sim_summary = summarize("offline kv_ttft", sim.records, sim.busy_s, trace_oracle(trace, config))
    render_table([sim_summary, live_summary], console, title="offline simulator vs online replay")
    if live.errors:
        console.print(f"[red]{live.errors} live requests failed[/red]")
    for label, records in (("offline", sim.records), ("live", live.records)):
        per_worker = Counter(r.worker for r in records)
        console.print(f"{label} requests per worker: {dict(sorted(per_worker.items()))}")
    ratio = live_summary.hit_rate / sim_summary.hit_rate if sim_summary.hit_rate else float("nan")
    console.print(
        f"hit rate: offline {sim_summary.hit_rate:.1%}, live {live_summary.hit_rate:.1%} "
        f"(live / offline {ratio:.3f}); {len(trace)} requests"
    )
    if args.json:
        out = {"offline": sim_summary, "live": live_summary, "errors": live.errors}
        args.json.write_text(json.dumps(out, default=lambda o: o.__struct_fields__ and {
            f: getattr(o, f) for f in o.__struct_fields__}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
