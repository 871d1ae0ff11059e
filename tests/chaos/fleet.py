"""A whole kvrouter deployment as real processes, with the handles a chaos test needs.

::

    load --> gateway g0, g1 (kvrouter serve)  ----------------> worker w0, w1 (sim)
                  |                             \\--> TcpProxy --> worker w2 (sim)
                  v                                   (w2 advertises the proxy's URL)
             TcpProxy --> redis-server (AOF on, so a restart can keep its data)
                  ^
             indexer, workers (every process reaches Redis through the proxy)

Observers (the audit, counters, process figures) talk to Redis and to the
workers directly, so that a fault injected in a proxy never blinds them.
Every process runs in its own process group (:class:`ServerProcess`) and
can be SIGKILLed, SIGTERMed and restarted on the same port; fast heartbeat,
discovery and lease settings keep recovery times in seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from indexer.audit import HostAudit, audit
from indexer.index import RedisIndex
from indexer.ingest_reader import open_client
from indexer.wire import Keyspace
from tests.support.redis_proc import RedisProcess, free_port
from tests.support.servers import ServerProcess
from tests.support.tcp_proxy import TcpProxy

__all__ = [
    "GATEWAY_ENV",
    "INDEXER_ENV",
    "KEYSPACE",
    "MODEL",
    "WORKER_ENV",
    "Counters",
    "Fleet",
    "FleetSpec",
    "IndexState",
    "PersistentRedis",
    "Service",
    "key_kind",
    "metric_samples",
    "process_figures",
    "start_all",
    "wait_for",
]

_T = TypeVar("_T")

MODEL = "tiny"
KEYSPACE = Keyspace("kvr")

#: Fast presence: a dead worker's heartbeat is gone within 2 s. A SIGTERMed worker
#: drains its streams for at most ``KVWORKER_DRAIN_S``.
WORKER_ENV = {
    "KVWORKER_HEARTBEAT_INTERVAL_S": "0.2",
    "KVWORKER_HEARTBEAT_TTL_S": "2.0",
    "KVWORKER_DRAIN_S": "10",
}
#: Fast ingestion: host leases of a dead indexer expire in 2 s, dead hosts are found
#: within 1 s, a quiet host's tail is checked after 1 s (a dropped last batch).
INDEXER_ENV = {
    "KVINDEX_REFRESH_INTERVAL_S": "0.2",
    "KVINDEX_LEASE_TTL_S": "2",
    "KVINDEX_DEAD_CHECK_INTERVAL_S": "1.0",
    "KVINDEX_BLOCK_MS": "50",
    "KVINDEX_QUIET_SNAPSHOT_S": "1.0",
}
#: Fast discovery and load sharing: a killed replica's load lease expires in 2 s.
GATEWAY_ENV = {
    "KVROUTER_DISCOVERY_INTERVAL_S": "0.1",
    "KVROUTER_LOAD_SYNC_INTERVAL_S": "0.1",
    "KVROUTER_LOAD_LEASE_S": "2.0",
}


def wait_for(
    probe: Callable[[], _T | None], cap_s: float, interval_s: float = 0.25
) -> tuple[_T | None, float]:
    """Call ``probe`` until it returns a value (not None) or ``cap_s`` passed.

    Returns:
        The value (None when the cap passed) and the seconds waited.
    """
    t0 = time.monotonic()
    while True:
        value = probe()
        waited = time.monotonic() - t0
        if value is not None or waited >= cap_s:
            return value, waited
        time.sleep(interval_s)


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` (its full sample name) in a Prometheus exposition."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((dict(sample.labels), float(sample.value)))
    return out


class PersistentRedis(RedisProcess):
    """The test Redis with an append-only file, so that it can come back with its data."""

    def __init__(self) -> None:
        super().__init__(extra_args=("--appendonly", "yes", "--appendfsync", "everysec"))

    def restart_with_data(self, down_s: float) -> None:
        """SIGTERM (Redis flushes its AOF and exits), stay down ``down_s``, start again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.proc = None
        time.sleep(down_s)
        self.start()

    def restart_without_data(self, down_s: float) -> None:
        """SIGKILL, wipe the data directory, stay down ``down_s``, start empty."""
        self.stop()
        for child in self.dir.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        time.sleep(down_s)
        self.start()


@dataclass(slots=True)
class Service:
    """One ``kvrouter`` process that can be killed and started again on the same port.

    Attributes:
        name: Its name in reports (``w0``, ``g1``, ``indexer``).
        args: CLI arguments after ``kvrouter``.
        port: Its HTTP port (direct, never a proxy's).
        health_path: What answers 200 once it is up.
        log_path: Its output, appended across restarts.
        env: Environment added to the test's.
        extra_env: Environment of the current incarnation on top of ``env``.
    """

    name: str
    args: list[str]
    port: int
    health_path: str
    log_path: Path
    env: dict[str, str]
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        """Its base URL on loopback."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        """Whether its process is running."""
        return (
            self.proc is not None and self.proc.proc is not None and self.proc.proc.poll() is None
        )

    @property
    def pid(self) -> int:
        """PID of the process (the Python interpreter leading its process group)."""
        popen = self.proc.proc if self.proc is not None else None
        assert popen is not None, f"{self.name} was never started"
        return popen.pid

    def start(self, extra_env: Mapping[str, str] | None = None, timeout: float = 180.0) -> None:
        """Start it (with ``extra_env`` for this incarnation) and wait until healthy."""
        self.extra_env = dict(extra_env or {})
        self.proc = ServerProcess(
            self.args, health_url=self.url + self.health_path, log_path=self.log_path,
            env={**self.env, **self.extra_env},
        )  # fmt: skip
        self.proc.start(timeout)

    def kill(self) -> None:
        """SIGKILL its process group."""
        if self.proc is not None:
            self.proc.kill()

    def terminate(self, timeout: float) -> float | None:
        """SIGTERM it and wait for the exit; seconds it took, or None (then SIGKILLed)."""
        if not self.alive:
            return 0.0
        popen = self.proc.proc if self.proc is not None else None
        assert popen is not None
        t0 = time.monotonic()
        os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        return time.monotonic() - t0


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Shape of the deployment.

    Attributes:
        workers: Sim workers (the last one sits behind a proxy).
        gateways: Gateway replicas.
        time_scale: Sim runner: multiplier of the modeled step times (1.0 is the
            H100 profile's own timing: ~6 ms a decode step, ~50 ms a 2K prefill).
        hbm_blocks: HBM blocks per worker.
        dram_blocks: DRAM blocks per worker.
        max_num_seqs: Requests per engine step.
    """

    workers: int = 3
    gateways: int = 2
    time_scale: float = 1.0
    hbm_blocks: int = 4096
    dram_blocks: int = 4096
    max_num_seqs: int = 64


@dataclass(frozen=True, slots=True)
class IndexState:
    """One look at the index: does it hold exactly what every live worker holds?

    Attributes:
        ok: The audit passed, no dead host keeps entries, every running worker is live.
        detail: What differs, when not ok.
    """

    ok: bool
    detail: str


@dataclass(slots=True)
class Counters:
    """Load accounting that must read zero once the load stops.

    Attributes:
        workers: Per worker: running, waiting, in_flight (its view), leases (PD gauge).
        gateways: Per replica: ``kvrouter_worker_in_flight`` per worker label.
        redis_leases: Per ``{p}:load:r:*`` key: its ``worker -> "in_flight,tokens"`` fields.
        errors: Observers that could not be read.
    """

    workers: dict[str, dict[str, float]] = field(default_factory=dict)
    gateways: dict[str, dict[str, float]] = field(default_factory=dict)
    redis_leases: dict[str, dict[str, str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def nonzero(self) -> list[str]:
        """Every counter that is not zero (empty when all are, and all were read)."""
        out = list(self.errors)
        for w, fields in self.workers.items():
            out += [f"worker {w} {k}={v:g}" for k, v in fields.items() if v]
        for g, per in self.gateways.items():
            out += [f"gateway {g} in_flight[{w}]={v:g}" for w, v in per.items() if v]
        for key, per_worker in self.redis_leases.items():
            out += [f"{key}[{w}]={v}" for w, v in per_worker.items() if v != "0,0"]
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {"workers": self.workers, "gateways": self.gateways,
                "redis_leases": self.redis_leases, "errors": self.errors}  # fmt: skip


class Fleet:
    """The processes of one deployment (see the module docstring); a context manager.

    Args:
        root: Directory for logs.
        spec: Its shape.
    """

    def __init__(self, root: Path, spec: FleetSpec) -> None:
        self.root = root
        self.spec = spec
        self.redis = PersistentRedis()
        self.redis_proxy = TcpProxy("127.0.0.1", self.redis.port)
        #: What the fleet's processes use; observers use :attr:`direct_redis_url`.
        self.redis_url = f"redis://{self.redis_proxy.address}/0"
        self.direct_redis_url = self.redis.url
        self.indexer = self._service(
            "indexer", ["indexer", "--redis", self.redis_url, "--metrics-port", "{port}"],
            "/health", INDEXER_ENV,
        )  # fmt: skip
        self.workers = [self._worker(f"w{i}") for i in range(spec.workers)]
        last = self.workers[-1]
        self.worker_proxy = TcpProxy("127.0.0.1", last.port)
        last.env["KVWORKER_ADVERTISE_URL"] = f"http://{self.worker_proxy.address}"
        serve = ["serve", "--port", "{port}", "--model", MODEL, "--redis", self.redis_url]
        self.gateways = [
            self._service(f"g{i}", serve, "/health", GATEWAY_ENV) for i in range(spec.gateways)
        ]

    def _service(self, name: str, args: list[str], health: str, env: Mapping[str, str]) -> Service:
        port = free_port()
        args = [a.replace("{port}", str(port)) for a in args]
        return Service(name, args, port, health, self.root / f"{name}.log", dict(env))

    def _worker(self, name: str) -> Service:
        s = self.spec
        args = [
            "worker", "--model", MODEL, "--runner", "sim", "--port", "{port}", "--name", name,
            "--redis", self.redis_url, "--max-num-seqs", str(s.max_num_seqs),
            "--time-scale", str(s.time_scale), "--hbm-blocks", str(s.hbm_blocks),
            "--dram-blocks", str(s.dram_blocks),
        ]  # fmt: skip
        return self._service(name, args, "/health", WORKER_ENV)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def services(self) -> list[Service]:
        """Every ``kvrouter`` process: indexer, workers, gateways."""
        return [self.indexer, *self.workers, *self.gateways]

    @property
    def gateway_urls(self) -> list[str]:
        """Base URLs of the gateway replicas."""
        return [g.url for g in self.gateways]

    def start(self) -> Fleet:
        """Start everything and wait until the fleet is ready (see :meth:`wait_ready`)."""
        self.redis.start()
        self.redis_proxy.start()
        self.worker_proxy.start()
        start_all(self.services)
        self.wait_ready()
        return self

    def close(self) -> None:
        """SIGKILL every process, stop the proxies and Redis."""
        for s in self.services:
            s.kill()
        self.worker_proxy.stop()
        self.redis_proxy.stop()
        self.redis.close()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ensure(self, worker_env: Mapping[str, str] | None = None) -> None:
        """Bring the fleet back to a healthy baseline before a scenario.

        Proxies are healed, Redis and every process that is down are started,
        workers whose extra environment differs from ``worker_env`` are
        restarted with it; then :meth:`wait_ready`.
        """
        wanted = dict(worker_env or {})
        self.redis_proxy.heal()
        self.worker_proxy.heal()
        self.redis.start()
        todo: list[tuple[Service, dict[str, str]]] = []
        for s in self.services:
            env = wanted if s in self.workers else {}
            if not s.alive or s.extra_env != env:
                s.kill()
                todo.append((s, env))
        if todo:
            with ThreadPoolExecutor(len(todo)) as pool:
                list(pool.map(lambda item: item[0].start(item[1]), todo))
        self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until every gateway routes to every worker, the indexer is ready, the index is
        exact and every load counter reads zero.

        Raises:
            TimeoutError: naming what is not ready.
        """
        t0 = time.monotonic()
        for g in self.gateways:
            self.wait_routable(g, len(self.workers), timeout)
        _, waited = wait_for(lambda: _ok(self.indexer.url + "/ready"), timeout)
        if not _ok(self.indexer.url + "/ready"):
            raise TimeoutError(
                f"indexer not ready after {waited:.0f}s\n" + self.diagnosis([self.indexer])
            )
        left = max(5.0, timeout - (time.monotonic() - t0))
        index_s, last = self.wait_index_ok(left)
        if index_s is None:
            raise TimeoutError(f"index not exact after {left:.0f}s: {last.detail}")
        zero_s, counters = self.wait_counters_zero(left)
        if zero_s is None:
            raise TimeoutError(f"load counters not zero: {counters.nonzero()}")

    def wait_routable(self, gateway: Service, workers: int, timeout: float) -> float:
        """Seconds until ``gateway``'s /ready counts ``workers`` routable workers."""

        def probe() -> bool | None:
            try:
                r = httpx.get(gateway.url + "/ready", timeout=2.0)
            except httpx.HTTPError:
                return None
            return True if r.status_code == 200 and r.json().get("workers") == workers else None

        found, waited = wait_for(probe, timeout, 0.1)
        if found is None:
            raise TimeoutError(
                f"gateway {gateway.name} does not see {workers} workers after {waited:.0f}s\n"
                + self.diagnosis([gateway, *self.workers])
            )
        return waited

    def diagnosis(self, services: Iterable[Service], lines: int = 12) -> str:
        """What a failed wait needs to be understood from a CI log alone: each service's
        liveness and last log lines, the gateways' /ready and the presence keys in Redis
        (read directly, never through the proxy)."""
        out = []
        for g in self.gateways:
            try:
                r = httpx.get(g.url + "/ready", timeout=2.0)
                out.append(f"{g.name} /ready: {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                out.append(f"{g.name} /ready: {exc!r}")
        client = redis.Redis.from_url(self.direct_redis_url, socket_timeout=5.0)
        try:
            hosts = sorted(h.decode() for h in client.hkeys(KEYSPACE.hosts))  # type: ignore[union-attr]
            beating = [h for h in hosts if client.exists(KEYSPACE.heartbeat(h))]
            out.append(f"redis: registered {hosts}, heartbeating {beating}")
        except RedisError as exc:
            out.append(f"redis: {exc!r}")
        finally:
            client.close()
        out.append(f"proxies: redis {self.redis_proxy.stats}, worker {self.worker_proxy.stats}")
        for s in services:
            tail = (s.proc.logs() if s.proc is not None else "").splitlines()[-lines:]
            out.append(f"--- {s.name} (alive: {s.alive}), last {len(tail)} log lines:")
            out.extend(tail)
        return "\n".join(out)

    def worker_view(self, worker: Service) -> dict[str, Any]:
        """The worker's own view, asked directly (never through a proxy); {} if it does not
        answer."""
        try:
            out: dict[str, Any] = httpx.get(worker.url + "/worker/view", timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return out

    # -- the index ------------------------------------------------------------------------------

    def index_state(self) -> IndexState:
        """Audit the index against every live worker (see :class:`IndexState`)."""
        try:
            return asyncio.run(self._index_state())
        except (RedisError, OSError) as exc:
            return IndexState(False, f"redis: {exc}")

    async def _index_state(self) -> IndexState:
        client = await open_client(self.direct_redis_url, socket_timeout=5.0)
        try:
            index = RedisIndex(client, KEYSPACE)
            report = await audit(client, index, keyspace=KEYSPACE, retries=3, interval_s=0.2)
            problems = [f"{h.host}: {_differences(h)}" for h in report.hosts if not h.ok]
            live = {h.host for h in report.hosts}
            for host in await index.hosts():
                if host not in live:
                    held = sum(len(keys) for keys in (await index.entries(host)).values())
                    if held:
                        problems.append(f"{host}: dead, still {held} entries")
            running = {w.name for w in self.workers if w.alive}
            problems += [f"{w}: running but not live in Redis" for w in sorted(running - live)]
            return IndexState(not problems, "; ".join(problems))
        finally:
            await client.aclose()

    def wait_index_ok(self, cap_s: float) -> tuple[float | None, IndexState]:
        """Seconds until the index is exact (None past ``cap_s``) and the last state seen."""
        last = IndexState(False, "not checked")

        def probe() -> bool | None:
            nonlocal last
            last = self.index_state()
            return True if last.ok else None

        ok, waited = wait_for(probe, cap_s, 0.5)
        return (waited if ok else None), last

    # -- load counters --------------------------------------------------------------------------

    def counters(self) -> Counters:
        """Read every load counter: workers' views and lease gauges, gateways' in-flight
        gauges, the replicas' load leases in Redis."""
        out = Counters()
        with httpx.Client(timeout=5.0) as http:
            for w in self.workers:
                if not w.alive:
                    continue
                try:
                    view = http.get(w.url + "/worker/view").json()
                    leases = metric_samples(http.get(w.url + "/metrics").text, "kvworker_kv_leases")
                except (httpx.HTTPError, ValueError) as exc:
                    out.errors.append(f"worker {w.name}: {exc!r}")
                    continue
                out.workers[w.name] = {
                    k: float(view[k]) for k in ("running", "waiting", "in_flight")
                }
                out.workers[w.name]["leases"] = sum(v for _, v in leases)
            for g in self.gateways:
                if not g.alive:
                    continue
                try:
                    text = http.get(g.url + "/metrics").text
                except httpx.HTTPError as exc:
                    out.errors.append(f"gateway {g.name}: {exc!r}")
                    continue
                samples = metric_samples(text, "kvrouter_worker_in_flight")
                out.gateways[g.name] = {labels.get("worker", "?"): v for labels, v in samples}
        client = redis.Redis.from_url(self.direct_redis_url, socket_timeout=5.0)
        try:
            for key in client.scan_iter(match=KEYSPACE.load("r:*"), count=1000):
                held: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]
                out.redis_leases[key.decode()] = {k.decode(): v.decode() for k, v in held.items()}
        except RedisError as exc:
            out.errors.append(f"redis: {exc!r}")
        finally:
            client.close()
        return out

    def gateway_counters(self) -> dict[str, float]:
        """Each replica's retry and broken-stream counters (for before/after deltas):
        ``g0 retries[reason]`` (dispatches retried before the first byte), ``g0 stream_errors``."""
        out: dict[str, float] = {}
        for g in self.gateways:
            if not g.alive:
                continue
            try:
                text = httpx.get(g.url + "/metrics", timeout=5.0).text
            except httpx.HTTPError:
                continue
            for labels, v in metric_samples(text, "kvrouter_retries_total"):
                out[f"{g.name} retries[{labels.get('reason', '?')}]"] = v
            for _, v in metric_samples(text, "kvrouter_stream_errors_total"):
                out[f"{g.name} stream_errors"] = v
        return out

    def wait_counters_zero(self, cap_s: float) -> tuple[float | None, Counters]:
        """Seconds until every load counter reads zero (None past ``cap_s``), last reading."""
        last = Counters()

        def probe() -> bool | None:
            nonlocal last
            last = self.counters()
            return True if not last.nonzero() else None

        ok, waited = wait_for(probe, cap_s, 0.1)
        return (waited if ok else None), last

    # -- process and Redis figures --------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """PID of every running process, Redis included."""
        out = {s.name: s.pid for s in self.services if s.alive}
        if self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out

    def redis_figures(self) -> dict[str, Any]:
        """Redis memory, key count and keys per kind (``{p}:idx:*`` etc.), stream lengths."""
        client = redis.Redis.from_url(self.direct_redis_url, socket_timeout=10.0)
        try:
            info = client.info("memory")
            kinds: dict[str, int] = {}
            streams: dict[str, int] = {}
            names: list[str] = []
            for raw in client.scan_iter(count=5000):
                key = raw.decode(errors="replace")
                kind = key_kind(key)
                kinds[kind] = kinds.get(kind, 0) + 1
                if kind in ("events", "control"):
                    streams[key] = int(client.xlen(key))
                if kind != "index":
                    names.append(key)
            return {
                "used_memory": int(info["used_memory"]),
                "dbsize": int(client.dbsize()),
                "keys_by_kind": kinds,
                "stream_lengths": streams,
                "non_index_keys": sorted(names),
            }
        finally:
            client.close()


def key_kind(key: str) -> str:
    """Which part of kvrouter owns a Redis key (by its prefix, see :class:`Keyspace`)."""
    p = KEYSPACE.prefix
    for prefix, kind in (
        (f"{p}:idx:", "index"), (f"{p}:ev:", "events"), (f"{p}:ctl:", "control"),
        (f"{p}:hb:", "heartbeats"), (f"{p}:load:r:", "load_leases"), (f"{p}:load:", "load"),
    ):  # fmt: skip
        if key.startswith(prefix):
            return kind
    return "other"


def start_all(services: Iterable[Service]) -> None:
    """Start services in parallel (a worker takes seconds to import its stack)."""
    todo = list(services)
    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        list(pool.map(lambda s: s.start(), todo))


def _differences(host: HostAudit) -> str:
    """One line on how a host's index entries differ from its blocks."""
    if host.error is not None:
        return f"unreachable ({host.error})"
    return ", ".join(
        f"{d.medium.value} missing {len(d.missing)} extra {len(d.extra)}" for d in host.diffs
    )


def _ok(url: str) -> bool | None:
    try:
        return True if httpx.get(url, timeout=2.0).status_code == 200 else None
    except httpx.HTTPError:
        return None


def process_figures(pid: int) -> dict[str, int]:
    """RSS (kB, ``VmRSS``) and open file descriptors of one process."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}
