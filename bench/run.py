"""One run: a workload sent to one target, bracketed by two reads of the engine's timeline."""

from __future__ import annotations

import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gapless.bench.fairness import tenant_report
from gapless.bench.loadgen import LoadSpec, run_load
from gapless.bench.metrics import samples, summarize
from gapless.bench.targets import Target
from gapless.bench.timeline import (
    MAX_STEPS,
    fetch_timeline,
    last_seq,
    num_replicas,
    replicas_summary,
    run_steps,
    window_of,
)
from gapless.bench.workloads import Workload

TIMELINE_WINDOW = 40  # steps kept in the JSON for the timeline figure
# counters of /metrics a run reports the growth of, by their labels: each tensor-parallel
# rank's device time, and the requests each engine replica was sent and why
COUNTERS = {
    "gapless_rank_device_busy_seconds_total": ("replica", "rank"),
    "gapless_routed_requests_total": ("replica", "reason"),
}


async def engine_counters(base_url: str, api_key: str | None) -> dict[tuple[str, str], float]:
    """(series, its labels joined by "/") -> value of COUNTERS on /metrics; empty when the
    target has none or the key may not read them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as c:
            resp = await c.get("/metrics")
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out: dict[tuple[str, str], float] = {}
    try:
        families = list(text_string_to_metric_families(resp.text))
    except ValueError:
        return {}
    for family in families:
        for sample in family.samples:
            labels = COUNTERS.get(sample.name)
            if labels is not None:
                key = "/".join(sample.labels.get(label, "") for label in labels)
                out[(sample.name, key)] = out.get((sample.name, key), 0.0) + sample.value
    return out


def counter_deltas(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, Any]:
    """`rank_device_busy_s` ("replica/rank" -> device s) and `routed_requests`
    ("replica/reason" -> requests) over the run; None when the target has neither."""
    grown: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
    for (name, key), value in sorted(after.items()):
        grown[name][key] = value - before.get((name, key), 0.0)
    ranks = grown["gapless_rank_device_busy_seconds_total"]
    routed = grown["gapless_routed_requests_total"]
    return {
        "rank_device_busy_s": ranks or None,
        "routed_requests": {k: int(v) for k, v in routed.items()} or None,
    }


async def bench_target(
    target: Target, model: str, workload: Workload, spec: LoadSpec
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's JSON object and the engine steps that ran during it (empty without a
    timeline)."""
    url, key = target.base_url, target.api_key
    first = await fetch_timeline(url, key, last=1)
    replicas = range(num_replicas(first))
    before = [first] + [await fetch_timeline(url, key, 1, replica=k) for k in replicas[1:]]
    counted = await engine_counters(url, key)
    label = f"{target.name} {workload.name}"
    load = await run_load(url, key, model, workload, spec, label)
    after = [await fetch_timeline(url, key, MAX_STEPS, replica=k) for k in replicas]
    steps = run_steps(after[0], last_seq(before[0]))
    timeline = replicas_summary(before, after)
    timeline.update(counter_deltas(counted, await engine_counters(url, key)))
    if timeline["timeline"] is not None:
        timeline["timeline"]["window_steps"] = window_of(steps, TIMELINE_WINDOW)
    run = {
        "target": target.name,
        "base_url": target.base_url,
        "model": model,
        "workload": workload.name,
        "mean_prompt_tokens": workload.mean_prompt_len,
        "mean_max_tokens": workload.mean_output_len,
        "request_rate": None if math.isinf(spec.request_rate) else spec.request_rate,
        "max_concurrency": spec.max_concurrency,
        "ignore_eos": spec.ignore_eos,
        "seed": spec.seed,
        **summarize(load.records, load.duration_s),
        **timeline,
        "samples": samples(load.records),
    }
    if workload.tenants:
        run.update(tenant_report(load.records, load.t0, workload.tenants))
    return run, steps
