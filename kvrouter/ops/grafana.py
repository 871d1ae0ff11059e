"""A small typed builder for Grafana dashboard JSON (schema version 39).

Dashboards are plain frozen dataclasses: rows of panels, each panel a list
of PromQL targets with a unit. :meth:`Dashboard.to_json` lays the panels
out on Grafana's 24-column grid, left to right, and points every query at
the ``datasource`` template variable, so one file works whatever the
Prometheus data source is called where it is imported.

    Dashboard
      Row ----------------------------------------------- (gridPos h=1)
      | Panel (w=8) | Panel (w=8) | Panel (w=8) |          (wraps at 24)
      Row ...
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["SCHEMA_VERSION", "Dashboard", "Panel", "Row", "Target"]

SCHEMA_VERSION = 39
GRID_WIDTH = 24
_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True, slots=True)
class Target:
    """One PromQL query of a panel.

    Attributes:
        expr: The query (Grafana's ``$__rate_interval`` allowed).
        legend: Legend format (``{{label}}`` placeholders).
        right_unit: Plot on a right axis with this unit (two quantities in one panel).
    """

    expr: str
    legend: str = ""
    right_unit: str | None = None


@dataclass(frozen=True, slots=True)
class Panel:
    """A timeseries or stat panel.

    Attributes:
        title: Panel title.
        targets: Its queries, drawn in order (ref ids A, B, ...).
        unit: Grafana unit id (``s``, ``reqps``, ``percentunit``, ``bytes``, ``Bps``...).
        description: Hover text: what the figure means and where it comes from.
        kind: ``timeseries`` or ``stat``.
        width: Grid columns (of 24).
        height: Grid rows.
        stack: Stack the series (parts of one total).
        mappings: For stat panels, value -> text (``{1: "cache-aware"}``).
        steps: Threshold colours as (value, colour), the first value None (base).
    """

    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    description: str = ""
    kind: Literal["timeseries", "stat"] = "timeseries"
    width: int = 12
    height: int = 8
    stack: bool = False
    mappings: dict[int, str] = field(default_factory=dict)
    steps: tuple[tuple[float | None, str], ...] = ((None, "green"),)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no query")
        if not 0 < self.width <= GRID_WIDTH:
            raise ValueError(f"panel {self.title!r}: width must be 1..{GRID_WIDTH}")

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        """The panel's JSON at grid position (``x``, ``y``)."""
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "color": {"mode": "palette-classic" if self.kind == "timeseries" else "thresholds"},
            "thresholds": {
                "mode": "absolute",
                "steps": [{"value": v, "color": c} for v, c in self.steps],
            },
            "mappings": [
                {"type": "value", "options": {str(k): {"text": v, "index": i}}}
                for i, (k, v) in enumerate(sorted(self.mappings.items()))
            ],
        }
        options: dict[str, Any]
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 20 if self.stack else 5,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
                "axisPlacement": "auto",
            }
            options = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        else:
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
                "justifyMode": "auto",
                "orientation": "auto",
                "textMode": "auto",
            }
        overrides = [
            {
                "matcher": {"id": "byFrameRefID", "options": _ref(i)},
                "properties": [
                    {"id": "unit", "value": t.right_unit},
                    {"id": "custom.axisPlacement", "value": "right"},
                ],
            }
            for i, t in enumerate(self.targets)
            if t.right_unit is not None
        ]
        return {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": _DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": overrides},
            "options": options,
            "targets": [
                {
                    "refId": _ref(i),
                    "datasource": _DATASOURCE,
                    "editorMode": "code",
                    "expr": t.expr,
                    "legendFormat": t.legend or "__auto",
                    "range": True,
                    "instant": False,
                }
                for i, t in enumerate(self.targets)
            ],
        }


@dataclass(frozen=True, slots=True)
class Row:
    """A titled group of panels."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True, slots=True)
class Dashboard:
    """A dashboard: rows of panels, a ``datasource`` variable, a stable ``uid``."""

    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("kvrouter",)
    refresh: str = "30s"

    def panels(self) -> Iterator[Panel]:
        """Every panel, row by row."""
        for row in self.rows:
            yield from row.panels

    def exprs(self) -> Iterator[str]:
        """Every PromQL expression of the dashboard."""
        for panel in self.panels():
            for t in panel.targets:
                yield t.expr

    def to_json(self) -> dict[str, Any]:
        """The dashboard as Grafana imports it."""
        out: list[dict[str, Any]] = []
        next_id, y = 1, 0
        for row in self.rows:
            out.append(
                {
                    "id": next_id,
                    "type": "row",
                    "title": row.title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                    "panels": [],
                }
            )
            next_id, y = next_id + 1, y + 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                out.append(panel.to_json(next_id, x, y))
                next_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        return {
            "annotations": {
                "list": [
                    {
                        "builtIn": 1,
                        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                        "enable": True,
                        "hide": True,
                        "iconColor": "rgba(0, 211, 255, 1)",
                        "name": "Annotations & Alerts",
                        "type": "dashboard",
                    }
                ]
            },
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "id": None,
            "links": [],
            "panels": out,
            "refresh": self.refresh,
            "schemaVersion": SCHEMA_VERSION,
            "tags": list(self.tags),
            "templating": {
                "list": [
                    {
                        "name": "datasource",
                        "label": "Data source",
                        "type": "datasource",
                        "query": "prometheus",
                        "current": {},
                        "hide": 0,
                        "includeAll": False,
                        "multi": False,
                        "options": [],
                        "refresh": 1,
                        "regex": "",
                        "skipUrlSync": False,
                    }
                ]
            },
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
            "weekStart": "",
        }


def _ref(i: int) -> str:
    return chr(ord("A") + i)
