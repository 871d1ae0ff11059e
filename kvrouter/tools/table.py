"""One way for the tools to show timing results: rich tables, p50/p99, JSON files.

Every tool in :mod:`kvrouter.tools` measures a figure of ours beside a baseline
in the same run and reports the ratio; the rows, their table and their JSON
records live here, so that each tool says only what it measures. A tool picks
the columns it shows with a :class:`RowFormat` (a ``section`` column first, a
``vs`` column naming the baseline, a ``goal`` column last); the same choice
picks the fields of its JSON records, which docs/benchmarks.md reads, so the
table and the file never disagree.

Tools whose results are not rows of ours-beside-baseline (per-round transfer
figures, the gateway's p50/p99 grid) use :func:`grid`, :func:`percentile` and
:func:`write_json` directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

__all__ = [
    "Row",
    "RowFormat",
    "grid",
    "p50_p99_ms",
    "percentile",
    "report",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class Row:
    """One figure of ours beside the baseline's, from the same run.

    ``baseline`` is None for a figure shown for context only (no ratio);
    ``section`` and ``goal`` appear only where the tool's format shows them.
    """

    name: str
    unit: str
    ours: float
    baseline: float | None
    baseline_name: str
    section: str = ""
    goal: str = ""

    @property
    def ratio(self) -> float | None:
        """ours / baseline (for rates, 1.0 means no overhead); None without a baseline."""
        return None if not self.baseline else self.ours / self.baseline


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How one tool shows its rows: the table's title, digits and optional columns.

    Columns, left to right: [section] benchmark, unit, ours, baseline, [vs],
    ours / baseline, [goal]. The JSON records carry the same optional fields
    (``section``, ``goal``) in the same order, plus ``baseline_name`` and
    ``ratio`` always.
    """

    title: str
    digits: int = 4
    sections: bool = False
    baseline_names: bool = True
    goals: bool = False

    def _columns(self) -> list[tuple[str, Literal["left", "right"]]]:
        columns: list[tuple[str, Literal["left", "right"]]] = []
        if self.sections:
            columns.append(("section", "left"))
        columns += [("benchmark", "left"), ("unit", "right"), ("ours", "right")]
        columns.append(("baseline", "right"))
        if self.baseline_names:
            columns.append(("vs", "left"))
        columns.append(("ours / baseline", "right"))
        if self.goals:
            columns.append(("goal", "right"))
        return columns

    def table(self, rows: Iterable[Row]) -> Table:
        """A rich table of ``rows``."""
        table = Table(title=self.title)
        for name, justify in self._columns():
            table.add_column(name, justify=justify)
        figure = f",.{self.digits}g"
        for r in rows:
            cells = [r.section] if self.sections else []
            cells += [r.name, r.unit, format(r.ours, figure)]
            cells.append("" if r.baseline is None else format(r.baseline, figure))
            if self.baseline_names:
                cells.append(r.baseline_name)
            cells.append("" if r.ratio is None else f"{r.ratio:.3g}")
            if self.goals:
                cells.append(r.goal)
            table.add_row(*cells)
        return table

    def records(self, rows: Iterable[Row]) -> list[dict[str, object]]:
        """The rows as JSON-ready records, with the fields this format shows."""
        out = []
        for r in rows:
            record: dict[str, object] = {"section": r.section} if self.sections else {}
            record |= {
                "name": r.name,
                "unit": r.unit,
                "ours": r.ours,
                "baseline": r.baseline,
                "baseline_name": r.baseline_name,
            }
            if self.goals:
                record["goal"] = r.goal
            record["ratio"] = r.ratio
            out.append(record)
        return out


def report(
    rows: Sequence[Row],
    fmt: RowFormat,
    *,
    started: float,
    json_path: Path | None = None,
    notes: Iterable[str] = (),
    footer: str = "",
    envelope: Mapping[str, object] | None = None,
    width: int | None = None,
) -> None:
    """Print ``rows`` as ``fmt``'s table, the notes and the total time; write the JSON.

    Args:
        rows: The tool's results.
        fmt: The table's title and columns (also the JSON records' fields).
        started: ``time.perf_counter()`` when the tool started.
        json_path: Where to write the records, if anywhere.
        notes: Lines printed under the table.
        footer: Appended to the ``total N s`` line (versions, for instance).
        envelope: With it, the file holds ``{**envelope, "rows": records}``
            instead of the bare list of records.
        width: The console's width (None: the terminal's).
    """
    console = Console(width=width)
    console.print(fmt.table(rows))
    for note in notes:
        console.print(note)
    total = f"total {time.perf_counter() - started:.1f} s"
    console.print(f"{total}, {footer}" if footer else total)
    if json_path is not None:
        records = fmt.records(rows)
        write_json(json_path, records if envelope is None else {**envelope, "rows": records})


def grid(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    justify: Literal["left", "right"] = "left",
) -> Table:
    """A rich table of preformatted cells, for results that are not ours-beside-baseline rows."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify=justify)
    for row in rows:
        table.add_row(*row)
    return table


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples``: the nearest-rank sample, not interpolated.

    NOTE: a measured sample, never a value between two, so a p99 over a few
    hundred samples is one real request's time.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def p50_p99_ms(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """``{name}_p50_ms`` and ``{name}_p99_ms`` of samples given in seconds."""
    return {
        f"{name}_p50_ms": percentile(seconds, 0.5) * 1e3,
        f"{name}_p99_ms": percentile(seconds, 0.99) * 1e3,
    }


def write_json(path: Path, payload: object) -> None:
    """Write ``payload`` as indented JSON with a final newline."""
    path.write_text(json.dumps(payload, indent=2) + "\n")
