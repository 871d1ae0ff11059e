"""Trace files: round trip, validation with line numbers, time scale, token synthesis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from indexer.keys import block_keys, root_parent
from kvrouter.bench.trace import (
    HASH_BLOCK_TOKENS,
    PromptFactory,
    TraceError,
    TraceRecord,
    arrival_times,
    block_tokens,
    read_trace,
    write_trace,
)

ROOT = root_parent("llama3-8b")
_M64 = (1 << 64) - 1


def splitmix64(seed: int, count: int) -> list[int]:
    """Vigna's reference SplitMix64, in plain Python integers: ``count`` outputs from ``seed``."""
    state, out = seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def line(**fields: object) -> str:
    rec: dict[str, object] = {
        "timestamp": 0,
        "input_length": 600,
        "output_length": 8,
        "hash_ids": [1, 2],
    }
    rec.update(fields)
    return json.dumps(rec)


def test_a_trace_survives_a_write_and_read(tmp_path: Path) -> None:
    records = [
        TraceRecord(0, 1000, 20, [0, 1]),
        TraceRecord(12.5, 513, 1, [0, 7]),
        TraceRecord(40, 3, 200, [2**64 - 1]),
    ]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, records) == 3
    assert read_trace(path) == records
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}


def test_reads_mooncake_lines_skipping_blanks_and_honouring_limit(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "m.jsonl",
        [
            '{"timestamp": 27482, "input_length": 6955, "output_length": 52, '
            '"hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]}',
            "",
            line(timestamp=30000),
            line(timestamp=31000),
        ],
    )
    assert [r.timestamp for r in read_trace(path)] == [27482, 30000, 31000]
    assert [r.input_length for r in read_trace(path, limit=2)] == [6955, 600]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "invalid"),
        (line(input_length=0), "input_length"),
        (line(output_length=0), "output_length"),
        (line(timestamp=-1), "timestamp"),
        (line(hash_ids=[]), "hash_ids"),
        (line(hash_ids=[-3]), "hash_ids"),
        (line(hash_ids=[2**64]), "64-bit"),
        (line(hash_ids="abc"), "hash_ids"),
        ('{"timestamp": 0, "input_length": 5}', "output_length"),
    ],
)
def test_a_bad_line_is_reported_with_its_line_number(tmp_path: Path, bad: str, reason: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [line(), line(), bad, line()])
    with pytest.raises(TraceError, match=rf"bad\.jsonl:3: .*{reason}"):
        read_trace(path)


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


def test_time_scale_multiplies_the_arrival_rate() -> None:
    records = [TraceRecord(ts, 10, 1, [1]) for ts in (5000, 5000, 6000, 9000)]
    assert arrival_times(records) == [0.0, 0.0, 1.0, 4.0]
    assert arrival_times(records, 2.0) == [0.0, 0.0, 0.5, 2.0]
    assert arrival_times(records, 0.5) == [0.0, 0.0, 2.0, 8.0]
    for scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="time scale"):
            arrival_times(records, scale)


def test_block_tokens_are_splitmix64_of_the_hash_id() -> None:
    for hid in (0, 1, 46, 123_456_789, 2**64 - 1):
        expected = [z % 32000 for z in splitmix64(hid, HASH_BLOCK_TOKENS)]
        assert block_tokens(hid) == expected
    assert block_tokens(7, 10, vocab_size=151_936) == [z % 151_936 for z in splitmix64(7, 10)]


def test_another_process_synthesizes_the_same_prompt() -> None:
    record = TraceRecord(0, 1300, 4, [11, 12, 13])
    code = (
        "import json\n"
        "from kvrouter.bench.trace import PromptFactory, TraceRecord\n"
        "print(json.dumps(PromptFactory(16, 0).tokens(TraceRecord(0, 1300, 4, [11, 12, 13]))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == PromptFactory(16, 0).tokens(record)


def test_prompt_tokens_concatenate_blocks_truncate_and_pad() -> None:
    factory = PromptFactory(16, ROOT)
    short = factory.tokens(TraceRecord(0, 700, 1, [5, 6, 99]))
    assert short == block_tokens(5) + block_tokens(6)[:188]
    long = factory.tokens(TraceRecord(0, 1500, 1, [5, 6]))
    assert long == block_tokens(5) + block_tokens(6, 988)
    assert long[:700] == short
    assert max(long) < 32000


@pytest.mark.parametrize("block_size", [16, 24, 512])
def test_prompt_keys_are_the_block_keys_of_its_tokens(block_size: int) -> None:
    factory = PromptFactory(block_size, ROOT)
    records = [
        TraceRecord(0, 1300, 1, [1, 2, 3]),
        TraceRecord(0, 1600, 1, [1, 2, 3, 4]),
        TraceRecord(0, 1300, 1, [1, 2, 3]),
        TraceRecord(0, 2100, 1, [1, 2]),
        TraceRecord(0, 400, 1, [1]),
        TraceRecord(0, 1100, 1, [9, 2, 3]),
    ]
    for rec in records:
        assert factory.keys(rec) == block_keys(factory.tokens(rec), block_size, ROOT)


def test_prompts_sharing_leading_hash_ids_share_leading_keys() -> None:
    factory = PromptFactory(16, ROOT)
    a = factory.keys(TraceRecord(0, 1536, 1, [1, 2, 3]))
    b = factory.keys(TraceRecord(0, 1536, 1, [1, 2, 4]))
    c = factory.keys(TraceRecord(0, 1536, 1, [7, 2, 3]))
    per = HASH_BLOCK_TOKENS // 16
    assert a[: 2 * per] == b[: 2 * per]
    assert a[2 * per] != b[2 * per]
    assert not set(a) & set(c)


def test_factory_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PromptFactory(0, ROOT)
    with pytest.raises(ValueError, match="hash id"):
        block_tokens(-1)
