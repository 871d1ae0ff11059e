"""The committed dashboards and rules are what the code generates, and they are sound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrouter.ops.alerts import ALERTS, PLACEHOLDER_DEFAULTS
from kvrouter.ops.dashboards import DASHBOARDS
from kvrouter.ops.generate import DEFAULT_OUT, RULES_FILE, files, main
from kvrouter.ops.grafana import GRID_WIDTH, SCHEMA_VERSION
from kvrouter.ops.promql import metric_names, parse

PREFIXES = ("kvrouter_", "kvworker_", "kvindex_", "redis_")


def test_committed_files_are_what_the_generator_writes() -> None:
    for rel, content in files().items():
        path = DEFAULT_OUT / rel
        assert path.exists(), f"{path} missing: run `make dashboards`"
        assert path.read_text() == content, f"{path} is stale: run `make dashboards`"
    assert main(["--check"]) == 0


def test_generator_check_reports_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path
    assert main(["--out", str(out)]) == 0
    assert main(["--out", str(out), "--check"]) == 0
    (out / "dashboards" / "pd.json").write_text("{}")
    assert main(["--out", str(out), "--check"]) == 1


@pytest.mark.parametrize("stem", sorted(DASHBOARDS))
def test_dashboard_is_grafana_json_with_a_datasource_variable(stem: str) -> None:
    board = json.loads(files()[Path("dashboards", f"{stem}.json")])
    assert board["schemaVersion"] == SCHEMA_VERSION
    assert board["uid"] == f"kvrouter-{stem}"
    (var,) = board["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= GRID_WIDTH, p["title"]
        mine = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat")
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["targets"]
        assert all(t["expr"] for t in p["targets"])


def test_every_expression_parses_and_reads_our_metrics() -> None:
    exprs = [e for build in DASHBOARDS.values() for e in build().exprs()]
    for alert in ALERTS:
        expr = alert.expr
        for placeholder, default in PLACEHOLDER_DEFAULTS.items():
            expr = expr.replace(placeholder, default)
        exprs.append(expr)
    for expr in exprs:
        parse(expr)  # raises on a syntax error
        names = metric_names(expr)
        assert names, expr
        assert all(n.startswith(PREFIXES) for n in names), expr


def test_a_broken_expression_is_refused() -> None:
    with pytest.raises(ValueError, match="parenthesis"):
        parse("sum(rate(kvrouter_requests_total[$__rate_interval])")


def test_every_alert_has_for_severity_and_a_runbook() -> None:
    text = files()[RULES_FILE]
    assert text.count("\ngroups:\n") == 1
    for alert in ALERTS:
        assert alert.for_
        assert alert.severity in ("warning", "critical")
        assert alert.summary
        assert alert.description
        assert alert.runbook == f"docs/operations.md#{alert.name.lower()}"
        assert f"- alert: {alert.name}\n" in text
    assert len({a.name for a in ALERTS}) == len(ALERTS)
