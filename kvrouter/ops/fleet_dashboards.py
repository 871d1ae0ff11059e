"""The Workers and PD dashboards: KV tiers, scheduler load, engine speed, KV transfers.

Like :mod:`kvrouter.ops.dashboards`, every name here is checked against a
live scrape by the tests.
"""

from __future__ import annotations

from kvrouter.ops.grafana import Dashboard, Panel, Row, Target
from kvrouter.ops.queries import quantile, rate

__all__ = ["pd", "workers"]


def workers() -> Dashboard:
    """KV tiers, scheduler load and engine speed of each worker."""
    return Dashboard(
        uid="kvrouter-workers",
        title="kvrouter / Workers",
        description="Per worker: KV usage per medium, block moves, queues, step time.",
        rows=(
            Row(
                "KV cache",
                (
                    Panel(
                        "KV usage by medium",
                        (
                            Target(
                                "max by (instance, medium) (kvworker_kv_usage_ratio)",
                                "{{instance}} {{medium}}",
                            ),
                        ),
                        "percentunit",
                        "Fraction of each medium's blocks holding data (in use or cached).",
                    ),
                    Panel(
                        "KV blocks by medium",
                        (
                            Target("sum by (medium) (kvworker_kv_blocks_used)", "used {{medium}}"),
                            Target(
                                "sum by (medium) (kvworker_kv_blocks_capacity)",
                                "capacity {{medium}}",
                            ),
                        ),
                        "short",
                    ),
                    Panel(
                        "Evictions, demotions, promotions /s",
                        (
                            Target(
                                rate("kvworker_kv_block_moves", "kind, medium"),
                                "{{kind}} {{medium}}",
                            ),
                        ),
                        "ops",
                        "Block transitions: demotion HBM->DRAM->SSD on evict, promotion "
                        "back on a hit, eviction off the last medium.",
                    ),
                    Panel(
                        "Load bandwidth into HBM",
                        (
                            Target(
                                "max by (instance, medium) "
                                "(kvworker_kv_load_bandwidth_bytes_per_second)",
                                "{{instance}} from {{medium}}",
                            ),
                        ),
                        "Bps",
                        "Measured bytes/s moving KV from DRAM/SSD into HBM (torch runner).",
                    ),
                ),
            ),
            Row(
                "Scheduler",
                (
                    Panel(
                        "Running and waiting requests",
                        (
                            Target(
                                "sum by (instance) (kvworker_num_requests_running)",
                                "running {{instance}}",
                            ),
                            Target(
                                "sum by (instance) (kvworker_num_requests_waiting)",
                                "waiting {{instance}}",
                            ),
                        ),
                        "none",
                    ),
                    Panel(
                        "Queued prefill tokens",
                        (
                            Target(
                                "sum by (instance) (kvworker_queued_prefill_tokens)", "{{instance}}"
                            ),
                        ),
                        "short",
                        "Prompt tokens still to prefill.",
                    ),
                    Panel(
                        "Engine step time p90",
                        (
                            Target(
                                quantile(0.9, "kvworker_engine_step_seconds", "instance"),
                                "{{instance}}",
                            ),
                        ),
                        "s",
                    ),
                    Panel(
                        "Engine busy",
                        (
                            Target(
                                rate("kvworker_engine_step_seconds_sum", "instance"), "{{instance}}"
                            ),
                        ),
                        "percentunit",
                        "Share of wall time spent in engine steps.",
                    ),
                    Panel(
                        "Worker TTFT and TPOT p90",
                        (
                            Target(
                                quantile(0.9, "kvworker_time_to_first_token_seconds", "instance"),
                                "TTFT {{instance}}",
                            ),
                            Target(
                                quantile(0.9, "kvworker_time_per_output_token_seconds", "instance"),
                                "TPOT {{instance}}",
                            ),
                        ),
                        "s",
                        "Measured at the worker (no gateway or network time).",
                    ),
                    Panel(
                        "Tokens/s",
                        (
                            Target(rate("kvworker_prompt_tokens_total"), "prompt"),
                            Target(rate("kvworker_generation_tokens_total"), "generated"),
                        ),
                        "short",
                    ),
                    Panel(
                        "Preemptions/s",
                        (Target(rate("kvworker_preemptions_total", "instance"), "{{instance}}"),),
                        "ops",
                        "Requests preempted when HBM ran out (recomputed later).",
                    ),
                ),
            ),
            Row(
                "Events and Redis",
                (
                    Panel(
                        "KV event batches/s",
                        (
                            Target(rate("kvworker_kv_event_batches_published_total"), "published"),
                            Target(rate("kvworker_kv_event_batches_dropped_total"), "dropped"),
                            Target(rate("kvworker_kv_snapshots_published_total"), "snapshots"),
                        ),
                        "ops",
                        "Dropped: buffer full while Redis was away (the index resyncs).",
                    ),
                    Panel(
                        "Redis reachable",
                        (Target("min by (instance) (kvworker_redis_up)", "{{instance}}"),),
                        "none",
                        "1 when the worker's last Redis write succeeded.",
                    ),
                ),
            ),
        ),
    )


def pd() -> Dashboard:
    """Prefill/decode disaggregation and KV pooling: plans, transfers, fallbacks, leases."""
    pulled = rate("kvworker_kv_transfer_bytes_total", "instance", 'direction="received"')
    return Dashboard(
        uid="kvrouter-pd",
        title="kvrouter / PD",
        description="Prefill/decode disaggregation and KV transfers between workers.",
        rows=(
            Row(
                "Plans",
                (
                    Panel(
                        "Requests/s by plan",
                        (Target(rate("kvrouter_pd_requests_total", "mode"), "{{mode}}"),),
                        "reqps",
                        "Colocated or disaggregated (prefill on one worker, decode on another).",
                        stack=True,
                    ),
                    Panel(
                        "Local fallbacks/s by reason",
                        (Target(rate("kvrouter_pd_fallbacks_total", "reason"), "{{reason}}"),),
                        "reqps",
                        "Disaggregated requests whose decoder prefilled locally.",
                    ),
                    Panel(
                        "Pooled pulls/s",
                        (Target(rate("kvrouter_pooled_pulls_total"), "pooled pulls"),),
                        "reqps",
                        "Requests sent with a peer to pull a longer cached prefix from.",
                    ),
                ),
            ),
            Row(
                "Transfers",
                (
                    Panel(
                        "KV transfer bytes/s",
                        (
                            Target(
                                rate("kvworker_kv_transfer_bytes_total", "direction"),
                                "{{direction}}",
                            ),
                        ),
                        "Bps",
                    ),
                    Panel(
                        "KV transfer blocks/s",
                        (
                            Target(
                                rate("kvworker_kv_transfer_blocks_total", "direction"),
                                "{{direction}}",
                            ),
                        ),
                        "ops",
                    ),
                    Panel(
                        "Measured pull bandwidth",
                        (
                            Target(
                                "max by (instance) "
                                "(kvworker_kv_transfer_bandwidth_bytes_per_second)",
                                "{{instance}}",
                            ),
                        ),
                        "Bps",
                    ),
                    Panel(
                        "Time spent pulling (estimate)",
                        (
                            Target(
                                f"{pulled} / (max by (instance) "
                                "(kvworker_kv_transfer_bandwidth_bytes_per_second) > 0)",
                                "{{instance}}",
                            ),
                        ),
                        "percentunit",
                        "Bytes pulled per second over the measured pull "
                        "bandwidth: the share of time a worker spends pulling.",
                    ),
                    Panel(
                        "Transfer failures/s by reason",
                        (
                            Target(
                                rate("kvworker_kv_transfer_failures_total", "reason"), "{{reason}}"
                            ),
                        ),
                        "ops",
                        "Pulls refused or failed (the request recomputes).",
                    ),
                    Panel(
                        "Leases",
                        (
                            Target("sum by (instance) (kvworker_kv_leases)", "held {{instance}}"),
                            Target(
                                rate("kvworker_kv_leases_expired_total"),
                                "expired/s",
                                right_unit="ops",
                            ),
                        ),
                        "none",
                        "Prefilled block runs held for a decoder; expired: never claimed.",
                    ),
                ),
            ),
        ),
    )
