"""The Helm chart, rendered with Helm's own engine across a matrix of values.

Every rendered object is validated against the Kubernetes schemas (built-in kinds) or
checked for the structure the Prometheus operator needs (its CRDs), the chart lints
clean, and each test asserts what an operator installing it would notice.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from engine_worker.profiles import load_profile
from tests.helm.release import CHART, NAMESPACE, RELEASE, Release, container, env_of, render

KUBE_VERSION = "1.30.0"
FULL = f"{RELEASE}-kvrouter"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
SECRET_ENV = {
    "KVROUTER_INTERNAL_TOKEN",
    "KVWORKER_INTERNAL_TOKEN",
    "KVROUTER_API_KEYS",
    "REDIS_PASSWORD",
    "REDISCLI_AUTH",
}

MONITORING_ON: dict[str, Any] = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "dashboards": {"enabled": True, "annotations": {"grafana_folder": "kvrouter"}},
    "prometheusRule": {"enabled": True},
    "alerts": {"ttftP90SloSeconds": 3.5, "redisMemoryRatio": 0.8},
}

MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis": {
        "redis": {
            "bundled": {"enabled": False},
            "external": {
                "url": "redis://redis.data.svc:6379/0",
                "passwordSecret": {"name": "redis-auth", "key": "password"},
            },
        },
    },
    "redis-cluster": {
        "redis": {
            "bundled": {"enabled": False},
            "external": {
                "url": "rediss://redis-cluster-0.redis-cluster.data.svc:6379",
                "username": "kvrouter",
                "passwordSecret": {"name": "redis-cluster-auth", "key": "redis-password"},
            },
        },
    },
    "pd-roles": {
        "workers": {
            "pools": [
                {"name": "prefill", "role": "prefill", "replicas": 2, "gpu": 2},
                {
                    "name": "decode",
                    "role": "decode",
                    "replicas": 3,
                    "tiers": {"ssdBlocks": 65536},
                    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                },
            ],
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
        },
    },
    "monitoring-on": {
        "monitoring": MONITORING_ON,
        "redis": {"bundled": {"metrics": {"enabled": True}, "maxmemory": "2gb"}},
        "networkPolicy": {
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ]
        },
        "workers": {"metricsRequireToken": True},
    },
    "sim-runner": {
        "workers": {
            "runner": "sim",
            "profile": "llama3_8b_h100",
            "timeScale": 0.5,
            "pools": [{"name": "sim", "role": "both", "replicas": 4}],
            "tiers": {"ssdBlocks": 4096},
        },
        "gateway": {"autoscaling": {"enabled": True, "maxReplicas": 6}, "pd": "auto"},
        "auth": {"apiKeys": ["sk-team-a-0123456789", "sk-team-b-9876543210"]},
        "redis": {"bundled": {"auth": False, "persistence": {"enabled": True}}},
    },
}


@pytest.fixture(scope="module", params=sorted(MATRIX))
def case(request: pytest.FixtureRequest) -> tuple[str, Release]:
    """(case name, its rendered release) for each row of the matrix."""
    name: str = request.param
    return name, render(MATRIX[name])


def _nulls(node: Any, path: str = "") -> list[str]:
    """Paths of null values: a key whose template block rendered nothing."""
    if node is None:
        return [path]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _nulls(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _nulls(v, f"{path}[{i}]")]
    return []


def _labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pods_selected(release: Release, selector: Mapping[str, str]) -> list[str]:
    """Names of the workloads whose pods ``selector`` (matchLabels) selects."""
    return [
        w["metadata"]["name"]
        for w, pod in release.pod_templates()
        if _labels_match(selector, pod["metadata"]["labels"])
    ]


def _port_names(release: Release, workload: str) -> set[str]:
    w = next(w for w, _ in release.pod_templates() if w["metadata"]["name"] == workload)
    return {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}


# -- every case: valid objects, clean lint ----------------------------------------------------


def test_every_manifest_is_valid_for_kubernetes(case: tuple[str, Release]) -> None:
    """Built-in kinds pass the Kubernetes 1.30 schemas (strict: no unknown fields);
    the operator's kinds have their required structure and select this release's pods."""
    _, release = case
    kinds = {o["kind"] for o in release.objects}
    assert {"Deployment", "StatefulSet", "Service", "Secret"} <= kinds
    for obj in release.objects:
        assert _nulls(obj) == [], f"{obj['kind']} {obj['metadata']['name']}: empty keys"
        if obj["kind"] in CRD_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["metadata"]["name"]
            assert isinstance(obj["spec"], dict)
            assert obj["spec"]
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")


def test_the_chart_lints_clean(case: tuple[str, Release]) -> None:
    """helm lint (strict, for Kubernetes 1.30) reports no warning and no error."""
    name, _ = case
    report = helm_python.lint(
        CHART, MATRIX[name], strict=True, kube_version=f"v{KUBE_VERSION}", namespace=NAMESPACE
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_no_secret_is_rendered_in_plain_text(case: tuple[str, Release]) -> None:
    """Generated and given secrets live only base64-encoded in Secrets; every container
    reads them through secretKeyRef, and no ConfigMap carries one."""
    _, release = case
    secrets: list[str] = []
    for s in release.of_kind("Secret"):
        secrets += [base64.b64decode(v).decode() for v in s["data"].values()]
    secrets += [k for keys in secrets if keys.startswith("[") for k in json.loads(keys)]
    assert secrets
    plain = [o for o in release.objects if o["kind"] != "Secret"]
    text = repr(plain)
    for secret in secrets:
        assert secret not in text
    for _, pod in release.pod_templates():
        for c in pod["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"] in SECRET_ENV:
                    assert "secretKeyRef" in e.get("valueFrom", {}) or e["value"].startswith("$(")
    for cm in release.of_kind("ConfigMap"):
        assert not any(s in v for v in cm["data"].values() for s in secrets)


def test_every_workload_runs_unprivileged_and_probed(case: tuple[str, Release]) -> None:
    """No pod mounts an API token or runs as root; every kvrouter container is probed."""
    _, release = case
    for workload, pod in release.pod_templates():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "livenessProbe" in c, f"{workload['metadata']['name']}/{c['name']}"


# -- gateway -------------------------------------------------------------------------------------


def test_the_gateway_drains_its_streams_before_it_is_killed() -> None:
    """terminationGracePeriodSeconds exceeds unready grace + drain; readiness is /ready,
    liveness /health; it binds all interfaces; a PDB keeps replicas up during node drains."""
    values = {"gateway": {"drainSeconds": 120.5, "unreadyGraceSeconds": 7}}
    release = render(values)
    gw = release.get("Deployment", f"{FULL}-gateway")
    pod = gw["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 7 + 120.5
    c = container(gw)
    env = env_of(c)
    assert env["KVROUTER_DRAIN_S"]["value"] == "120.5"
    assert env["KVROUTER_UNREADY_GRACE_S"]["value"] == "7"
    assert env["KVROUTER_BIND"]["value"] == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gw["spec"]["replicas"] == 2
    pdb = release.get("PodDisruptionBudget", f"{FULL}-gateway")
    assert _pods_selected(release, pdb["spec"]["selector"]["matchLabels"]) == [f"{FULL}-gateway"]
    default = release.get("Deployment", f"{FULL}-gateway")
    assert default["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 5 + 30


def test_autoscaling_owns_the_gateway_replicas() -> None:
    """With an HPA the Deployment leaves replicas to it (no fight on every upgrade)."""
    release = render(MATRIX["sim-runner"])
    gw = release.get("Deployment", f"{FULL}-gateway")
    assert "replicas" not in gw["spec"]
    hpa = release.get("HorizontalPodAutoscaler", f"{FULL}-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULL}-gateway"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert not render().of_kind("HorizontalPodAutoscaler")


# -- workers ------------------------------------------------------------------------------------


def test_default_workers_are_one_colocated_pool_on_gpus() -> None:
    """Defaults: one StatefulSet of role both, 1 GPU each on cuda, advertising its pod DNS
    name, and the gateway allowed to dial exactly those pods."""
    release = render()
    names = sorted(s["metadata"]["name"] for s in release.of_kind("StatefulSet"))
    assert names == [f"{FULL}-redis", f"{FULL}-worker"]
    sts = release.get("StatefulSet", f"{FULL}-worker")
    c = container(sts)
    env = env_of(c)
    assert env["KVWORKER_ROLE"]["value"] == "both"
    assert env["KVWORKER_RUNNER"]["value"] == "torch"
    assert env["KVWORKER_DEVICE"]["value"] == "cuda"
    assert env["KVWORKER_NAME"]["value"] == "$(POD_NAME)"
    assert env["KVWORKER_KV_PORT"]["value"] == "8101"
    host = f"$(POD_NAME).{FULL}-worker.{NAMESPACE}.svc.cluster.local"
    assert env["KVWORKER_ADVERTISE_URL"]["value"] == f"http://{host}:8100"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    svc = release.get("Service", f"{FULL}-worker")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "kv"}
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    gw = env_of(container(release.get("Deployment", f"{FULL}-gateway")))
    assert gw["KVROUTER_PD"]["value"] == "never"
    allowed = json.loads(gw["KVROUTER_ALLOWED_WORKERS"]["value"])
    assert allowed == [
        f"{FULL}-worker-{i}.{FULL}-worker.{NAMESPACE}.svc.cluster.local" for i in range(2)
    ]
    assert "volumeClaimTemplates" not in sts["spec"]
    assert "KVWORKER_SSD_PATH" not in env


def test_pd_roles_get_a_statefulset_each_and_the_gateway_splits() -> None:
    """prefill + decode pools: one StatefulSet per role with the right KVWORKER_ROLE and
    replicas, pool overrides applied (GPUs, node selector, SSD), and pd=always."""
    release = render(MATRIX["pd-roles"])
    prefill = release.get("StatefulSet", f"{FULL}-prefill")
    decode = release.get("StatefulSet", f"{FULL}-decode")
    assert env_of(container(prefill))["KVWORKER_ROLE"]["value"] == "prefill"
    assert env_of(container(decode))["KVWORKER_ROLE"]["value"] == "decode"
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    assert container(prefill)["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert container(decode)["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert prefill["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    assert decode["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H200"
    }
    assert decode["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "volumeClaimTemplates" not in prefill["spec"]
    assert len(decode["spec"]["volumeClaimTemplates"]) == 1
    roles = {s["metadata"]["labels"].get("kvrouter.io/role") for s in release.of_kind("Service")}
    assert {"prefill", "decode"} <= roles
    gw = env_of(container(release.get("Deployment", f"{FULL}-gateway")))
    assert gw["KVROUTER_PD"]["value"] == "always"
    assert len(json.loads(gw["KVROUTER_ALLOWED_WORKERS"]["value"])) == 5


def test_the_ssd_tier_gets_a_volume_only_when_it_is_on() -> None:
    """ssdBlocks > 0: a PVC per pod mounted above KVWORKER_SSD_PATH (the worker creates
    its private directory inside); 0: no PVC, no path."""
    on = render({"workers": {"tiers": {"ssdBlocks": 1_000_000}, "ssdVolume": {"size": "2Ti"}}})
    sts = on.get("StatefulSet", f"{FULL}-worker")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Ti"
    env = env_of(container(sts))
    assert env["KVWORKER_SSD_BLOCKS"]["value"] == "1000000"
    mount = next(
        m for m in container(sts)["volumeMounts"] if m["name"] == claim["metadata"]["name"]
    )
    assert env["KVWORKER_SSD_PATH"]["value"].startswith(mount["mountPath"] + "/")
    off = render().get("StatefulSet", f"{FULL}-worker")
    assert "volumeClaimTemplates" not in off["spec"]
    assert env_of(container(off))["KVWORKER_SSD_BLOCKS"]["value"] == "0"


def test_the_sim_runner_needs_no_gpu() -> None:
    """runner=sim: no GPU resource (even with workers.gpu set), cpu device, its profile."""
    release = render(MATRIX["sim-runner"])
    sts = release.get("StatefulSet", f"{FULL}-sim")
    c = container(sts)
    env = env_of(c)
    assert env["KVWORKER_RUNNER"]["value"] == "sim"
    assert env["KVWORKER_DEVICE"]["value"] == "cpu"
    assert env["KVWORKER_PROFILE"]["value"] == "llama3_8b_h100"
    assert env["KVWORKER_TIME_SCALE"]["value"] == "0.5"
    assert "nvidia.com/gpu" not in str(c.get("resources", {}))
    assert sts["spec"]["replicas"] == 4
    torch_no_gpu = container(render({"workers": {"gpu": 0}}).get("StatefulSet", f"{FULL}-worker"))
    assert "resources" not in torch_no_gpu
    assert env_of(torch_no_gpu)["KVWORKER_DEVICE"]["value"] == "cpu"


def test_a_pool_may_run_its_own_timing_profile() -> None:
    """A mixed sim fleet: the pool that sets a profile runs it, the other keeps the shared
    one; torch workers get none (they fit theirs from measured steps)."""
    pools = [
        {"name": "h100", "role": "both", "replicas": 2},
        {"name": "a100", "role": "both", "replicas": 2, "profile": "llama3_8b_a100"},
    ]
    sim = {"runner": "sim", "profile": "llama3_8b_h100", "pools": pools}
    release = render({"workers": sim})
    profiles = {
        pool["name"]: env_of(container(release.get("StatefulSet", f"{FULL}-{pool['name']}")))[
            "KVWORKER_PROFILE"
        ]["value"]
        for pool in pools
    }
    assert profiles == {"h100": "llama3_8b_h100", "a100": "llama3_8b_a100"}
    for name in ("h100", "a100"):
        assert load_profile(profiles[name]).name == f"llama3_8b_{name}"
    torch = render({"workers": {"pools": pools}})
    a100 = env_of(container(torch.get("StatefulSet", f"{FULL}-a100")))
    assert "KVWORKER_PROFILE" not in a100


# -- network ------------------------------------------------------------------------------------


def test_only_the_gateway_and_peers_reach_workers_and_redis() -> None:
    """The workers' NetworkPolicy selects every worker pod and admits exactly the
    release's gateway, indexer and worker pods on the HTTP and KV ports; Redis likewise."""
    release = render(MATRIX["pd-roles"])
    policy = release.get("NetworkPolicy", f"{FULL}-worker")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    selected = _pods_selected(release, spec["podSelector"]["matchLabels"])
    assert sorted(selected) == [f"{FULL}-decode", f"{FULL}-prefill"]
    (rule,) = spec["ingress"]
    admitted = sorted(
        w
        for peer in rule["from"]
        for w in _pods_selected(release, peer["podSelector"]["matchLabels"])
    )
    assert admitted == sorted(
        [f"{FULL}-gateway", f"{FULL}-indexer", f"{FULL}-decode", f"{FULL}-prefill"]
    )
    assert all(set(peer) == {"podSelector"} for peer in rule["from"])
    assert {p["port"] for p in rule["ports"]} == {"http", "kv"}
    for w in selected:
        assert {"http", "kv"} <= _port_names(release, w)
    redis = release.get("NetworkPolicy", f"{FULL}-redis")["spec"]
    assert _pods_selected(release, redis["podSelector"]["matchLabels"]) == [f"{FULL}-redis"]
    (redis_rule,) = redis["ingress"]
    assert redis_rule["from"] == rule["from"]
    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")


def test_metrics_scrapers_may_reach_only_the_metrics_ports() -> None:
    """networkPolicy.metricsFrom opens the workers' HTTP port and the exporter's, not KV."""
    release = render(MATRIX["monitoring-on"])
    rules = release.get("NetworkPolicy", f"{FULL}-worker")["spec"]["ingress"]
    scrape = rules[1]
    assert scrape["from"] == MATRIX["monitoring-on"]["networkPolicy"]["metricsFrom"]
    assert [p["port"] for p in scrape["ports"]] == ["http"]
    redis_rules = release.get("NetworkPolicy", f"{FULL}-redis")["spec"]["ingress"]
    assert [p["port"] for p in redis_rules[1]["ports"]] == ["metrics"]


# -- Redis ----------------------------------------------------------------------------------------


def test_bundled_redis_keeps_its_password_off_command_lines() -> None:
    """Defaults: one Redis StatefulSet; its password from the chart's Secret reaches
    redis-server through a file and every client through $(REDIS_PASSWORD) in the URL."""
    release = render()
    redis = release.get("StatefulSet", f"{FULL}-redis")
    c = container(redis, "redis")
    assert c["image"] == "docker.io/library/redis:7-alpine"
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    assert "requirepass" in c["args"][0]
    assert "--requirepass" not in c["args"][0]
    url = f"redis://:$(REDIS_PASSWORD)@{FULL}-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    for name, prefix in (("gateway", "KVROUTER_"), ("indexer", "KVINDEX_")):
        env = env_of(container(release.get("Deployment", f"{FULL}-{name}")))
        assert env[f"{prefix}REDIS_URL"]["value"] == url
        assert list(env).index("REDIS_PASSWORD") < list(env).index(f"{prefix}REDIS_URL")
    worker_env = env_of(container(release.get("StatefulSet", f"{FULL}-worker")))
    assert worker_env["KVWORKER_REDIS_URL"]["value"] == url
    secret = release.get("Secret", FULL)
    assert {"redis-password", "internal-token", "api-keys"} == set(secret["data"])


@pytest.mark.parametrize("name", ["external-redis", "redis-cluster"])
def test_external_redis_renders_no_redis_and_reads_its_password_secret(name: str) -> None:
    """External Redis (single node or Cluster): no Redis objects; every component's URL
    is the given one with the password expanded from the given Secret."""
    release = render(MATRIX[name])
    external = MATRIX[name]["redis"]["external"]
    assert not [o for o in release.objects if o["metadata"]["name"].endswith("-redis")]
    scheme, rest = external["url"].split("://")
    user = external.get("username", "")
    expected = f"{scheme}://{user}:$(REDIS_PASSWORD)@{rest}"
    components = (
        ("Deployment", "gateway", "KVROUTER_"),
        ("Deployment", "indexer", "KVINDEX_"),
        ("StatefulSet", "worker", "KVWORKER_"),
    )
    for kind, component, prefix in components:
        env = env_of(container(release.get(kind, f"{FULL}-{component}")))
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == external["passwordSecret"]
        assert env[f"{prefix}REDIS_URL"]["value"] == expected
    assert "redis-password" not in release.get("Secret", FULL)["data"]


def test_external_redis_without_a_url_is_refused() -> None:
    """Turning the bundled Redis off without naming another one fails with the reason."""
    with pytest.raises(helm_python.HelmError, match=r"redis\.external\.url is required"):
        render({"redis": {"bundled": {"enabled": False}}})


# -- secrets ------------------------------------------------------------------------------------


def test_secrets_are_generated_when_not_given() -> None:
    """No values: an internal token and an API key are generated (new ones on a fresh
    install); given values are used as they are; an existing Secret replaces the chart's."""
    first, second = render().get("Secret", FULL), render().get("Secret", FULL)
    for key in ("internal-token", "api-keys", "redis-password"):
        assert first["data"][key] != second["data"][key]
    token = base64.b64decode(first["data"]["internal-token"]).decode()
    assert len(token) >= 32
    given = render(
        {"auth": {"internalToken": "t" * 40, "apiKeys": ["sk-one-12345", "sk-two-12345"]}}
    )
    data = given.get("Secret", FULL)["data"]
    assert base64.b64decode(data["internal-token"]).decode() == "t" * 40
    assert json.loads(base64.b64decode(data["api-keys"])) == ["sk-one-12345", "sk-two-12345"]
    existing = render({"auth": {"existingSecret": "my-keys"}})
    assert set(existing.get("Secret", FULL)["data"]) == {"redis-password"}
    gw = env_of(container(existing.get("Deployment", f"{FULL}-gateway")))
    assert gw["KVROUTER_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "my-keys"
    assert gw["KVROUTER_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-keys"
    assert "lookup" in (CHART / "templates" / "secret.yaml").read_text()


def test_an_open_gateway_has_no_api_keys() -> None:
    """generateApiKey=false without keys: no key is required (and NOTES says so)."""
    release = render({"auth": {"generateApiKey": False}})
    assert "KVROUTER_API_KEYS" not in env_of(
        container(release.get("Deployment", f"{FULL}-gateway"))
    )
    assert "api-keys" not in release.get("Secret", FULL)["data"]
    assert "no API key is required" in release.notes


# -- monitoring ----------------------------------------------------------------------------------


def _chart_with_monitoring_files(tmp: Path) -> Path:
    """The chart, or a temporary copy with fixture dashboards/rules if they are missing."""
    if (
        list((CHART / "dashboards").glob("*.json"))
        and (CHART / "rules" / "kvrouter-alerts.yaml").is_file()
    ):
        return CHART
    copy = tmp / "kvrouter"
    shutil.copytree(CHART, copy)
    (copy / "dashboards").mkdir(exist_ok=True)
    (copy / "dashboards" / "fixture.json").write_text('{"title": "fixture", "panels": []}\n')
    (copy / "rules").mkdir(exist_ok=True)
    (copy / "rules" / "kvrouter-alerts.yaml").write_text(
        "groups:\n  - name: kvrouter\n    rules:\n      - alert: TtftSlo\n"
        "        expr: kvrouter_ttft_p90 > __TTFT_P90_SLO_SECONDS__\n"
        "      - alert: RedisMemory\n        expr: redis_ratio > __REDIS_MEMORY_RATIO__\n"
    )
    return copy


def test_monitoring_objects_select_the_release(tmp_path: Path) -> None:
    """Monitoring on: ServiceMonitors select the gateway and indexer Services by a port
    they have, a PodMonitor the workers (with the token when /metrics needs it), one
    dashboard ConfigMap per file for Grafana's sidecar, and the alerts with thresholds."""
    chart = _chart_with_monitoring_files(tmp_path)
    release = render(MATRIX["monitoring-on"], chart)
    for component in ("gateway", "indexer"):
        sm = release.get("ServiceMonitor", f"{FULL}-{component}")
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        svc = release.get("Service", f"{FULL}-{component}")
        assert _labels_match(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        matched = [
            s
            for s in release.of_kind("Service")
            if _labels_match(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert matched == [svc]
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
    pm = release.get("PodMonitor", f"{FULL}-worker")
    assert _pods_selected(release, pm["spec"]["selector"]["matchLabels"]) == [f"{FULL}-worker"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in _port_names(release, f"{FULL}-worker")
    assert endpoint["authorization"]["credentials"] == {"name": FULL, "key": "internal-token"}
    redis_pm = release.get("PodMonitor", f"{FULL}-redis")
    assert redis_pm["spec"]["podMetricsEndpoints"][0]["port"] in _port_names(
        release, f"{FULL}-redis"
    )

    files = sorted(p.name for p in (chart / "dashboards").glob("*.json"))
    dashboards = release.of_kind("ConfigMap")
    assert sorted(k for cm in dashboards for k in cm["data"]) == files
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "kvrouter"}
        (content,) = cm["data"].values()
        assert (
            content.strip() == (chart / "dashboards" / next(iter(cm["data"]))).read_text().strip()
        )

    (rule,) = release.of_kind("PrometheusRule")
    groups = rule["spec"]["groups"]
    assert groups
    assert all(g["rules"] for g in groups)
    exprs = " ".join(str(r["expr"]) for g in groups for r in g["rules"])
    assert "__" not in exprs.replace("__name__", "")
    assert re.search(r">\s*3\.5\b", exprs)
    assert re.search(r">\s*0\.8\b", exprs)
    assert "Dashboards" in release.notes
    assert "grafana_dashboard=1" in release.notes


def test_monitoring_renders_nothing_without_its_files(tmp_path: Path) -> None:
    """A chart copy without dashboards/ and rules/ still renders with monitoring on."""
    copy = tmp_path / "kvrouter"
    shutil.copytree(CHART, copy, ignore=shutil.ignore_patterns("dashboards", "rules"))
    release = render({"monitoring": MONITORING_ON}, copy)
    assert not release.of_kind("ConfigMap")
    assert not release.of_kind("PrometheusRule")
    assert release.of_kind("ServiceMonitor")


def test_monitoring_is_off_by_default() -> None:
    """Without the Prometheus operator's CRDs installed, the defaults still apply."""
    kinds = {o["kind"] for o in render().objects}
    assert not kinds & (CRD_KINDS | {"ConfigMap"})


# -- notes --------------------------------------------------------------------------------------


def test_notes_say_how_to_reach_the_gateway() -> None:
    """NOTES.txt: a port-forward to the gateway Service, how to read the API key, a curl."""
    notes = render().notes
    assert f"port-forward service/{FULL}-gateway 8000:8000" in notes
    assert f"get secret {FULL} -o jsonpath='{{.data.api-keys}}'" in notes
    assert "curl -s http://127.0.0.1:8000/v1/models" in notes
    assert "Set monitoring.dashboards.enabled=true" in notes


def test_duplicate_pool_names_are_refused() -> None:
    """Two pools with one name would overwrite each other's StatefulSet: refused."""
    pools = [
        {"name": "a", "role": "prefill", "replicas": 1},
        {"name": "a", "role": "decode", "replicas": 1},
    ]
    with pytest.raises(helm_python.HelmError, match='the pool name "a" is used twice'):
        render({"workers": {"pools": pools}})
