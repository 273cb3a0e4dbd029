"""deploy/: the compose file starts gapless, Prometheus and Grafana wired together, and every
metric the Grafana dashboard queries is one a live `gapless serve` exports."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "gapless.json"


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(gapless_[a-z_]+)\b", expr))


def test_compose_wires_gapless_prometheus_and_grafana() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"gapless", "prometheus", "grafana"}
    assert (DEPLOY / services["gapless"]["build"]["context"] / "Dockerfile").exists()
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            assert (DEPLOY / volume.split(":")[0]).exists(), volume
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["gapless:8000"]
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/gapless.yml").read_text())
    mounted = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounted["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def test_every_dashboard_query_filters_by_model() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in _metric_names(target["expr"]):
                assert re.search(
                    name + r'(_bucket)?\{model_name=~"\$model_name"', target["expr"]
                ), (
                    panel["title"],
                    name,
                )


@pytest.mark.slow
def test_every_metric_the_dashboard_uses_is_exported(default_gguf) -> None:
    used = set().union(*map(_metric_names, _exprs(json.loads(DASHBOARD.read_text()))))
    assert len(used) >= 20
    s = Server(
        "--model", str(default_gguf), "--device", "sim", "--served-model-name", "sim",
        "--tenant-weight", "acme=2", "--max-num-seqs", "1",
    )  # fmt: skip
    try:
        body = {"model": "sim", "prompt": "hi", "max_tokens": 100, "ignore_eos": True}
        threads = [
            threading.Thread(target=httpx.post, args=(s.url + "/v1/completions",),
                             kwargs={"json": body, "timeout": 60})
            for _ in range(3)
        ]  # fmt: skip
        for t in threads:
            t.start()
        ratio = 0.0
        while ratio == 0.0 and any(t.is_alive() for t in threads):
            ratio = _value(httpx.get(s.url + "/metrics", timeout=10).text)
        for t in threads:
            t.join(60)
        httpx.post(s.url + "/v1/completions", json={"prompt": 5}, timeout=10)  # a 400
        text = httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        assert s.stop() == 0, s.read_log()
    exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(sample.labels)
    names = {n for n in exported} | {
        re.sub(r"_(bucket|sum|count|created)$", "", n) for n in exported
    }
    missing = {m for m in used if m not in names and m + "_bucket" not in names}
    assert not missing, f"the dashboard queries series the engine does not export: {missing}"
    assert all(labels.get("model_name") == "sim" for ls in exported.values() for labels in ls)
    assert 0 < ratio < 1, "the KV usage ratio rose while requests ran"
    assert _value(text) == 0.0


def _value(text: str, name: str = "gapless_kv_cache_usage_ratio") -> float:
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )
