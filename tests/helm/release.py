"""The chart rendered offline with Helm's own engine (helm-python-sdk), as parsed objects.

A ``Release`` is what ``helm template`` would print: every manifest parsed (with Helm's
YAML parser, ``helm_python.values_from_yaml``), plus NOTES.txt, plus the raw text (to
look for secrets that must not be there).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python

__all__ = ["CHART", "NAMESPACE", "RELEASE", "Release", "container", "env_of", "render"]

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvrouter"
RELEASE = "demo"
NAMESPACE = "llm"

_DOC_SPLIT = re.compile(r"(?m)^---\s*$")


@dataclass(slots=True)
class Release:
    """The rendered objects of one release, and its notes."""

    objects: list[dict[str, Any]]
    notes: str
    text: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every object of ``kind``."""
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The object of ``kind`` named ``name`` (KeyError if absent)."""
        for o in self.of_kind(kind):
            if o["metadata"]["name"] == name:
                return o
        raise KeyError(
            f"no {kind} {name}; have {[o['metadata']['name'] for o in self.of_kind(kind)]}"
        )

    def pod_templates(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(workload, its pod template) for every Deployment and StatefulSet."""
        for o in self.objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                yield o, o["spec"]["template"]


def render(values: Mapping[str, Any] | None = None, chart: Path = CHART) -> Release:
    """Render ``chart`` with ``values`` as release ``demo`` in namespace ``llm``.

    Raises:
        helm_python.HelmError: the values break the schema or a template fails.
    """
    with helm_python.Chart.load(chart) as loaded:
        files = loaded.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    objects: list[dict[str, Any]] = []
    notes = ""
    texts = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        texts.append(text)
        for doc in _DOC_SPLIT.split(text):
            parsed = helm_python.values_from_yaml(doc) if doc.strip() else {}
            if parsed:
                objects.append(parsed)
    return Release(objects, notes, "\n---\n".join(texts))


def container(workload: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The named container of a workload (its first one without a name)."""
    containers: list[dict[str, Any]] = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def env_of(c: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's environment by variable name (each entry the EnvVar object)."""
    return {e["name"]: e for e in c.get("env", [])}
