"""Synthetic request records, engine steps and run documents for the bench's unit tests."""

from __future__ import annotations

from gapless.bench.client import RequestRecord
from gapless.bench.metrics import summarize
from gapless.bench.timeline import timeline_summary


def record(ttft, itl, output_tokens, ok=True, prompt_len=10):
    r = RequestRecord(prompt_len, output_tokens, ok=ok)
    if ok:
        r.ttft, r.itl, r.output_tokens = ttft, list(itl), output_tokens
        r.e2e = ttft + sum(itl)
    else:
        r.error = "HTTP 500: boom"
    return r


def step(seq, start, busy_ms, idle_ms, **extra):
    fields = dict(
        seq=seq, plan_sent=start - 0.002, plan_received=start - 0.0015, launched=start,
        device_start=start, device_end=start + busy_ms / 1000, published=start + busy_ms / 1000,
        result_applied=start + busy_ms / 1000 + 0.001, num_tokens=8, num_seqs=8,
        num_prefill_tokens=0, schedule_ms=1.0 + seq, prepare_ms=0.5, forward_ms=busy_ms,
        sample_ms=0.1, apply_ms=0.3, idle_before_ms=idle_ms, waiting=idle_ms > 0,
    )  # fmt: skip
    fields.update(extra)
    return fields


def run_doc(target, throughput, ttft):
    s = summarize([record(ttft, [0.01], 2)], 1.0)
    s["request_throughput"] = throughput
    return {
        "target": target, "workload": "8:2", "model": "m", **s, **timeline_summary(None, None)
    }  # fmt: skip
