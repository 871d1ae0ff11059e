"""The offline simulator against an online replay of the same trace slice.

    python -m kvrouter.bench.sim_vs_live [--json PATH]

Starts a real cluster on this machine (embedded Redis, the indexer, ``sim``
workers timed by the Llama-3-8B/H100 profile, the gateway), replays a chat
trace through the gateway in real time (``kvrouter bench live``), then
replays the same trace in the offline simulator configured like the cluster
(workers, tiers, step budget, block size, heartbeat period), both with
``kv_ttft``, and prints both reports side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console

from kvrouter.bench.live import replay_live
from kvrouter.bench.report import render_table, summarize
from kvrouter.bench.simulator import SimConfig, simulate, trace_oracle
from kvrouter.bench.trace import TraceRecord
from kvrouter.bench.workloads import ChatWorkload, generate
from kvrouter.embedded_redis import EmbeddedRedis, free_port
from kvrouter.policy_factory import build_policy
from kvrouter.supervisor import Supervisor

MODEL = "tiny"
WORKERS = 4
TIERS = {"hbm": 512, "dram": 1024, "ssd": 2048}
STEP_BUDGET = 8192
MAX_SEQS = 256
HEARTBEAT_S = 1.0


def trace_slice(seed: int, sessions: int) -> list[TraceRecord]:
    """A multi-turn chat slice whose distinct content exceeds the cluster's HBM."""
    workload = ChatWorkload(
        sessions=sessions, turns=4, system_tokens=1024, user_tokens=256, answer_tokens=48,
        think_time_s=6.0, session_rate=4.0,
    )  # fmt: skip
    return generate(workload, seed)


def run_live(trace: list[TraceRecord], time_scale: float) -> Any:
    """Replay on a real cluster of sim workers behind the gateway."""
    py = [sys.executable, "-m", "kvrouter"]
    with EmbeddedRedis() as redis, tempfile.TemporaryDirectory() as logs:
        sup = Supervisor(Path(logs), env={"KVWORKER_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_S)})
        try:
            iport = free_port()
            children = [
                sup.spawn(
                    "indexer",
                    [*py, "indexer", "--redis", redis.url, "--metrics-port", str(iport)],
                    f"http://127.0.0.1:{iport}/metrics",
                )
            ]
            for i in range(WORKERS):
                port = free_port()
                args = [
                    *py, "worker", "--model", MODEL, "--runner", "sim", "--port", str(port),
                    "--name", f"w{i}", "--redis", redis.url, "--hbm-blocks", str(TIERS["hbm"]),
                    "--dram-blocks", str(TIERS["dram"]), "--ssd-blocks", str(TIERS["ssd"]),
                    "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", str(STEP_BUDGET),
                    "--log-level", "warning",
                ]  # fmt: skip
                children.append(sup.spawn(f"w{i}", args, f"http://127.0.0.1:{port}/health"))
            gport = free_port()
            children.append(
                sup.spawn(
                    "gateway",
                    [
                        *py,
                        "serve",
                        "--port",
                        str(gport),
                        "--model",
                        MODEL,
                        "--redis",
                        redis.url,
                        "--log-level",
                        "warning",
                    ],
                    f"http://127.0.0.1:{gport}/ready",
                )
            )
            sup.wait_healthy(children, 120)
            return asyncio.run(
                replay_live(
                    trace, f"http://127.0.0.1:{gport}", model=MODEL, time_scale=time_scale,
                    redis_url=redis.url,
                )
            )  # fmt: skip
        finally:
            sup.stop_all()


def main() -> None:
    """Run both replays and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=60)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console(width=170)
    trace = trace_slice(args.seed, args.sessions)
    live = run_live(trace, args.time_scale)
    live_summary = summarize("live kv_ttft", live.records, live.busy_s, live.oracle)
    config = SimConfig(
        workers=WORKERS, model=MODEL, hbm_blocks=TIERS["hbm"], dram_blocks=TIERS["dram"],
        ssd_blocks=TIERS["ssd"], max_num_seqs=MAX_SEQS, max_num_batched_tokens=STEP_BUDGET,
        view_interval_s=HEARTBEAT_S, time_scale=args.time_scale, seed=args.seed,
    )  # fmt: skip
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
