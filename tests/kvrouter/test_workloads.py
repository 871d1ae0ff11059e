"""Workload generators: deterministic per seed, and shaped as their workload says."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord, read_trace
from kvrouter.bench.workloads import (
    AgentWorkload,
    ChatWorkload,
    GroupsWorkload,
    WorkloadError,
    generate,
)
from kvrouter.cli import app

CHAT = ChatWorkload(sessions=12, turns=4, system_tokens=1024, session_rate=5.0)
GROUPS = GroupsWorkload(groups=5, users=4, system_tokens=2048, question_tokens=300, requests=120)
AGENT = AgentWorkload(agents=5, steps=8, system_tokens=1024, context_min=4096, context_max=9000)


def by_stream(records: list[TraceRecord], own_from: int) -> dict[int, list[TraceRecord]]:
    """Records grouped by their first id after ``own_from`` shared blocks, in arrival order."""
    groups: dict[int, list[TraceRecord]] = defaultdict(list)
    for rec in records:
        groups[rec.hash_ids[own_from]].append(rec)
    return {k: sorted(v, key=lambda r: r.timestamp) for k, v in groups.items()}


@pytest.mark.parametrize("workload", [CHAT, GROUPS, AGENT])
def test_the_same_seed_gives_the_same_trace(workload: ChatWorkload) -> None:
    first = generate(workload, seed=7)
    assert generate(workload, seed=7) == first
    assert generate(workload, seed=8) != first
    assert [r.timestamp for r in first] == sorted(r.timestamp for r in first)


def test_each_chat_turn_extends_the_previous_turn() -> None:
    records = generate(CHAT, seed=3)
    assert len(records) == CHAT.sessions * CHAT.turns
    system_blocks = CHAT.system_tokens // HASH_BLOCK_TOKENS
    system_ids = records[0].hash_ids[:system_blocks]
    sessions = by_stream(records, system_blocks)
    assert len(sessions) == CHAT.sessions
    for turns in sessions.values():
        assert len(turns) == CHAT.turns
        for prev, cur in itertools.pairwise(turns):
            assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids
            assert cur.input_length >= prev.input_length + prev.output_length + 1
            assert cur.timestamp > prev.timestamp
        for rec in turns:
            assert rec.hash_ids[:system_blocks] == system_ids
            assert len(rec.hash_ids) == -(-rec.input_length // HASH_BLOCK_TOKENS)
    own = [set(t[-1].hash_ids[system_blocks:]) for t in sessions.values()]
    assert sum(map(len, own)) == len(set().union(*own))


def test_a_group_shares_its_system_prompt_and_nothing_else() -> None:
    records = generate(GROUPS, seed=5)
    assert len(records) == GROUPS.requests
    shared = GROUPS.system_tokens // HASH_BLOCK_TOKENS
    groups: dict[tuple[int, ...], set[tuple[int, ...]]] = defaultdict(set)
    for rec in records:
        assert rec.input_length == GROUPS.system_tokens + GROUPS.question_tokens
        groups[tuple(rec.hash_ids[:shared])].add(tuple(rec.hash_ids))
    assert len(groups) == GROUPS.groups
    assert all(len(prompts) == GROUPS.users for prompts in groups.values())
    system_ids = [set(k) for k in groups]
    assert sum(map(len, system_ids)) == len(set().union(*system_ids))
    tails = [p[shared:] for prompts in groups.values() for p in prompts]
    assert len({i for t in tails for i in t}) == sum(map(len, tails))


def test_a_system_prompt_ending_mid_block_is_not_shared_past_its_whole_blocks() -> None:
    odd = GroupsWorkload(groups=1, users=3, system_tokens=700, question_tokens=100, requests=30)
    prompts = {tuple(r.hash_ids) for r in generate(odd, seed=1)}
    assert len(prompts) == 3
    assert len({p[0] for p in prompts}) == 1
    assert len({p[1] for p in prompts}) == 3


def test_agent_contexts_grow_monotonically() -> None:
    records = generate(AGENT, seed=11)
    assert len(records) == AGENT.agents * AGENT.steps
    agents = by_stream(records, AGENT.system_tokens // HASH_BLOCK_TOKENS)
    assert len(agents) == AGENT.agents
    for steps in agents.values():
        assert AGENT.context_min <= steps[0].input_length <= AGENT.context_max
        for prev, cur in itertools.pairwise(steps):
            grown = cur.input_length - prev.input_length
            assert prev.output_length + AGENT.tool_tokens_min <= grown
            assert grown <= prev.output_length + AGENT.tool_tokens_max
            assert cur.hash_ids[: len(prev.hash_ids)] == prev.hash_ids


@pytest.mark.parametrize(
    "build",
    [
        lambda: ChatWorkload(sessions=0),
        lambda: ChatWorkload(think_time_s=float("nan")),
        lambda: GroupsWorkload(rate=-1.0),
        lambda: AgentWorkload(context_min=40_000, context_max=30_000),
        lambda: AgentWorkload(system_tokens=9000, context_min=8192),
        lambda: AgentWorkload(tool_tokens_min=500, tool_tokens_max=100),
    ],
)
def test_bad_parameters_are_refused(build: object) -> None:
    with pytest.raises(WorkloadError):
        build()  # type: ignore[operator]


def test_gen_command_writes_a_readable_trace(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    args = ["bench", "gen", "chat", "--out", str(out), "--seed", "4", "--sessions", "3"]
    result = CliRunner().invoke(app, [*args, "--turns", "2"])
    assert result.exit_code == 0, result.output
    assert read_trace(out) == generate(ChatWorkload(sessions=3, turns=2), seed=4)
    bad = CliRunner().invoke(app, ["bench", "gen", "groups", "--out", str(out), "--rate", "0"])
    assert bad.exit_code != 0
    assert "rate must be positive" in bad.output
