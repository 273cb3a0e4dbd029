"""One run: a workload sent to one target, bracketed by two reads of the engine's timeline."""

from __future__ import annotations

import math
from typing import Any

from gapless.bench.fairness import tenant_report
from gapless.bench.loadgen import LoadSpec, run_load
from gapless.bench.metrics import samples, summarize
from gapless.bench.targets import Target
from gapless.bench.timeline import (
    MAX_STEPS,
    fetch_timeline,
    last_seq,
    run_steps,
    timeline_summary,
    window_of,
)
from gapless.bench.workloads import Workload

TIMELINE_WINDOW = 40  # steps kept in the JSON for the timeline figure


async def bench_target(
    target: Target, model: str, workload: Workload, spec: LoadSpec
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's JSON object and the engine steps that ran during it (empty without a
    timeline)."""
    before = await fetch_timeline(target.base_url, target.api_key, last=1)
    label = f"{target.name} {workload.name}"
    load = await run_load(target.base_url, target.api_key, model, workload, spec, label)
    after = await fetch_timeline(target.base_url, target.api_key, last=MAX_STEPS)
    steps = run_steps(after, last_seq(before))
    timeline = timeline_summary(before, after)
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
