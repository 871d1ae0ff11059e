"""Worker settings (environment prefix ``KVWORKER_``; the CLI sets the same fields)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from indexer.profile import DEFAULT_TRANSFER_BANDWIDTH
from indexer.views import Role

__all__ = ["WorkerSettings"]


class WorkerSettings(BaseSettings):
    """Everything a worker needs to start.

    Capacities are in blocks of ``block_size`` tokens; ``dram_blocks`` and
    ``ssd_blocks`` of 0 disable those tiers.
    """

    model_config = SettingsConfigDict(env_prefix="KVWORKER_", extra="ignore")

    name: str = Field("", description="Worker name in events and the index; default worker-PORT")
    model: str = Field("tiny", description="smollm2 | tiny | path to a .gguf file or HF directory")
    served_model_name: str = Field("", description="Model name clients use; default the model's")
    runner: Literal["torch", "sim"] = "torch"
    role: Role = Role.BOTH
    bind: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    advertise_url: str = Field("", description="URL routers use; default http://bind:port")
    redis_url: str | None = Field(None, description="Redis for events and heartbeats; none = off")
    key_prefix: str = "kvr"
    block_size: int = Field(16, ge=1, le=1024)
    hbm_blocks: int = Field(2048, ge=1)
    dram_blocks: int = Field(4096, ge=0)
    ssd_blocks: int = Field(0, ge=0)
    ssd_path: Path | None = None
    device: str = "cpu"
    kv_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int = Field(0, ge=0, description="0 = the model's context, capped by HBM")
    enable_prefix_caching: bool = True
    async_loads: bool = Field(
        True,
        description="sim runner: bring cached DRAM/SSD blocks up into HBM beside the steps "
        "(the request waits, the others compute on), as vLLM's offloading connector does; "
        "false: in the step that admits the request. The torch runner copies them in that "
        "step whatever this says",
    )
    profile: str = Field("", description="sim runner: timing profile name or JSON path")
    time_scale: float = Field(1.0, ge=0.0, description="sim runner: multiply modeled step times")
    sim_transfer_bandwidth: float = Field(
        DEFAULT_TRANSFER_BANDWIDTH,
        gt=0,
        description="sim runner: modeled bytes/s of KV pulls from peers (its blocks are "
        "placeholders: a pull takes the profile's KV bytes over this, times time_scale)",
    )
    sim_vocab_size: int = Field(49152, ge=2)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(5.0, gt=0)
    event_batch_blocks: int = Field(512, ge=1)
    event_max_delay_s: float = Field(0.01, ge=0)
    event_buffer_limit: int = Field(10_000, ge=1)
    event_drop_rate: float = Field(0.0, ge=0.0, le=1.0, description="fault hook: drop batches")
    vllm_events_endpoint: str = Field(
        "", description="bind a ZMQ PUB of vLLM-format KV events here (tcp://*:5557); empty = off"
    )
    vllm_events_replay_endpoint: str = Field(
        "", description="bind vLLM's replay ROUTER socket here (tcp://*:5558); empty = no replay"
    )
    vllm_events_topic: str = Field("", description="topic frame of the vLLM-format events")
    vllm_events_buffer_steps: int = Field(10_000, ge=1, description="batches kept for replay")
    internal_token: SecretStr | None = Field(
        None, description="when set, required on every route but /health (and /metrics)"
    )
    metrics_require_token: bool = Field(False, description="/metrics needs the token too")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    kv_port: int = Field(0, ge=0, le=65535, description="KV data socket port (0: any free)")
    lease_ttl_s: float = Field(30.0, gt=0, description="PD: how long prefilled blocks wait")
    drain_s: float = Field(
        30.0, ge=0, description="on SIGTERM: how long in-flight requests may finish"
    )
    keep_alive_s: float = Field(
        75.0,
        ge=1,
        description="how long an idle keep-alive connection stays open (above clients' own 5 s)",
    )
    keep_alive_on_engine_death: bool = Field(
        False,
        description="stay up (answering 503) when the engine loop dies, instead of exiting "
        "with status 1 to be restarted (vLLM: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_ttl_s must exceed heartbeat_interval_s")
        if self.vllm_events_replay_endpoint and not self.vllm_events_endpoint:
            raise ValueError("vllm_events_replay_endpoint needs vllm_events_endpoint")
        if self.ssd_blocks > 0 and self.runner == "torch" and self.ssd_path is None:
            raise ValueError("ssd_blocks > 0 needs ssd_path with the torch runner")
        return self

    @property
    def worker_name(self) -> str:
        """The worker's name (host) in events, heartbeats and the index."""
        return self.name or f"worker-{self.port}"

    @property
    def url(self) -> str:
        """The URL routers use to reach this worker."""
        return self.advertise_url or f"http://{self.bind}:{self.port}"
