"""The four Grafana dashboards of a kvrouter cluster: Gateway and Cache here, Workers and PD
in :mod:`kvrouter.ops.fleet_dashboards`.

Every query reads a metric the gateway (``kvrouter_``), the indexer
(``kvindex_``) or a worker (``kvworker_``) exports; the tests check each
name against a real scrape of ``kvrouter up --runner sim``, so renaming a
metric breaks a test, not a dashboard. ``python -m kvrouter.ops.generate``
writes them to ``helm/kvrouter/dashboards/``.
"""

from __future__ import annotations

from kvrouter.ops.fleet_dashboards import pd, workers
from kvrouter.ops.grafana import Dashboard, Panel, Row, Target
from kvrouter.ops.queries import mean, quantile, quantiles, rate

__all__ = ["DASHBOARDS", "cache", "gateway"]


def gateway() -> Dashboard:
    """Traffic, latency, routing decisions and refusals of the gateway replicas."""
    requests = rate("kvrouter_requests_total")
    errors = rate("kvrouter_requests_total", match='status=~"5.."')
    return Dashboard(
        uid="kvrouter-gateway",
        title="kvrouter / Gateway",
        description="The OpenAI gateway: traffic, TTFT, routing decisions, retries, refusals.",
        rows=(
            Row(
                "Overview",
                (
                    Panel(
                        "Requests/s",
                        (Target(requests, "requests/s"),),
                        "reqps",
                        "All requests the gateway replicas answered.",
                        "stat",
                        6,
                        4,
                    ),
                    Panel(
                        "5xx ratio",
                        (Target(f"{errors} / {requests}", "5xx"),),
                        "percentunit",
                        "Share of answers with a 5xx status.",
                        "stat",
                        6,
                        4,
                        steps=((None, "green"), (0.01, "orange"), (0.05, "red")),
                    ),
                    Panel(
                        "Routing mode",
                        (Target("min(kvrouter_cache_aware_routing)", "mode"),),
                        "none",
                        "Cache-aware while every replica's index lookups answer; load "
                        "only while Redis is away on some replica.",
                        "stat",
                        6,
                        4,
                        mappings={0: "load only", 1: "cache-aware"},
                        steps=((None, "red"), (1, "green")),
                    ),
                    Panel(
                        "Routable workers",
                        (Target("sum(max by (worker) (kvrouter_worker_up))", "workers"),),
                        "none",
                        "Workers with a live heartbeat that the gateway routes to.",
                        "stat",
                        6,
                        4,
                    ),
                ),
            ),
            Row(
                "Traffic",
                (
                    Panel(
                        "Requests/s by status",
                        (Target(rate("kvrouter_requests_total", "status"), "{{status}}"),),
                        "reqps",
                        "Answers by HTTP status (499: the client left first).",
                        stack=True,
                    ),
                    Panel(
                        "Requests/s by endpoint and policy",
                        (
                            Target(
                                rate("kvrouter_requests_total", "endpoint, policy"),
                                "{{endpoint}} ({{policy}})",
                            ),
                        ),
                        "reqps",
                    ),
                ),
            ),
            Row(
                "Latency",
                (
                    Panel(
                        "Time to first token",
                        quantiles("kvrouter_time_to_first_token_seconds"),
                        "s",
                        "Arrival at the gateway to the first token (streamed, or marked by the "
                        "worker in a non-streaming answer).",
                    ),
                    Panel(
                        "End-to-end latency",
                        quantiles("kvrouter_e2e_request_latency_seconds"),
                        "s",
                        "Arrival at the gateway to the end of the response.",
                    ),
                    Panel(
                        "Predicted vs observed TTFT",
                        (
                            Target(
                                quantile(0.5, "kvrouter_time_to_first_token_seconds"),
                                "observed p50",
                            ),
                            Target(
                                quantile(0.5, "kvrouter_predicted_ttft_seconds"), "predicted p50"
                            ),
                            Target(
                                quantile(0.9, "kvrouter_time_to_first_token_seconds"),
                                "observed p90",
                            ),
                            Target(
                                quantile(0.9, "kvrouter_predicted_ttft_seconds"), "predicted p90"
                            ),
                        ),
                        "s",
                        "The policy's predicted TTFT for the chosen worker against what the "
                        "client saw.",
                    ),
                    Panel(
                        "Observed / predicted TTFT",
                        tuple(
                            Target(
                                quantile(q, "kvrouter_ttft_prediction_ratio"), f"p{round(q * 100)}"
                            )
                            for q in (0.1, 0.5, 0.9)
                        ),
                        "none",
                        "Per request, observed TTFT divided by predicted; 1 is a perfect "
                        "prediction.",
                    ),
                    Panel(
                        "Decision time by stage (p99)",
                        (
                            Target(
                                quantile(0.99, "kvrouter_decision_seconds", "stage"), "{{stage}}"
                            ),
                        ),
                        "s",
                        "Tokenize, hash, index lookup and policy scoring, per request.",
                    ),
                    Panel(
                        "Decision time by stage (mean)",
                        (Target(mean("kvrouter_decision_seconds", "stage"), "{{stage}}"),),
                        "s",
                        stack=True,
                    ),
                ),
            ),
            Row(
                "Routing",
                (
                    Panel(
                        "Cache-aware vs load-only routing",
                        (
                            Target("min(kvrouter_cache_aware_routing)", "lowest replica"),
                            Target("avg(kvrouter_cache_aware_routing)", "share of replicas"),
                        ),
                        "percentunit",
                        "1 while the index answers; 0 while a replica routes by "
                        "load only (Redis unreachable).",
                    ),
                    Panel(
                        "Retries/s by reason",
                        (Target(rate("kvrouter_retries_total", "reason"), "{{reason}}"),),
                        "reqps",
                        "Attempts moved to the next-best worker before the first byte.",
                    ),
                    Panel(
                        "Workers up",
                        (Target("max by (worker) (kvrouter_worker_up)", "{{worker}}"),),
                        "none",
                        "1 for a healthy, routable worker; 0 once its heartbeat is gone or it "
                        "is benched.",
                    ),
                    Panel(
                        "In flight per worker",
                        (Target("max by (worker) (kvrouter_worker_in_flight)", "{{worker}}"),),
                        "none",
                        "Requests in flight per worker, all gateway replicas.",
                    ),
                    Panel(
                        "KV held per worker (router's count)",
                        (Target("max by (worker) (kvrouter_worker_held_blocks)", "{{worker}}"),),
                        "none",
                        "HBM blocks the prompts routed to each worker hold from their first "
                        "byte to their end, all gateway replicas; the router lays it over the "
                        "heartbeat's kv_active_blocks. Idle, it reads 0.",
                    ),
                    Panel(
                        "Prompt tokens queued per worker (router's count)",
                        (
                            Target(
                                "max by (worker) (kvrouter_worker_queued_prefill_tokens)",
                                "{{worker}}",
                            ),
                        ),
                        "none",
                        "Prompt tokens routed to each worker and not yet prefilled.",
                    ),
                    Panel(
                        "Redis errors/s by operation",
                        (Target(rate("kvrouter_redis_errors_total", "op"), "{{op}}"),),
                        "ops",
                    ),
                    Panel(
                        "Broken streams/s",
                        (Target(rate("kvrouter_stream_errors_total"), "after the first byte"),),
                        "ops",
                    ),
                ),
            ),
            Row(
                "Refusals, clients, draining",
                (
                    Panel(
                        "429s/s: rate limits and admission",
                        (
                            Target(
                                rate("kvrouter_rate_limited_total", "limit"), "rate limit {{limit}}"
                            ),
                            Target(
                                rate("kvrouter_admission_rejected_total"), "admission (TTFT bound)"
                            ),
                        ),
                        "reqps",
                        "Requests refused with 429, by cause.",
                        stack=True,
                    ),
                    Panel(
                        "Client disconnects/s by stage",
                        (Target(rate("kvrouter_client_disconnects_total", "stage"), "{{stage}}"),),
                        "reqps",
                        "Clients that left before their answer ended.",
                        stack=True,
                    ),
                    Panel(
                        "Auth failures/s",
                        (Target(rate("kvrouter_auth_failures_total"), "401"),),
                        "reqps",
                    ),
                    Panel(
                        "Draining replicas",
                        (Target("sum(kvrouter_draining)", "draining"),),
                        "none",
                        "Gateway replicas unready while they drain for shutdown.",
                    ),
                ),
            ),
        ),
    )


def cache() -> Dashboard:
    """Prefix hits, the global index and its ingestion."""
    hit_rate = (
        f"{rate('kvrouter_prefix_hit_tokens_total')} / {rate('kvrouter_prompt_tokens_total')}"
    )
    return Dashboard(
        uid="kvrouter-cache",
        title="kvrouter / Cache",
        description="Prefix-cache hits by medium and the global KV index: size, ingest, lag.",
        rows=(
            Row(
                "Hits",
                (
                    Panel(
                        "Prefix hit rate",
                        (Target(hit_rate, "hit rate"),),
                        "percentunit",
                        "Prompt tokens served from cache / prompt tokens routed.",
                        "stat",
                        6,
                        4,
                    ),
                    Panel(
                        "Index entries",
                        (Target("sum(max by (medium) (kvindex_entries))", "entries"),),
                        "short",
                        "(block, host) entries in the index.",
                        "stat",
                        6,
                        4,
                    ),
                    Panel(
                        "Index memory",
                        (Target("max(kvindex_memory_bytes)", "bytes"),),
                        "bytes",
                        "Memory the index store uses (Redis).",
                        "stat",
                        6,
                        4,
                    ),
                    Panel(
                        "Ingest lag p90",
                        (Target(quantile(0.9, "kvindex_ingest_apply_lag_seconds"), "p90"),),
                        "s",
                        "From a worker's event batch to its apply in the index.",
                        "stat",
                        6,
                        4,
                        steps=((None, "green"), (1, "orange"), (5, "red")),
                    ),
                    Panel(
                        "Hit tokens/s by medium",
                        (Target(rate("kvrouter_prefix_hit_tokens_total", "medium"), "{{medium}}"),),
                        "short",
                        "Prompt tokens served from cache, by the medium they came from "
                        "(remote: pulled from a peer).",
                        stack=True,
                    ),
                    Panel(
                        "Hit rate vs requests",
                        (
                            Target(hit_rate, "hit rate"),
                            Target(
                                rate("kvrouter_requests_total"), "requests/s", right_unit="reqps"
                            ),
                        ),
                        "percentunit",
                    ),
                    Panel(
                        "Hit tokens/s by worker",
                        (
                            Target(
                                rate("kvworker_prefix_hit_tokens_total", "instance, medium"),
                                "{{instance}} {{medium}}",
                            ),
                        ),
                        "short",
                    ),
                    Panel(
                        "Prompt tokens/s",
                        (Target(rate("kvrouter_prompt_tokens_total"), "routed"),),
                        "short",
                    ),
                ),
            ),
            Row(
                "Index",
                (
                    Panel(
                        "Entries by medium",
                        (Target("max by (medium) (kvindex_entries)", "{{medium}}"),),
                        "short",
                        stack=True,
                    ),
                    Panel(
                        "Ingest rate",
                        (
                            Target(rate("kvindex_ingest_events_applied_total"), "events/s"),
                            Target(rate("kvindex_ingest_blocks_applied_total"), "blocks/s"),
                        ),
                        "ops",
                    ),
                    Panel(
                        "Batches/s by result",
                        (Target(rate("kvindex_ingest_batches_total", "result"), "{{result}}"),),
                        "ops",
                        "applied, duplicate (replayed), gap (a batch missing before it), held "
                        "(waiting for a snapshot).",
                        stack=True,
                    ),
                    Panel(
                        "Ingest apply lag",
                        quantiles("kvindex_ingest_apply_lag_seconds"),
                        "s",
                        "Seconds from a batch's timestamp to its apply.",
                    ),
                    Panel(
                        "Gaps and resyncs",
                        (
                            Target(
                                rate("kvindex_ingest_snapshot_requests_total", "reason"),
                                "snapshot asked ({{reason}})",
                            ),
                            Target(
                                rate("kvindex_ingest_snapshots_total", "result"),
                                "snapshot {{result}}",
                            ),
                        ),
                        "ops",
                        "Snapshot requests (gap, retry of an unanswered one, quiet-host "
                        "check) and the snapshots applied.",
                    ),
                    Panel(
                        "Hosts owned and pending",
                        (
                            Target("sum(kvindex_ingest_hosts_owned)", "owned"),
                            Target("sum(kvindex_ingest_hosts_pending)", "waiting for a snapshot"),
                        ),
                        "none",
                    ),
                    Panel(
                        "Purges",
                        (
                            Target(rate("kvindex_ingest_dead_hosts_total"), "dead hosts purged"),
                            Target(
                                rate("kvindex_ingest_purged_entries_total"),
                                "entries purged",
                                right_unit="ops",
                            ),
                        ),
                        "ops",
                        "Hosts whose heartbeat expired, and the entries their purge removed.",
                    ),
                    Panel(
                        "Ingest errors/s",
                        (
                            Target(
                                rate("kvindex_ingest_decode_errors_total"), "undecodable entries"
                            ),
                            Target(
                                rate("kvindex_ingest_held_dropped_total"), "held batches dropped"
                            ),
                            Target(rate("kvindex_ingest_redis_errors_total", "op"), "redis {{op}}"),
                        ),
                        "ops",
                    ),
                    Panel(
                        "Ingest lease changes/s",
                        (
                            Target(
                                rate("kvindex_ingest_lease_changes_total", "change"), "{{change}}"
                            ),
                        ),
                        "ops",
                        "Indexer replicas taking over hosts (lost: another replica took one).",
                    ),
                ),
            ),
        ),
    )


DASHBOARDS = {"gateway": gateway, "cache": cache, "workers": workers, "pd": pd}
"""File stem -> builder of each dashboard under ``helm/kvrouter/dashboards/``."""
