"""The environment the chart renders is what the services' settings classes accept.

Each container's env is resolved as the kubelet would (secretKeyRef from the rendered
Secret, or a placeholder for a Secret the user owns; the downward API's pod name;
``$(VAR)`` expansion in order) and handed to ``RouterSettings``, ``IndexerSettings`` and
``WorkerSettings``: a value the process would refuse at start fails here.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any

import pytest

from engine_worker.settings import WorkerSettings
from indexer.ingest_service import IndexerSettings
from kvrouter.gateway.settings import RouterSettings
from tests.helm.release import Release, container, render
from tests.helm.test_chart import FULL, MATRIX

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _resolve(release: Release, workload: Mapping[str, Any]) -> dict[str, str]:
    """A container's environment as the kubelet would set it."""
    secrets = {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for s in release.of_kind("Secret")
    }
    env: dict[str, str] = {}
    for e in container(workload).get("env", []):
        if "value" in e:
            env[e["name"]] = _REF.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets.get(ref["name"], {}).get(ref["key"], "user-secret")
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[e["name"]] = f"{workload['metadata']['name']}-0"
    return env


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_every_process_accepts_the_environment_the_chart_gives_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gateway, indexer and every worker pool start with their rendered settings."""
    release = render(MATRIX[name])
    for workload, _ in release.pod_templates():
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "redis":
            continue
        env = _resolve(release, workload)
        for key in env:
            monkeypatch.setenv(key, env[key])
        if component == "gateway":
            gw = RouterSettings()
            assert gw.bind == "0.0.0.0"
            assert gw.redis_url == env["KVROUTER_REDIS_URL"]
            assert gw.internal_token is not None
            assert (
                gw.drain_s + gw.unready_grace_s
                < workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            )
            assert all(w.endswith(".svc.cluster.local") for w in gw.allowed_workers)
            if "KVROUTER_API_KEYS" in env:
                assert gw.api_keys
        elif component == "indexer":
            assert IndexerSettings().metrics_port == 8090
        else:
            worker = WorkerSettings()
            assert worker.worker_name == f"{workload['metadata']['name']}-0"
            assert worker.url.startswith(
                f"http://{worker.worker_name}.{workload['metadata']['name']}."
            )
            assert worker.internal_token is not None
            assert (
                worker.drain_s
                < workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            )
        for key in env:
            monkeypatch.delenv(key)
    assert release.get("Deployment", f"{FULL}-gateway")
