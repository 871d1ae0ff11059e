"""PromQL as the tests see it: parse an expression, list the metric names it reads.

Grafana's variables (``$__rate_interval`` and friends) are not PromQL; they
are replaced by a plain duration first so the parser accepts the query.
"""

from __future__ import annotations

import re

import promql_parser

__all__ = ["metric_names", "parse"]

_GRAFANA_RANGE = re.compile(r"\$__(rate_interval|interval|range)")


def parse(expr: str) -> promql_parser.Expr:
    """Parse ``expr`` (Grafana range variables read as ``5m``); ValueError if invalid."""
    return promql_parser.parse(_GRAFANA_RANGE.sub("5m", expr))


def metric_names(expr: str) -> set[str]:
    """Every metric name a vector or range selector of ``expr`` reads."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(parse(expr), pre_visit=visit)
    return names
