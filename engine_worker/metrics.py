"""The worker's Prometheus metrics (``kvworker_`` namespace, injected registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["WorkerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    """Every metric a worker exports; tests pass a fresh registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        ns = "kvworker"
        self.requests = Counter(
            "requests", "Requests finished, by endpoint and finish reason",
            ["endpoint", "reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.request_errors = Counter(
            "request_errors", "Requests refused with a 4xx/5xx, by status",
            ["status"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Arrival to first token",
            namespace=ns, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = Histogram(
            "time_per_output_token_seconds", "Mean time between output tokens per request",
            namespace=ns, registry=registry, buckets=_TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "Arrival to last token",
            namespace=ns, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens received", namespace=ns, registry=registry
        )
        self.prompt_ids = Counter(
            "prompt_ids", "Prompts by where their token ids came from: tokenized here, or "
            "sent tokenized (tokenized_prompt) and used, or ignored for another tokenizer",
            ["source"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "generation_tokens", "Tokens generated", namespace=ns, registry=registry
        )
        self.prefix_hit_tokens = Counter(
            "prefix_hit_tokens", "Prompt tokens served from the prefix cache, by medium",
            ["medium"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.running = Gauge(
            "num_requests_running", "Requests running", namespace=ns, registry=registry
        )
        self.waiting = Gauge(
            "num_requests_waiting", "Requests waiting", namespace=ns, registry=registry
        )
        self.queued_prefill_tokens = Gauge(
            "queued_prefill_tokens", "Prompt tokens still to prefill",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            "kv_blocks_used", "KV blocks holding data, by medium",
            ["medium"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.kv_blocks_capacity = Gauge(
            "kv_blocks_capacity", "KV blocks, by medium", ["medium"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "kv_usage_ratio", "Fraction of KV blocks holding data, by medium",
            ["medium"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.block_moves = Gauge(
            "kv_block_moves", "Block transitions since start (demotions, promotions, "
            "evictions), by kind and medium", ["kind", "medium"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.load_bandwidth = Gauge(
            "kv_load_bandwidth_bytes_per_second", "Measured bandwidth moving KV into HBM",
            ["medium"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.steps = Counter("engine_steps", "Engine steps run", namespace=ns, registry=registry)
        self.step_seconds = Histogram(
            "engine_step_seconds", "Duration of one engine step",
            namespace=ns, registry=registry, buckets=_LATENCY_BUCKETS,
        )  # fmt: skip
        self.preemptions = Counter(
            "preemptions", "Requests preempted (recomputed later)", namespace=ns, registry=registry
        )
        self.events_published = Counter(
            "kv_event_batches_published", "Event batches appended to Redis",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.events_dropped = Counter(
            "kv_event_batches_dropped", "Event batches dropped (buffer full while Redis was away)",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.snapshots_published = Counter(
            "kv_snapshots_published", "Snapshots published", namespace=ns, registry=registry
        )
        self.transfer_bytes = Counter(
            "kv_transfer_bytes", "KV transfer bytes between workers, by direction",
            ["direction"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.transfer_blocks = Counter(
            "kv_transfer_blocks", "KV blocks transferred between workers, by direction",
            ["direction"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.transfer_failures = Counter(
            "kv_transfer_failures", "KV pulls refused or failed, by reason (the request "
            "recomputes)", ["reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.transfer_bandwidth = Gauge(
            "kv_transfer_bandwidth_bytes_per_second", "Measured bandwidth of KV pulls from peers",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.leases = Gauge(
            "kv_leases", "PD: prefilled block runs held for a decoder",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.leases_expired = Counter(
            "kv_leases_expired", "PD: leases released unclaimed after lease_ttl_s",
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.redis_up = Gauge(
            "redis_up", "1 when the worker's last Redis write succeeded",
            namespace=ns, registry=registry,
        )  # fmt: skip
