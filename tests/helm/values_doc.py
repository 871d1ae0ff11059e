"""The values table of helm/kvrouter/README.md, generated from values.schema.json.

Each row is a value of the schema (descriptions and types) with its default from
values.yaml, so the README cannot drift from the chart: a test compares the two.
Rewrite the table with ``python -m tests.helm.values_doc``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import helm_python

from tests.helm.release import CHART

__all__ = ["README", "leaf_paths", "render_table", "rewrite_readme"]

README = CHART / "README.md"
START = "<!-- values-table:start (python -m tests.helm.values_doc) -->"
END = "<!-- values-table:end -->"


def leaf_paths(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, schema node) of every documented value; pools' keys as ``pools[].x``."""
    for key, node in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        if node.get("type") == "object" and "properties" in node:
            yield from leaf_paths(node, f"{path}.")
        elif node.get("type") == "array" and "properties" in node.get("items", {}):
            yield path, node
            yield from leaf_paths(node["items"], f"{path}[].")
        else:
            yield path, node


def _default(values: Mapping[str, Any], path: str) -> str:
    node: Any = values
    for part in path.split("."):
        if part.endswith("[]") or not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    return f"`{json.dumps(node, separators=(', ', ': '))}`"


def _type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(str(n["type"]) for n in node["anyOf"])
    return str(node.get("type", "any"))


def render_table() -> str:
    """The Markdown table of every value."""
    with helm_python.Chart.load(CHART) as chart:
        schema = chart.schema or {}
        values = chart.values
    rows = ["| value | type | default | meaning |", "|---|---|---|---|"]
    for path, node in leaf_paths(schema):
        if path == "global":
            continue
        meaning = str(node.get("description", "")).replace("|", "\\|")
        rows.append(f"| `{path}` | {_type(node)} | {_default(values, path)} | {meaning} |")
    return "\n".join(rows)


def rewrite_readme() -> None:
    """Replace the table between the markers of the chart's README."""
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{render_table()}\n{END}{tail}")


if __name__ == "__main__":
    rewrite_readme()
