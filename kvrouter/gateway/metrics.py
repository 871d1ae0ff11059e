"""The gateway's Prometheus metrics (``kvrouter_`` namespace, injected registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DECISION = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1)
_ERROR_RATIO = (0.1, 0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2, 4, 10)


class RouterMetrics:
    """Every metric a gateway replica exports; tests pass a fresh registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ns = "kvrouter"
        self.requests = Counter(
            "requests", "Requests handled, by endpoint, HTTP status and policy",
            ["endpoint", "status", "policy"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Arrival at the gateway to the first token (streamed, or marked by the worker in "
            "a non-streaming answer)",
            namespace=ns, registry=registry, buckets=_LATENCY,
        )  # fmt: skip
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Arrival at the gateway to the response's end",
            namespace=ns, registry=registry, buckets=_LATENCY,
        )  # fmt: skip
        self.decision = Histogram(
            "decision_seconds", "Routing decision time by stage (tokenize, hash, lookup, score)",
            ["stage"], namespace=ns, registry=registry, buckets=_DECISION,
        )  # fmt: skip
        self.predicted_ttft = Histogram(
            "predicted_ttft_seconds", "TTFT the policy predicted for the chosen worker",
            namespace=ns, registry=registry, buckets=_LATENCY,
        )  # fmt: skip
        self.ttft_error_ratio = Histogram(
            "ttft_prediction_ratio", "Observed TTFT divided by predicted TTFT",
            namespace=ns, registry=registry, buckets=_ERROR_RATIO,
        )  # fmt: skip
        self.prefix_hit_tokens = Counter(
            "prefix_hit_tokens", "Prompt tokens workers served from cache, by medium",
            ["medium"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens routed", namespace=ns, registry=registry
        )
        self.retries = Counter(
            "retries", "Dispatch attempts retried on another worker, by reason",
            ["reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.stream_errors = Counter(
            "stream_errors", "Streams broken after the first byte", namespace=ns, registry=registry
        )
        self.worker_up = Gauge(
            "worker_up", "1 for a healthy, routable worker", ["worker"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.worker_refused = Counter(
            "worker_refused", "Workers refused at discovery (block size, model or address)",
            ["worker", "reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "worker_in_flight", "Requests in flight per worker, all gateway replicas",
            ["worker"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.held_blocks = Gauge(
            "worker_held_blocks", "HBM blocks the prompts routed to a worker hold (its requests "
            "past their first byte and not finished), all gateway replicas",
            ["worker"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.queued_tokens = Gauge(
            "worker_queued_prefill_tokens", "Prompt tokens routed to a worker and not yet "
            "prefilled (before their first byte), all gateway replicas",
            ["worker"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.cache_aware = Gauge(
            "cache_aware_routing", "1 while the index answers (cache-aware routing); 0 while "
            "routing falls back to load only", namespace=ns, registry=registry,
        )  # fmt: skip
        self.redis_errors = Counter(
            "redis_errors", "Redis calls that failed, by operation", ["op"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.pd_requests = Counter(
            "pd_requests", "Requests by prefill/decode plan (colocated, disaggregated)",
            ["mode"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.pd_fallbacks = Counter(
            "pd_fallbacks", "Disaggregated requests whose decoder prefilled locally, by reason",
            ["reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.pooled_pulls = Counter(
            "pooled_pulls", "Requests sent with a peer to pull a longer cached prefix from",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.auth_failures = Counter(
            "auth_failures", "Requests refused for a missing or bad API key",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.rate_limited = Counter(
            "rate_limited", "Requests refused with 429 by a per-client rate limit",
            ["limit"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.admission_rejected = Counter(
            "admission_rejected", "Requests refused with 429: predicted TTFT over the bound",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.client_gone = Counter(
            "client_disconnects", "Clients that left before their answer ended, by stage",
            ["stage"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.draining = Gauge(
            "draining", "1 while this replica drains for shutdown (not ready)",
            namespace=ns, registry=registry,
        )  # fmt: skip
