"""values.schema.json refuses bad values with a message that names the value, and the
README's values table is the one generated from the schema and the defaults."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.helm.release import CHART, render
from tests.helm.values_doc import README, leaf_paths, render_table

BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    (
        "wrong type",
        {"gateway": {"replicas": "two"}},
        "at '/gateway/replicas': got string, want integer",
    ),
    (
        "unknown role",
        {"workers": {"pools": [{"name": "worker", "role": "both2", "replicas": 2}]}},
        "at '/workers/pools/0/role': value must be one of 'both', 'prefill', 'decode'",
    ),
    (
        "negative replicas",
        {"workers": {"pools": [{"name": "worker", "role": "both", "replicas": -1}]}},
        "at '/workers/pools/0/replicas': minimum: got -1, want 0",
    ),
    (
        "negative gateway replicas",
        {"gateway": {"replicas": -3}},
        "at '/gateway/replicas': minimum: got -3, want 1",
    ),
    (
        "unknown top-level key",
        {"replicaCount": 3},
        "additional properties 'replicaCount' not allowed",
    ),
    (
        "misspelt nested key",
        {"workers": {"tier": {}}},
        "at '/workers': additional properties 'tier' not allowed",
    ),
    (
        "unknown runner",
        {"workers": {"runner": "vllm"}},
        "at '/workers/runner': value must be one of 'torch', 'sim'",
    ),
    ("bad pd mode", {"gateway": {"pd": "sometimes"}}, "at '/gateway/pd': value must be one of"),
    (
        "port out of range",
        {"workers": {"kvPort": 70000}},
        "at '/workers/kvPort': maximum: got 70,000, want 65,535",
    ),
    (
        "boolean as string",
        {"networkPolicy": {"enabled": "yes"}},
        "at '/networkPolicy/enabled': got string, want boolean",
    ),
    (
        "password in the URL",
        {"redis": {"external": {"url": "redis://:hunter2@redis:6379"}}},
        "at '/redis/external/url'",
    ),
]


@pytest.mark.parametrize(
    ("values", "message"), [(v, m) for _, v, m in BAD_VALUES], ids=[i for i, _, _ in BAD_VALUES]
)
def test_bad_values_are_refused_with_a_readable_message(
    values: dict[str, Any], message: str
) -> None:
    """Rendering (as install and upgrade do) fails, naming the value and the constraint."""
    with pytest.raises(helm_python.HelmValuesError) as caught:
        render(values)
    assert message in str(caught.value)
    assert "values don't meet the specifications of the schema" in str(caught.value)


def test_lint_reports_bad_values_as_errors() -> None:
    """helm lint of bad values fails the same way (for CI pipelines that only lint)."""
    report = helm_python.lint(
        CHART, {"workers": {"pools": [{"name": "w", "role": "both2", "replicas": 1}]}}
    )
    assert any("value must be one of 'both', 'prefill', 'decode'" in e for e in report["errors"])


def test_the_defaults_and_every_documented_value_pass_the_schema() -> None:
    """values.yaml passes its own schema, and every key of it is described there."""
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
        schema = chart.schema
    assert schema is not None
    documented = {path for path, _ in leaf_paths(schema)}
    undescribed = [path for path, node in leaf_paths(schema) if not node.get("description")]
    assert undescribed == []
    assert {
        "workers.pools[].role",
        "redis.external.url",
        "monitoring.alerts.ttftP90SloSeconds",
    } <= documented


def test_the_readme_values_table_is_the_generated_one() -> None:
    """The README lists every value with its type, default and meaning (regenerate it with
    ``python -m tests.helm.values_doc`` after changing the schema or the defaults)."""
    table = render_table()
    assert table in README.read_text(), (
        "README values table is stale: python -m tests.helm.values_doc"
    )
    with helm_python.Chart.load(CHART) as chart:
        schema = chart.schema or {}
    for path, _ in leaf_paths(schema):
        if path != "global":
            assert f"| `{path}` |" in table
