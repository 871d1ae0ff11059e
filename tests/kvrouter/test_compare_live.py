"""``kvrouter bench compare``: every router, live, in front of one restarted sim fleet."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from engine_worker.tokenizer import load_tokenizer
from indexer.keys import root_parent
from kvrouter.bench.compare_live import CompareConfig, run_compare
from kvrouter.bench.fleet import FleetConfig, RouterSpec, vllm_events_supported
from kvrouter.bench.text_prompts import TextPrompts
from kvrouter.bench.trace import TraceRecord


def _chat_trace() -> list[TraceRecord]:
    """Three sessions of three turns, each turn extending its session's hash ids."""
    trace = []
    for s in range(3):
        ids = [5000 * s + 1]
        for turn in range(3):
            ids = [*ids, 5000 * s + 10 + turn]
            trace.append(
                TraceRecord(timestamp=turn * 400 + s * 60, input_length=len(ids) * 512 - 70,
                            output_length=3, hash_ids=list(ids))
            )  # fmt: skip
    return sorted(trace, key=lambda r: r.timestamp)


def test_text_prompts_tokenize_back_to_their_tokens_and_keep_shared_prefixes() -> None:
    prompts = TextPrompts(load_tokenizer("tiny"), 16, root_parent("tiny"))
    trace = _chat_trace()
    prompts.check(trace)
    first, second = [prompts.token_ids(r) for r in trace if r.hash_ids[0] == 1][:2]
    # Turn 2 of a session starts with all of turn 1 (954 tokens: 59 whole blocks).
    assert second[: len(first)] == first
    assert len(prompts.text(trace[0]).split()) == trace[0].input_length


def _installed(name: str) -> bool:
    return (Path(sys.executable).parent / name).exists() or shutil.which(name) is not None


@pytest.mark.slow
def test_compare_serves_every_request_through_every_router(tmp_path: Path) -> None:
    specs = [RouterSpec.parse("kvrouter")]
    if _installed("vllm-router"):
        specs += [RouterSpec.parse("vllm-router:round_robin"),
                  RouterSpec.parse("vllm-router:cache_aware")]  # fmt: skip
        if vllm_events_supported():
            specs.append(RouterSpec.parse("vllm-router:kv_aware"))
    if _installed("sglang-router"):
        specs.append(RouterSpec.parse("sglang-router:cache_aware"))
    config = CompareConfig(
        specs, FleetConfig(workers=2, time_scale=0.0, hbm_blocks=512, dram_blocks=512),
        overhead_probes=2, rps_workers=1, rps_clients=4, rps_seconds=1.0, rps_warm_s=0.2,
    )  # fmt: skip
    console = Console(width=200, record=True)
    replays, overhead, rps = run_compare(
        [("chat", _chat_trace())], config, ["replay", "overhead", "rps"], tmp_path, console
    )
    names = [s.name for s in specs]
    assert [r.summary.policy for r in replays] == names
    for row in replays:
        assert row.errors == 0
        assert row.summary.completed == row.summary.requests == 9
        # Later turns reuse their session's earlier turns, whichever router routes them.
        assert row.summary.hit_rate > 0
    assert {(o.router, o.prompts) for o in overhead} == {(n, k) for n in names
                                                         for k in ("short", "long")}  # fmt: skip
    assert all(o.errors == 0 and o.probes == 2 for o in overhead)
    assert [r.target for r in rps] == ["direct", *names]
    assert all(r.requests > 0 and r.errors == 0 for r in rps)
    text = console.export_text()
    for name in names:
        assert name in text
