"""/metrics by LoRA adapter: requests running and waiting and tokens, by tenant and adapter;
the info gauge inference gateways read (vLLM's lora_requests_info labels), made at each
scrape from what the reader may see, so a tenant's key reads only its own adapters; labels
stay bounded however many adapters come and go."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gapless.common.messages import AddRequest, SamplingParams
from gapless.common.metrics import render
from gapless.core.lora_metrics import MAX_ADAPTER_LABELS, LoraMetrics
from tests.core.test_scheduler import fake_result, make_scheduler


def _add(s, rid: str, tenant: str, lora: str):
    return s.add_request(AddRequest(request_id=rid, frontend_id=0, tenant=tenant, lora=lora,
                                    prompt_token_ids=[100 + len(s.requests), 11, 12, 13],
                                    params=SamplingParams(max_tokens=4),
                                    arrival_time=time.time()))  # fmt: skip


def _samples(registry, tenant=None) -> dict[str, list]:
    text = render(registry, "tiny", tenant).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples, **labels) -> float:
    (value,) = [s.value for s in samples if labels.items() <= s.labels.items()]
    return value


def test_series_by_tenant_and_adapter_and_the_info_gauge():
    s = make_scheduler(max_loras=1, lora_ready=("sql", "fr"))
    registry = CollectorRegistry()
    metrics = LoraMetrics(registry, 1, lambda tenant: tenant)
    sql = _add(s, "a0", "acme", "sql")
    _add(s, "b0", "beta", "fr")
    _add(s, "base", "beta", "")
    step = s.schedule()
    metrics.observe(s)
    seen = _samples(registry)
    running, waiting = seen["gapless_lora_requests_running"], seen["gapless_lora_requests_waiting"]
    assert _value(running, tenant="acme", adapter="sql") == 1
    assert _value(waiting, tenant="beta", adapter="fr") == 1
    assert all(s.labels["adapter"] in ("sql", "fr") for s in running + waiting)
    (info,) = seen["gapless_lora_requests_info"]
    assert info.labels == {"running_lora_adapters": "sql", "waiting_lora_adapters": "fr",
                           "max_lora": "1", "model_name": "tiny"}  # fmt: skip
    assert abs(info.value - time.time()) < 60
    # a tenant reads its own adapters only, in the series and in the info gauge
    beta = _samples(registry, "beta")
    for name in ("gapless_lora_requests_waiting", "gapless_lora_requests_running"):
        assert {s.labels["tenant"] for s in beta[name]} == {"beta"}
    (info,) = beta["gapless_lora_requests_info"]
    assert (info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == (
        "",
        "fr",
    )
    s.update_from_output(step, fake_result(step))
    s.finish(sql, "abort")
    metrics.observe(s)
    seen = _samples(registry)
    tokens = seen["gapless_lora_tokens"]
    assert _value(tokens, tenant="acme", adapter="sql", kind="prompt") == 4
    assert _value(tokens, tenant="acme", adapter="sql", kind="output") == 1
    assert _value(seen["gapless_lora_requests_running"], tenant="acme", adapter="sql") == 0


def test_adapter_labels_are_bounded():
    s = make_scheduler(max_loras=1, max_num_seqs=1, num_blocks=512)
    registry = CollectorRegistry()
    metrics = LoraMetrics(registry, 1, lambda tenant: tenant)
    for i in range(MAX_ADAPTER_LABELS + 10):
        _add(s, f"r{i}", "t", f"adapter-{i}")
    s.schedule()  # each is held: none is read
    metrics.observe(s)
    waiting = _samples(registry)["gapless_lora_requests_waiting"]
    assert len(waiting) == MAX_ADAPTER_LABELS + 1
    assert _value(waiting, adapter="other") == 10
