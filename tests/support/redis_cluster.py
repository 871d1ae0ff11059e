"""A throwaway Redis Cluster on loopback: three masters, no replicas.

Each node is a real ``redis-server`` started by
:class:`kvrouter.embedded_redis.EmbeddedRedis` with cluster mode on; the
slots are assigned by ``redis-cli --cluster create`` and the cluster is
ready once every node reports ``cluster_state:ok`` and all 16384 slots.
The cluster bus port is chosen explicitly (``cluster-port``, Redis 7)
because the default, port + 10000, may not exist for a high free port.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from kvrouter.embedded_redis import EmbeddedRedis, free_port

__all__ = ["RedisCluster"]


class RedisCluster:
    """``size`` cluster-enabled redis-server processes joined into one cluster."""

    def __init__(self, size: int = 3) -> None:
        if size < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.nodes = [EmbeddedRedis(extra_args=self._node_args()) for _ in range(size)]

    @staticmethod
    def _node_args() -> tuple[str, ...]:
        return (
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "5000",
            "--cluster-port", str(free_port()),
        )  # fmt: skip

    @property
    def url(self) -> str:
        """URL of the first node; a cluster client discovers the others from it."""
        return self.nodes[0].url

    @property
    def addresses(self) -> list[str]:
        """``host:port`` of every node."""
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster and wait until it serves every slot.

        On failure every node started so far is stopped before the error propagates.
        """
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float) -> None:
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not on PATH; it is needed to create a cluster")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *self.addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster on {self.addresses} not ready after {timeout}s")
            time.sleep(0.05)

    def ready(self) -> bool:
        """Whether every node sees the cluster as ok with all slots assigned."""
        for node in self.nodes:
            client = redis.Redis(port=node.port, socket_timeout=1.0)
            try:
                info = client.cluster("info")
            except redis.RedisError:
                return False
            finally:
                client.close()
            if not isinstance(info, dict):
                return False
            if info.get("cluster_state") != "ok" or int(info.get("cluster_slots_ok", 0)) != 16384:
                return False
            if int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                return False
        return True

    def close(self) -> None:
        """Stop every node and remove their working directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
