"""Production-shaped workloads: heavy tails, growing sessions, bursts, shared documents."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrouter.bench.production import LogNormal, think_time
from kvrouter.bench.suite import CASES
from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord, read_trace
from kvrouter.bench.workloads import (
    ConversationWorkload,
    MixedWorkload,
    WorkloadError,
    generate,
)
from kvrouter.cli import app

CONVERSATION = ConversationWorkload()
MIXED = MixedWorkload()


@pytest.fixture(scope="module")
def conversation() -> list[TraceRecord]:
    return generate(CONVERSATION, seed=1)


@pytest.fixture(scope="module")
def mixed() -> list[TraceRecord]:
    return generate(MIXED, seed=1)


def _gap_cv(records: list[TraceRecord]) -> float:
    gaps = [b.timestamp - a.timestamp for a, b in itertools.pairwise(records)]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


@pytest.mark.parametrize(
    "workload",
    [ConversationWorkload(sessions=60), MixedWorkload(requests=200)],
    ids=["conversation", "mixed"],
)
def test_the_same_seed_gives_the_same_trace(workload: ConversationWorkload) -> None:
    first = generate(workload, seed=3)
    assert generate(workload, seed=3) == first
    assert generate(workload, seed=4) != first
    assert [r.timestamp for r in first] == sorted(r.timestamp for r in first)
    for rec in first:
        assert len(rec.hash_ids) == -(-rec.input_length // HASH_BLOCK_TOKENS)


def test_conversation_lengths_have_the_production_trace_shape(
    conversation: list[TraceRecord],
) -> None:
    lengths = [r.input_length for r in conversation]
    outputs = [r.output_length for r in conversation]
    # Mooncake's conversation trace: ~12K mean input, ~340 mean output, a tail past 100K.
    assert 10_000 <= statistics.fmean(lengths) <= 18_000
    assert statistics.median(lengths) < statistics.fmean(lengths) / 2
    assert max(lengths) > 100_000
    assert max(lengths) + max(outputs) <= CONVERSATION.max_context
    assert 250 <= statistics.fmean(outputs) <= 450
    assert statistics.median(outputs) < statistics.fmean(outputs)
    # Bursty arrivals: the gaps' coefficient of variation is well above Poisson's 1.
    assert _gap_cv(conversation) > 1.3


def test_conversation_turns_resend_the_whole_history() -> None:
    # Without shared documents, block 3 (after the 1536-token system prompt) is the
    # session's own first block: it names the session.
    workload = ConversationWorkload(sessions=300, document_share=0.0)
    records = generate(workload, seed=2)
    system_blocks = workload.system_tokens // HASH_BLOCK_TOKENS
    sessions: dict[int, list[TraceRecord]] = defaultdict(list)
    for rec in records:
        sessions[rec.hash_ids[system_blocks]].append(rec)
    assert len(sessions) == workload.sessions
    assert len({tuple(r.hash_ids[:system_blocks]) for r in records}) <= workload.apps
    turns = [len(t) for t in sessions.values()]
    assert 1.5 <= statistics.fmean(turns) <= 2.1
    assert max(turns) >= 6
    for session in sessions.values():
        for prev, cur in itertools.pairwise(session):
            # The whole history: every block of the previous prompt but its last, partly
            # filled one (whose id is that of the grown block), then the answer and more.
            whole = prev.input_length // HASH_BLOCK_TOKENS
            assert cur.hash_ids[:whole] == prev.hash_ids[:whole]
            assert cur.input_length > prev.input_length + prev.output_length
            assert cur.input_length + cur.output_length <= workload.max_context
            assert cur.timestamp > prev.timestamp


def _turn_gaps(records: list[TraceRecord], system_blocks: int) -> list[float]:
    """Seconds between a session's consecutive turns (without shared documents, the
    first block after the system prompt names the session)."""
    sessions: dict[int, list[TraceRecord]] = defaultdict(list)
    for rec in records:
        sessions[rec.hash_ids[system_blocks]].append(rec)
    return [
        (b.timestamp - a.timestamp) / 1e3
        for turns in sessions.values()
        for a, b in itertools.pairwise(turns)
    ]


def test_returning_sessions_come_back_as_late_as_in_the_mooncake_trace() -> None:
    # The suite's held-out `returning` case: Mooncake's conversation trace brings a
    # session's next turn a median of ~100 s after the last (p90 312-372 s) in windows of
    # ~900 s; the chatbot think time of `conversation` brings it back within ~16 s.
    case = CASES["returning"].workload
    assert isinstance(case, ConversationWorkload)
    returning = dataclasses.replace(case, document_share=0.0)
    system_blocks = returning.system_tokens // HASH_BLOCK_TOKENS
    records = generate(returning, seed=2)
    gaps = _turn_gaps(records, system_blocks)
    assert 85 <= statistics.median(gaps) <= 125
    assert 270 <= statistics.quantiles(gaps, n=10)[-1] <= 400
    chat = _turn_gaps(generate(dataclasses.replace(CONVERSATION, document_share=0.0), 2), 3)
    assert statistics.median(chat) < 25
    # The window cuts the turns past it, so the rate stays steady to the end: the last
    # fifth of the window carries about a fifth of the requests.
    assert records[-1].timestamp <= returning.horizon_s * 1e3
    late = sum(r.timestamp > 0.8 * returning.horizon_s * 1e3 for r in records)
    assert 0.15 <= late / len(records) <= 0.25


def test_a_conversation_window_drops_only_the_turns_past_it() -> None:
    whole = generate(ConversationWorkload(sessions=200, think_time_s=think_time(60, 1.0)), 5)
    window = generate(
        ConversationWorkload(sessions=200, think_time_s=think_time(60, 1.0), horizon_s=150.0), 5
    )
    assert window == [r for r in whole if r.timestamp <= 150_000]
    assert len(window) < len(whole)


def test_conversation_documents_are_shared_across_sessions(
    conversation: list[TraceRecord],
) -> None:
    # Group requests by their first block after the system prompt. A group that is not
    # one session's chain of turns (one prompt not a prefix of the longest) holds several
    # sessions that opened on the same shared document.
    system_blocks = CONVERSATION.system_tokens // HASH_BLOCK_TOKENS
    groups: dict[int, list[TraceRecord]] = defaultdict(list)
    for rec in conversation:
        groups[rec.hash_ids[system_blocks]].append(rec)
    shared = 0
    for group in groups.values():
        longest = max(group, key=lambda r: r.input_length).hash_ids
        for rec in group:
            whole = rec.input_length // HASH_BLOCK_TOKENS
            if rec.hash_ids[:whole] != longest[:whole]:
                shared += 1
                break
    assert shared >= 5


def test_mixed_sends_short_and_very_long_prompts_together(mixed: list[TraceRecord]) -> None:
    assert len(mixed) == MIXED.requests
    long = [r for r in mixed if r.input_length >= MIXED.document_tokens.low]
    short = [r for r in mixed if r.input_length < 4_096]
    assert 0.07 <= len(long) / len(mixed) <= 0.13
    assert len(short) > 0.6 * len(mixed)
    assert max(r.input_length for r in long) > 100_000
    # The long prompts are about shared documents: several requests per document.
    doc_blocks = int(MIXED.document_tokens.low) // HASH_BLOCK_TOKENS
    documents = {tuple(r.hash_ids[:doc_blocks]) for r in long}
    assert len(documents) < 0.7 * len(long)
    # Short and long requests interleave: long ones are not all in one stretch.
    quarter = len(mixed) // 4
    for part in range(4):
        window = mixed[part * quarter : (part + 1) * quarter]
        assert any(r.input_length >= MIXED.document_tokens.low for r in window)
    assert _gap_cv(mixed) > 1.3


@pytest.mark.parametrize(
    "build",
    [
        lambda: ConversationWorkload(sessions=0),
        lambda: ConversationWorkload(turns_mean=0.5),
        lambda: ConversationWorkload(document_share=1.5),
        lambda: ConversationWorkload(max_context=4_096),
        lambda: ConversationWorkload(horizon_s=0.0),
        lambda: think_time(0.0, 1.0),
        lambda: MixedWorkload(rate=0.0),
        lambda: MixedWorkload(long_share=-0.1),
        lambda: LogNormal(100, -1.0),
        lambda: LogNormal(100, 1.0, 50, 10),
    ],
)
def test_bad_parameters_are_refused(build: object) -> None:
    with pytest.raises(WorkloadError):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("family", "args", "workload"),
    [
        ("conversation", ["--sessions", "20"], ConversationWorkload(sessions=20)),
        (
            "conversation",
            [
                "--sessions",
                "40",
                "--think-time-s",
                "130",
                "--think-time-sigma",
                "1.2",
                "--horizon-s",
                "60",
            ],
            ConversationWorkload(sessions=40, think_time_s=think_time(130, 1.2), horizon_s=60),
        ),
        ("mixed", ["--requests", "50", "--long-share", "0.3"], MixedWorkload(50, long_share=0.3)),
    ],
)
def test_gen_command_writes_the_workload(
    tmp_path: Path, family: str, args: list[str], workload: ConversationWorkload
) -> None:
    out = tmp_path / f"{family}.jsonl"
    result = CliRunner().invoke(app, ["bench", "gen", family, "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    assert read_trace(out) == generate(workload, seed=0)
    bad = CliRunner().invoke(app, ["bench", "gen", family, "--out", str(out), "--apps", "0"])
    assert bad.exit_code != 0
    assert "apps must be positive" in bad.output
