"""deploy/helm/gapless renders (Helm v4's Go SDK, through the PyPI package helm-python-sdk) for
the cpu and the GPU values; its core objects validate offline against Kubernetes 1.34's schemas
(kubernetes-validate); the InferencePool, HTTPRoute and PodMonitor use only fields of their
published API references, written out below; the endpoint picker reads gapless's metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "gapless"
KUBERNETES = "1.34.0"
CORE = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}

# The fields each API reference defines (a dict: an object's fields; [x]: a list of x; None: a
# value). InferencePool: Gateway API inference extension v1 (inference.networking.k8s.io/v1,
# api/v1/inferencepool_types.go). HTTPRoute: Gateway API v1.3 (gateway.networking.k8s.io/v1).
# PodMonitor: Prometheus Operator v0.86 (monitoring.coreos.com/v1), the fields used here and
# their siblings.
LABEL_SELECTOR = {"matchLabels": None, "matchExpressions": None}
METADATA = {"name": None, "namespace": None, "labels": None, "annotations": None}
INFERENCE_POOL = {
    "apiVersion": None, "kind": None, "metadata": METADATA,
    "spec": {
        "selector": {"matchLabels": None},
        "targetPorts": [{"number": None}],
        "endpointPickerRef": {
            "group": None, "kind": None, "name": None, "port": {"number": None},
            "failureMode": None,
        },
    },
}  # fmt: skip
PARENT_REF = {"group": None, "kind": None, "namespace": None, "name": None, "sectionName": None,
              "port": None}  # fmt: skip
HTTP_ROUTE = {
    "apiVersion": None, "kind": None, "metadata": METADATA,
    "spec": {
        "parentRefs": [PARENT_REF],
        "hostnames": None,
        "rules": [{
            "name": None,
            "matches": [{"path": {"type": None, "value": None}, "headers": None,
                         "queryParams": None, "method": None}],
            "filters": None,
            "backendRefs": [{"group": None, "kind": None, "name": None, "namespace": None,
                             "port": None, "weight": None, "filters": None}],
            "timeouts": None, "retry": None, "sessionPersistence": None,
        }],
    },
}  # fmt: skip
POD_MONITOR = {
    "apiVersion": None, "kind": None, "metadata": METADATA,
    "spec": {
        "jobLabel": None, "podTargetLabels": None, "selector": LABEL_SELECTOR,
        "namespaceSelector": None, "sampleLimit": None, "scrapeProtocols": None,
        "podMetricsEndpoints": [{
            "port": None, "portNumber": None, "path": None, "scheme": None, "params": None,
            "interval": None, "scrapeTimeout": None, "honorLabels": None,
            "honorTimestamps": None, "relabelings": None, "metricRelabelings": None,
            "enableHttp2": None, "followRedirects": None, "filterRunning": None,
        }],
    },
}  # fmt: skip
REFERENCES = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
}
REQUIRED = {
    "InferencePool": ["selector", "targetPorts", "endpointPickerRef"],
    "HTTPRoute": [],
    "PodMonitor": ["selector"],
}


def unknown_fields(obj: Any, ref: Any, at: str = "") -> list[str]:
    """Paths in obj that its reference does not define."""
    if ref is None:
        return []
    if isinstance(ref, list):
        assert isinstance(obj, list), at
        return [p for i, x in enumerate(obj) for p in unknown_fields(x, ref[0], f"{at}[{i}]")]
    assert isinstance(obj, dict), at
    out = []
    for key, value in obj.items():
        if key not in ref:
            out.append(f"{at}.{key}")
        else:
            out += unknown_fields(value, ref[key], f"{at}.{key}")
    return out


def render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="demo", namespace="llm")
    return [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]


def gpu_values() -> dict:
    return yaml.safe_load((CHART / "values-gpu.yaml").read_text())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    monitor = {"podMonitor": {"enabled": True, "requireCrd": False}}
    return {"cpu": render(monitor), "gpu": render({**gpu_values(), **monitor})}


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def test_the_chart_renders_every_object_for_cpu_and_gpu(rendered):
    for objects in rendered.values():
        kinds = sorted(o["kind"] for o in objects)
        assert kinds == sorted(["Deployment", "Deployment", "Service", "Service", "ServiceAccount",
                                "Role", "RoleBinding", "InferencePool", "HTTPRoute",
                                "PodMonitor"])  # fmt: skip
    assert not by_kind(render({"podMonitor": {"enabled": True}}), "PodMonitor"), (
        "no PodMonitor where the Prometheus Operator's CRDs are missing"
    )


def test_core_objects_validate_offline(rendered):
    for objects in rendered.values():
        for obj in objects:
            if obj["kind"] in CORE:
                kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_extension_objects_use_only_their_references_fields(rendered):
    for objects in rendered.values():
        for obj in objects:
            ref = REFERENCES.get((obj["apiVersion"], obj["kind"]))
            if ref is None:
                continue
            assert unknown_fields(obj, ref) == [], obj["kind"]
            for field in REQUIRED[obj["kind"]]:
                assert field in obj["spec"], (obj["kind"], field)
    (pool,) = by_kind(rendered["cpu"], "InferencePool")
    (route,) = by_kind(rendered["cpu"], "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    picker = pool["spec"]["endpointPickerRef"]
    services = {s["metadata"]["name"]: s for s in by_kind(rendered["cpu"], "Service")}
    ports = [p["port"] for p in services[picker["name"]]["spec"]["ports"]]
    assert picker["port"]["number"] in ports and pool["spec"]["targetPorts"] == [{"number": 8000}]


def test_the_endpoint_picker_reads_gaplesss_metrics(rendered):
    (picker,) = [
        d for d in by_kind(rendered["cpu"], "Deployment") if "epp" in d["metadata"]["name"]
    ]
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag, metric in [
        ("total-queued-requests-metric", "gapless_requests_waiting"),
        ("total-running-requests-metric", "gapless_requests_running"),
        ("kv-cache-usage-percentage-metric", "gapless_kv_cache_usage_ratio"),
        ("cache-info-metric", "gapless_cache_config_info"),
    ]:
        assert f"--{flag}={metric}" in args
        assert metric in (ROOT / "docs" / "fleets.md").read_text()


def test_servers_probe_drain_and_get_their_device(rendered):
    for device, objects in rendered.items():
        (server,) = [
            d for d in by_kind(objects, "Deployment") if "epp" not in d["metadata"]["name"]
        ]
        pod = server["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = c["args"]
        drain = float(args[args.index("--drain-timeout") + 1])
        assert pod["terminationGracePeriodSeconds"] > drain
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= (1200 if device == "gpu" else 600), "the startup probe waits for loading"
        assert args[args.index("--device") + 1] == {"cpu": "cpu", "gpu": "cuda"}[device]
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpus is not None) == (device == "gpu")
