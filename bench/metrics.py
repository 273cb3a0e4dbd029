"""Latency percentiles and throughput of one run, from its request records."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from gapless.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and percentiles in ms of values in s; None for all of them when there are none."""
    if len(values_s) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(ms.mean())}
    for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The counts, throughputs and latency distributions of the bench's JSON."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    errors = Counter(r.error for r in records if not r.ok)
    cached = [r for r in done if r.cached_tokens is not None]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(errors.most_common(10)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "input_token_throughput": per_s(input_tokens),
        "output_token_throughput": per_s(output_tokens),
        # prompt tokens the server reported found in its prefix cache (None: it reported none)
        "total_cached_tokens": sum(r.cached_tokens for r in cached) if cached else None,
        "cached_token_fraction": (
            sum(r.cached_tokens for r in cached) / input_tokens if cached and input_tokens else None
        ),
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([x for r in done for x in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
    }


MAX_SAMPLES = 5000  # per latency kind kept in the JSON; a CDF needs no more


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Latencies in ms (ITL per chunk) of completed requests, for CDF plots: every value up to
    MAX_SAMPLES, else evenly spaced order statistics, which keep the CDF's shape."""
    done = [r for r in records if r.ok]
    kinds = {
        "ttft_ms": [r.ttft for r in done if r.ttft is not None],
        "itl_ms": [x for r in done for x in r.itl],
        "e2e_ms": [r.e2e for r in done if r.e2e is not None],
    }
    out = {}
    for key, values in kinds.items():
        arr = np.sort(np.asarray(values, dtype=float)) * 1000
        if len(arr) > MAX_SAMPLES:
            arr = arr[np.linspace(0, len(arr) - 1, MAX_SAMPLES).round().astype(int)]
        out[key] = np.round(arr, 3).tolist()
    return out
