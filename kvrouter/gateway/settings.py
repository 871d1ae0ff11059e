"""Gateway settings (environment prefix ``KVROUTER_``; the CLI sets the same fields)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["RouterSettings"]


class RouterSettings(BaseSettings):
    """Everything a gateway replica needs.

    Workers are found in the Redis registry their heartbeats write into
    (``redis_url``), and/or listed in ``workers`` (static URLs).
    """

    model_config = SettingsConfigDict(env_prefix="KVROUTER_", extra="ignore")

    bind: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["smollm2"],
        description="model specs whose tokenizers the gateway loads (smollm2, tiny, a path)",
    )
    redis_url: str | None = Field(None, description="Redis of the index and the registry")
    key_prefix: str = "kvr"
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="static worker base URLs"
    )
    block_size: int = Field(16, ge=1, le=1024)
    policy: str = "kv_ttft"
    fallback_policy: str = Field("least_load", description="routing while the index is away")
    index_mode: Literal["mirror", "redis"] = Field(
        "mirror",
        description="lookups from an in-process mirror of the Redis index, or a Lua call per "
        "lookup in Redis",
    )
    speculative_ttl_s: float = Field(
        2.0, gt=0, description="kv_ttft: how long a routed prefix counts before its events land"
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="client Bearer keys"
    )
    internal_token: SecretStr | None = Field(None, description="the workers' internal token")
    allowed_workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host names and networks (CIDR) workers may live at; empty = any",
    )
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_prompt_tokens: int = Field(131072, ge=1)
    prompt_cache_mib: float = Field(
        64.0, ge=0, description="token ids of prompt prefixes kept per model, MiB (0 = none)"
    )
    max_attempts: int = Field(3, ge=1, le=10, description="dispatch attempts before the first byte")
    connect_timeout_s: float = Field(2.0, gt=0)
    first_byte_timeout_s: float = Field(300.0, gt=0)
    discovery_interval_s: float = Field(0.5, gt=0)
    load_lease_s: float = Field(10.0, gt=0, description="TTL of this replica's shared load counts")
    load_sync_interval_s: float = Field(0.2, gt=0)
    replica_id: str = Field("", description="this gateway replica's id; default random")
    debug_header: str = "x-kvrouter-debug"
    session_header: str = "x-session-id"
    pd: Literal["never", "always", "auto"] = Field(
        "never", description="prefill/decode disaggregation: never, always, or auto (by cost)"
    )
    pooling: bool = Field(
        True, description="kv_ttft: pull a longer cached prefix from a peer when that is faster"
    )
    drain_s: float = Field(
        30.0, ge=0, description="on SIGTERM: how long in-flight streams may finish (not ready)"
    )
    keep_alive_s: float = Field(
        75.0,
        ge=1,
        description="how long an idle keep-alive connection stays open (above clients' own 5 s)",
    )
    unready_grace_s: float = Field(
        0.0, ge=0, description="on SIGTERM: serve on, not ready, this long before draining"
    )
    max_sessions: int = Field(100_000, ge=0, description="session-affinity entries kept")
    session_ttl_s: float = Field(600.0, gt=0, description="how long a session's worker is kept")
    rate_limit_rps: float = Field(
        0.0, ge=0, description="requests/s per API key over all replicas (0 = no limit)"
    )
    rate_limit_tpm: float = Field(
        0.0, ge=0, description="tokens/minute (prompt + max_tokens) per API key (0 = no limit)"
    )
    rate_limit_burst_s: float = Field(
        1.0, gt=0, description="bucket depth: how many seconds of the rate may come at once"
    )
    admission_max_ttft_s: float | None = Field(
        None, gt=0, description="429 when the best predicted TTFT is over this (off: None)"
    )
    seed: int = 0

    @field_validator("allowed_workers")
    @classmethod
    def _valid_networks(cls, v: list[str]) -> list[str]:
        from kvrouter.gateway.discovery import AllowedWorkers

        AllowedWorkers.parse(v)
        return v

    @field_validator("workers", "models", "api_keys", "allowed_workers", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        """A list from the environment: a JSON array, or comma-separated values."""
        if isinstance(v, str):
            if v.lstrip().startswith("["):
                try:
                    return json.loads(v)
                except ValueError as exc:
                    raise ValueError(f"not a JSON array: {exc}") from exc
            return [x.strip() for x in v.split(",") if x.strip()]
        return v
