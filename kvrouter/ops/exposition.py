"""One ``/metrics`` scrape, read back: sample values, declared names and histograms.

Both the live view (``kvrouter top``) and the tests that hold the dashboards
to real metric names read scrapes through this module, with
``prometheus_client``'s own text parser.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Buckets", "Scrape"]

_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


@dataclass(frozen=True, slots=True)
class Buckets:
    """A Prometheus histogram: cumulative counts per upper bound, ``+Inf`` last.

    Quantiles interpolate linearly inside a bucket, as PromQL's
    ``histogram_quantile`` does, so ``kvrouter top`` and a dashboard agree.
    """

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    @property
    def count(self) -> float:
        """Observations (the ``+Inf`` bucket)."""
        return self.counts[-1] if self.counts else 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, or None without observations.

        An answer in the ``+Inf`` bucket is the highest finite bound, as in PromQL.
        """
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                    count - lower_count
                )
            lower_bound, lower_count = bound, count
        return lower_bound

    def minus(self, earlier: Buckets) -> Buckets:
        """Observations since ``earlier`` (itself when the bounds differ or counts fell)."""
        if earlier.bounds != self.bounds or any(
            a < b for a, b in zip(self.counts, earlier.counts, strict=True)
        ):
            return self
        diff = tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True))
        return Buckets(self.bounds, diff)

    @staticmethod
    def merge(parts: Iterable[Buckets]) -> Buckets:
        """Sum histograms with the same bounds (several gateway replicas); empty ones skipped."""
        bounds: tuple[float, ...] = ()
        counts: list[float] = []
        for p in parts:
            if not p.bounds:
                continue
            if not bounds:
                bounds, counts = p.bounds, list(p.counts)
            elif p.bounds == bounds:
                counts = [a + b for a, b in zip(counts, p.counts, strict=True)]
        return Buckets(bounds, tuple(counts))


@dataclass(slots=True)
class Scrape:
    """The samples and declared metric names of one exposition.

    Attributes:
        samples: Sample name (``..._total``, ``..._bucket``) -> (labels, value) pairs.
        declared: Names a query may use that the exposition declares with ``# TYPE``,
            samples or not: a labelled counter never incremented has no sample but is
            declared; a histogram declares its ``_bucket``, ``_sum`` and ``_count``.
    """

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Read a Prometheus text exposition."""
        out = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        for name, kind in _TYPE.findall(text):
            out.declared.add(name)
            if kind in ("histogram", "summary"):
                out.declared.update(f"{name}{sfx}" for sfx in ("_bucket", "_sum", "_count"))
        return out

    def value(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of ``name`` whose labels include ``labels`` (None: no sample)."""
        found = [v for lab, v in self.samples.get(name, []) if _has(lab, labels)]
        return sum(found) if found else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Samples of ``name`` summed per value of ``label``."""
        out: dict[str, float] = {}
        for lab, v in self.samples.get(name, []):
            if label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out

    def buckets(self, name: str, **labels: str) -> Buckets:
        """The histogram ``name`` (its ``_bucket`` samples summed over other labels)."""
        per_bound: dict[float, float] = {}
        for lab, v in self.samples.get(f"{name}_bucket", []):
            if _has(lab, labels) and "le" in lab:
                bound = float(lab["le"])
                per_bound[bound] = per_bound.get(bound, 0.0) + v
        bounds = tuple(sorted(per_bound))
        return Buckets(bounds, tuple(per_bound[b] for b in bounds))


def _has(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())
