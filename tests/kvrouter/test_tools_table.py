"""The tools' shared table: the columns and JSON fields docs/benchmarks.md reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from kvrouter.tools.index_bench import FORMAT as INDEX_FORMAT
from kvrouter.tools.micro import FORMAT as MICRO_FORMAT
from kvrouter.tools.table import Row, p50_p99_ms, percentile, report

ROWS = [
    Row("lookup 8K", "ms", 2.0, 8.0, "naive", section="lookup", goal="< 2 ms"),
    Row("Redis time per lookup", "ms", 1.5, None, "", section="lookup"),
]


def _text(table: object) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_micro_format_keeps_its_columns_and_fields() -> None:
    """The micro benchmark shows the baseline's name and writes no section or goal."""
    header = _text(MICRO_FORMAT.table(ROWS[:1])).splitlines()[2]
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "benchmark", "unit", "ours", "baseline", "vs", "ours / baseline",
    ]  # fmt: skip
    assert MICRO_FORMAT.records(ROWS[:1]) == [
        {"name": "lookup 8K", "unit": "ms", "ours": 2.0, "baseline": 8.0,
         "baseline_name": "naive", "ratio": 0.25},
    ]  # fmt: skip


def test_index_format_keeps_sections_goals_and_empty_ratios() -> None:
    """The index benchmark's rows carry section and goal; a row without baseline has no ratio."""
    text = _text(INDEX_FORMAT.table(ROWS))
    assert "section" in text
    assert "goal" in text
    assert " vs " not in text
    records = INDEX_FORMAT.records(ROWS)
    assert list(records[0]) == [
        "section", "name", "unit", "ours", "baseline", "baseline_name", "goal", "ratio",
    ]  # fmt: skip
    assert records[1]["ratio"] is None
    assert records[1]["baseline"] is None


def test_report_writes_the_envelope(tmp_path: Path) -> None:
    """With an envelope, the file holds it and the records under ``rows``."""
    path = tmp_path / "out.json"
    report(ROWS[:1], MICRO_FORMAT, started=0.0, json_path=path, envelope={"threads": 1})
    payload = json.loads(path.read_text())
    assert payload["threads"] == 1
    assert payload["rows"] == MICRO_FORMAT.records(ROWS[:1])


def test_percentiles_are_measured_samples() -> None:
    """p50/p99 are samples themselves (nearest rank), reported in milliseconds."""
    samples = [i / 1000 for i in range(1, 101)]
    assert percentile(samples, 0.5) in samples
    assert p50_p99_ms("lookup", samples) == pytest.approx(
        {"lookup_p50_ms": 50.0, "lookup_p99_ms": 99.0}, abs=1.0
    )
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 0.5)
