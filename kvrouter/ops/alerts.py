"""Prometheus alert rules of a kvrouter cluster, rendered as one rule file.

Two thresholds come from the Helm values: the chart replaces the
placeholders :data:`TTFT_SLO` and :data:`REDIS_MEMORY_RATIO` in the file
(``.Files.Get`` + ``replace``; annotations carry Prometheus' own
``{{ $labels... }}`` templates, so the file must not go through ``tpl``).
Every other threshold is a literal. Each alert's ``runbook`` annotation
points at its section of ``docs/operations.md``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["ALERTS", "PLACEHOLDER_DEFAULTS", "REDIS_MEMORY_RATIO", "TTFT_SLO", "Alert", "render"]

TTFT_SLO = "__TTFT_P90_SLO_SECONDS__"
REDIS_MEMORY_RATIO = "__REDIS_MEMORY_RATIO__"
PLACEHOLDER_DEFAULTS = {TTFT_SLO: "2", REDIS_MEMORY_RATIO: "0.9"}
"""The values the chart substitutes by default (``values.yaml``)."""

RUNBOOK = "docs/operations.md"
GROUP = "kvrouter"


@dataclass(frozen=True, slots=True)
class Alert:
    """One alerting rule.

    Attributes:
        name: Alert name (CamelCase); its runbook anchor is the name in lower case.
        expr: PromQL; the alert fires for each series it returns for ``for_``.
        for_: How long the condition must hold (``5m``).
        severity: ``warning`` (look today) or ``critical`` (look now).
        summary: One line, may use ``{{ $labels.x }}``.
        description: What it means; may use ``{{ $labels.x }}`` but not ``$value``
            (the unit tests compare annotations exactly).
    """

    name: str
    expr: str
    for_: str
    severity: Literal["warning", "critical"]
    summary: str
    description: str

    @property
    def runbook(self) -> str:
        """Where the runbook section of this alert lives."""
        return f"{RUNBOOK}#{self.name.lower()}"

    def lines(self) -> Iterator[str]:
        """The rule as YAML lines (list item under ``rules:``)."""
        yield f"      - alert: {self.name}"
        yield "        expr: |-"
        for line in self.expr.splitlines():
            yield f"          {line}"
        yield f"        for: {self.for_}"
        yield "        labels:"
        yield f"          severity: {self.severity}"
        yield "        annotations:"
        yield f"          summary: {_quote(self.summary)}"
        yield f"          description: {_quote(self.description)}"
        yield f"          runbook: {_quote(self.runbook)}"


def _quote(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def _ttft_p90(window: str) -> str:
    return (
        "histogram_quantile(0.9, sum by (le) "
        f"(rate(kvrouter_time_to_first_token_seconds_bucket[{window}])))"
    )


ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvrouterWorkerHeartbeatMissing",
        "max by (worker) (kvrouter_worker_up) == 0",
        "2m",
        "warning",
        "Worker {{ $labels.worker }} is not routable: its heartbeat is missing",
        "No gateway replica has routed to worker {{ $labels.worker }} for 2 minutes: its "
        "heartbeat in Redis expired (the process is gone, hung, or cannot reach Redis), it "
        "deleted it because its engine loop died (its log says so at CRITICAL; the process "
        "then exits with status 1 to be restarted, so a worker missing for minutes is "
        "crash-looping), or it was benched after refusing connections and has "
        "not heartbeated since. The indexer "
        "purges a host whose heartbeat expired (kvindex_ingest_dead_hosts_total).",
    ),
    Alert(
        "KvrouterIndexLagHigh",
        "histogram_quantile(0.9, sum by (le) (rate(kvindex_ingest_apply_lag_seconds_bucket[5m])))"
        " > 5",
        "10m",
        "warning",
        "The KV index applies worker events more than 5 s late (p90)",
        "The p90 delay from a worker's event batch to its apply in the index has been over "
        "5 s for 10 minutes, so the router's view of which worker caches what is stale and "
        "cache-aware routing misses hits. The indexer is overloaded, Redis is slow, or "
        "indexer replicas are missing.",
    ),
    Alert(
        "KvrouterIndexResyncStorm",
        'sum(increase(kvindex_ingest_snapshot_requests_total{reason=~"gap|retry|tail"}[10m])) > 10',
        "10m",
        "warning",
        "The KV index keeps asking workers for full snapshots",
        "More than 10 snapshot requests for gaps, lost tails or unanswered snapshots in 10 "
        "minutes, for 10 minutes (quiet-host checks are routine and not counted). Workers are "
        "dropping "
        "event batches (kvworker_kv_event_batches_dropped_total), restarting, or not "
        "answering snapshot requests; each snapshot replaces a host's entries.",
    ),
    Alert(
        "KvrouterLoadOnlyRouting",
        "kvrouter_cache_aware_routing == 0",
        "5m",
        "warning",
        "Gateway {{ $labels.instance }} routes by load only",
        "Gateway replica {{ $labels.instance }} has not been able to look prompts up in the "
        "KV index for 5 minutes (Redis unreachable or failing: "
        'kvrouter_redis_errors_total{op="lookup"}), so it ignores cached prefixes and '
        "routes by load only.",
    ),
    Alert(
        "KvrouterTtftP90OverSlo",
        f"{_ttft_p90('5m')}\n  > {TTFT_SLO}",
        "10m",
        "critical",
        "Gateway TTFT p90 is over the SLO of " + TTFT_SLO + " s",
        "The p90 time to first token the gateway measures (all replicas, streaming "
        "requests) has been over " + TTFT_SLO + " s for 10 minutes: the cluster is "
        "short of prefill capacity, cache hits fell, or requests queue behind long prompts.",
    ),
    Alert(
        "KvrouterTtftPredictionDrift",
        "abs(ln(histogram_quantile(0.5, sum by (le) "
        "(rate(kvrouter_ttft_prediction_ratio_bucket[15m])))))\n  > 0.6931",  # ln 2
        "15m",
        "warning",
        "Predicted TTFT is off by more than 2x",
        "The median of observed / predicted TTFT has been above 2 or below 0.5 for 15 "
        "minutes, so the kv_ttft policy compares workers on wrong figures. The workers' "
        "timing profiles no longer match their hardware or load, or load bandwidths are "
        "misreported.",
    ),
    Alert(
        "KvrouterHigh5xxRatio",
        'sum(rate(kvrouter_requests_total{status=~"5.."}[5m]))\n'
        "  / sum(rate(kvrouter_requests_total[5m])) > 0.05",
        "5m",
        "critical",
        "More than 5% of gateway answers are 5xx",
        "Over 5% of the requests the gateway answered in the last 5 minutes failed with a "
        "5xx status (502/504: workers failing or timing out; 503: no routable worker).",
    ),
    Alert(
        "KvrouterRedisMemoryNearLimit",
        "redis_memory_used_bytes / (redis_memory_max_bytes > 0)\n  > " + REDIS_MEMORY_RATIO,
        "5m",
        "critical",
        "Redis {{ $labels.instance }} uses more than " + REDIS_MEMORY_RATIO + " of maxmemory",
        "Redis {{ $labels.instance }} is near its maxmemory: at the limit it evicts or refuses "
        "writes, and the KV index, heartbeats and rate limits break. Assumes the Redis "
        "exporter (oliver006/redis_exporter) metrics redis_memory_used_bytes and "
        "redis_memory_max_bytes; no alert when maxmemory is unset (0).",
    ),
)


def render(alerts: tuple[Alert, ...] = ALERTS) -> str:
    """The Prometheus rule file (top-level ``groups:``)."""
    head = [
        "# Generated by `python -m kvrouter.ops.generate` (kvrouter/ops/alerts.py): do not edit.",
        f"# Placeholders the Helm chart replaces from values: {TTFT_SLO}, {REDIS_MEMORY_RATIO}.",
        "groups:",
        f"  - name: {GROUP}",
        "    rules:",
    ]
    body = [line for alert in alerts for line in alert.lines()]
    return "\n".join([*head, *body]) + "\n"
