"""A sim-worker fleet and the routers put in front of it, as real processes, for live comparisons.

One :class:`Fleet` owns an embedded Redis, the indexer and N ``sim`` workers
(the real server, scheduler and KV pool; modeled step times). Each router
under test (our gateway, ``vllm-router``, ``sglang-router``) is started by
:meth:`Fleet.router` in front of the same worker URLs and stopped after its
run; :meth:`Fleet.restart` stops the workers and the indexer, flushes Redis
and starts them again, so every router meets cold caches and an empty index.

Workers run without an internal token (the peers send none) and keep
publishing events and heartbeats to Redis whichever router is in front, so
every router runs beside the same background work.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvrouter.embedded_redis import EmbeddedRedis, free_port
from kvrouter.supervisor import Child, Supervisor

__all__ = ["PEER_POLICIES", "Fleet", "FleetConfig", "RouterSpec", "vllm_events_supported"]

#: The peers' policies a comparison can run, by router binary.
PEER_POLICIES: dict[str, tuple[str, ...]] = {
    "vllm-router": ("round_robin", "cache_aware", "kv_aware"),
    "sglang-router": ("cache_aware",),
}


def vllm_events_supported() -> bool:
    """Whether workers can publish vLLM-format ZMQ KV events (``kv_aware`` needs them)."""
    from engine_worker.settings import WorkerSettings

    return "vllm_events_endpoint" in WorkerSettings.model_fields


@dataclass(slots=True, frozen=True)
class RouterSpec:
    """One router under test: ``kvrouter``, ``vllm-router`` or ``sglang-router``, and a policy."""

    kind: str
    policy: str

    @property
    def name(self) -> str:
        """``kind:policy`` (the row label)."""
        return f"{self.kind}:{self.policy}"

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        """``kvrouter[:policy]``, ``vllm-router:policy`` or ``sglang-router[:policy]``.

        Raises:
            ValueError: Unknown router or policy.
        """
        kind, _, policy = text.strip().partition(":")
        if kind == "kvrouter":
            return cls(kind, policy or "kv_ttft")
        if kind not in PEER_POLICIES:
            raise ValueError(f"unknown router {kind!r}: kvrouter, {', '.join(PEER_POLICIES)}")
        policy = policy or "cache_aware"
        if policy not in PEER_POLICIES[kind]:
            choices = ", ".join(PEER_POLICIES[kind])
            raise ValueError(f"{kind} policy {policy!r} is not one of {choices}")
        return cls(kind, policy)


@dataclass(slots=True)
class FleetConfig:
    """The workers every router is put in front of.

    Attributes:
        workers: Sim workers.
        time_scale: Multiplies modeled step times (0: no modeled compute).
        model: Model spec (its tokenizer; ``tiny`` is SmolLM2's).
        hbm_blocks: HBM blocks per worker.
        dram_blocks: DRAM blocks per worker.
        max_num_seqs: Requests per step.
        max_num_batched_tokens: Tokens per step.
        profile: Timing profile ("" = the packaged default).
    """

    workers: int = 4
    time_scale: float = 1.0
    model: str = "tiny"
    hbm_blocks: int = 2048
    dram_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    profile: str = ""


@dataclass(slots=True)
class Fleet:
    """Redis, the indexer and the workers (see the module docstring)."""

    config: FleetConfig
    log_dir: Path
    redis: EmbeddedRedis | None = None
    workers: dict[str, str] = field(default_factory=dict)
    events: dict[str, tuple[str, str]] = field(default_factory=dict)
    _sup: Supervisor | None = None
    _start: int = 0

    @property
    def redis_url(self) -> str:
        """The fleet's Redis."""
        assert self.redis is not None, "fleet not started"
        return self.redis.url

    def start(self, timeout: float = 120.0) -> None:
        """Start Redis (once), then the indexer and the workers; wait until healthy."""
        if self.redis is None:
            self.redis = EmbeddedRedis()
            self.redis.start()
        self._start += 1
        env = {"KVINDEX_REDIS_URL": self.redis_url, "KVWORKER_REDIS_URL": self.redis_url,
               "KVWORKER_HEARTBEAT_INTERVAL_S": "0.5", "KVWORKER_HEARTBEAT_TTL_S": "3"}  # fmt: skip
        sup = Supervisor(self.log_dir / f"fleet-{self._start}", env=env)
        self._sup = sup
        py = [sys.executable, "-m", "kvrouter"]
        mport = free_port()
        children = [sup.spawn("indexer", [*py, "indexer", "--metrics-port", str(mport)],
                              f"http://127.0.0.1:{mport}/metrics")]  # fmt: skip
        self.workers, self.events = {}, {}
        cfg = self.config
        for i in range(cfg.workers):
            port, name = free_port(), f"w{i}"
            args = [
                *py, "worker", "--runner", "sim", "--model", cfg.model, "--port", str(port),
                "--name", name, "--time-scale", str(cfg.time_scale),
                "--hbm-blocks", str(cfg.hbm_blocks), "--dram-blocks", str(cfg.dram_blocks),
                "--max-num-seqs", str(cfg.max_num_seqs),
                "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                "--log-level", "warning",
            ]  # fmt: skip
            if cfg.profile:
                args += ["--profile", cfg.profile]
            url = f"http://127.0.0.1:{port}"
            if vllm_events_supported():
                pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
                self.events[url] = (pub, replay)
                sup.env = {**env, "KVWORKER_VLLM_EVENTS_ENDPOINT": pub,
                           "KVWORKER_VLLM_EVENTS_REPLAY_ENDPOINT": replay}  # fmt: skip
            children.append(sup.spawn(name, args, f"{url}/health"))
            self.workers[name] = url
        sup.env = env
        sup.wait_healthy(children, timeout)

    def stop(self) -> None:
        """Stop the workers and the indexer (Redis stays)."""
        if self._sup is not None:
            self._sup.stop_all()
            self._sup = None

    def restart(self) -> None:
        """Stop workers and indexer, flush Redis, start them again (cold caches, empty index)."""
        self.stop()
        import redis as sync_redis

        client = sync_redis.Redis.from_url(self.redis_url)
        try:
            client.flushall()
        finally:
            client.close()
        self.start()

    def close(self) -> None:
        """Stop everything, Redis last."""
        self.stop()
        if self.redis is not None:
            self.redis.close()
            self.redis = None

    @contextlib.contextmanager
    def router(self, spec: RouterSpec, timeout: float = 60.0) -> Iterator[str]:
        """Run ``spec`` in front of the workers; yields its base URL once it routes."""
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        sup = Supervisor(self.log_dir / f"fleet-{self._start}")
        urls = list(self.workers.values())
        if spec.kind == "kvrouter":
            sup.env = {"KVROUTER_REDIS_URL": self.redis_url}
            args = [sys.executable, "-m", "kvrouter", "serve", "--port", str(port),
                    "--model", self.config.model, "--policy", spec.policy,
                    "--log-level", "warning"]  # fmt: skip
        else:
            binary = _binary(spec.kind)
            head = [binary, "launch"] if spec.kind == "sglang-router" else [binary]
            args = [*head, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                    "--policy", spec.policy, "--prometheus-port", str(free_port()),
                    "--log-level", "warning" if spec.kind == "vllm-router" else "warn"]  # fmt: skip
            if spec.policy == "kv_aware":
                if not self.events:
                    raise RuntimeError("kv_aware needs workers that publish vLLM KV events")
                for url, (pub, replay) in self.events.items():
                    args += ["--kv-event-source", f"{url}={pub}",
                             "--kv-event-replay-source", f"{url}={replay}"]  # fmt: skip
                args += ["--kv-event-block-size", "16", "--kv-event-model", self.config.model]
        child = sup.spawn(spec.name.replace(":", "-"), args)
        try:
            _wait_routing(child, base, self.config.model, timeout)
            if spec.kind == "kvrouter":
                _wait_workers(child, base, len(urls), timeout)
            yield base
        finally:
            sup.stop_all()


def _binary(name: str) -> str:
    """The router's console script: beside this interpreter (a venv's bin) or on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (pip install the dev extra)")
    return found


def _alive_or_raise(child: Child) -> None:
    if not child.alive:
        tail = child.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{child.name} exited during start-up:\n{tail}")


def _wait_routing(child: Child, base: str, model: str, timeout: float) -> None:
    """Wait until one tiny completion goes through the router (health alone says little)."""
    deadline = time.monotonic() + timeout
    body = {"model": model, "prompt": " the", "max_tokens": 1, "temperature": 0}
    last = ""
    while time.monotonic() < deadline:
        _alive_or_raise(child)
        try:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{child.name} did not route a request within {timeout:.0f}s: {last}")


def _wait_workers(child: Child, base: str, workers: int, timeout: float) -> None:
    """Wait until our gateway has discovered every worker (``/ready`` counts them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _alive_or_raise(child)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(f"{base}/ready", timeout=5).json().get("workers", 0) >= workers:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{child.name} did not see {workers} workers within {timeout:.0f}s")
